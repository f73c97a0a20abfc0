"""``torch.export`` programs (``.pt2``) as a model source: no architecture code anywhere.

``load_program`` (``loading.py``) reads an uploaded archive without running anything from it
(``archive.py``, ``checks.py``) and gives a :class:`ProgramModule` (``module.py``) whose
batch-norm calls (``sites.py``) the calibrator answers like a module's. ``write_archive``
writes the recalibrated program: the same archive with new running buffers. This room
may import ``workers.engine`` (the layer and call forms it reports) and the shared helpers
at the top of ``workers``; never ``models`` or ``ranks``.
"""

from __future__ import annotations

from .archive import ProgramArchive, write_archive
from .loading import check_program, load_program
from .module import BatchRule, ProgramInput, ProgramModule

__all__ = [
    "BatchRule", "ProgramArchive", "ProgramInput", "ProgramModule", "check_program", "load_program",
    "write_archive",
]
