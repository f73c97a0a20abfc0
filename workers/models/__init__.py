"""Models and their weights: where a rank's model comes from.

It owns building untrained models from an architecture reference (``architectures``,
with Hugging Face ``transformers`` in ``huggingface``), reading and writing checkpoints
without running code from them (``checkpoints``, with a wrapper's key prefix found in
``checkpoint_prefix``), the submission-time check that a checkpoint fits its
architecture on the meta device (``model_check``), and the model sources a rank builds
from (``sources``: an architecture and its state dict, a program, a caller's module). It
may import torch, ``workers.programs`` (a program source loads its archive) and the
shared helpers at the top of ``workers``; never ``ranks`` or ``engine``.
"""
