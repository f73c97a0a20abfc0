"""``python -m bnrecal.service.cli``: the ``bnrecal`` command line."""

import sys

from .main import main

main(sys.argv[1:])
