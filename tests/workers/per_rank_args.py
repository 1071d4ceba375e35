"""Worker: hvdtrain's command line, with ``{rank}`` in every argument replaced by this process's
launcher rank, so that each rank can be given its own file (e.g. ``--data-dir data{rank}.npz``)."""
import sys

from hvdtrain.cli import main
from hvdtrain.dist import launcher_rank

rank = str(launcher_rank())
sys.exit(main([arg.replace("{rank}", rank) for arg in sys.argv[1:]]))
