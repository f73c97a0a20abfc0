"""One recalibration run end to end, shared by the CLI, the Python API and the job server.

The run itself, at this level: the run options declared once for every surface
(``options``), the model source a run loads from a checkpoint or a program
(``model_source``), Ray start-up and the embedded local instance (``cluster``), the one
run core and its control (``core``), where its ranks execute (``executors``; ``shared``,
the executor a sweep's runs share), a request and its result (``request``), the pipeline
from a request to its files (``recalibrate``) and the terminal's progress (``progress``).
Two rooms below it: ``report`` (the typed report, its HTML page and charts) and
``outputs`` (the phases after the statistics that make the exported files: the exports,
the INT8 phase, the onnxruntime passes they run on the ranks). It may import
``service.export``, ``service.settings`` and ``workers``; never ``jobserver``, ``live``,
``sweep`` or ``cli``, which build on it.
"""
