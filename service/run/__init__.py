"""One recalibration run end to end, shared by the CLI, the Python API and the job server.

It owns the run options declared once for every surface (``options``), the model source
a run loads from a checkpoint or a program (``model_source``), Ray start-up and the
embedded local instance (``cluster``), the run itself: load, probe, plan, rank group,
statistics (``recalibrate``), the executor many runs share (``shared``, a sweep's), the report (``report``, ``report_html``) and the files a run
writes, checkpoint and folded ONNX (``exporting``, through ``service.export``). It may
import ``service.export``, ``service.settings`` and ``workers``; never ``jobserver``,
``live``, ``sweep`` or ``cli``, which build on it.
"""
