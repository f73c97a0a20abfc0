"""``python -m bnrecal.service.cli``: the ``bnrecal`` command line."""

from . import script

script()
