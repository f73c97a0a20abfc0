"""The engine: the calibrating forward and its math, pure torch, no Ray.

It owns finding a model's BatchNorm layers (``batchnorm``), the forms a batch-norm call
takes (``bn_calls``), the calibrating forward that answers each call with batch
statistics and accumulates float64 moments (``calibrator``, ``moments``), the modes
(``modes``), the compute layout (``memory_format``), and one rank's passes over its
shard (``calibration``, ``evaluation``), which combine moments through the ``Collective``
they are handed (``collective``). It may import torch, numpy, ``workers.data`` (the
steps a pass reads) and the shared helpers at the top of ``workers``; never Ray, and
nothing of ``models``, ``programs`` or ``ranks``, so the same math runs in a rank, in a
test or in the caller's own process.
"""
