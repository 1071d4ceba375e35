"""``python -m hvdtrain``: see :mod:`hvdtrain.cli`."""
import sys

from hvdtrain.cli import main

sys.exit(main())
