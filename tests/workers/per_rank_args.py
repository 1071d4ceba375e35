"""Worker: hvdtrain's command line, with ``{rank}`` in every argument replaced by this process's
launcher rank and ``{host}`` by the host name an elastic driver started it on
(``HOROVOD_HOSTNAME``), so that each rank or host can be given its own file."""
import os
import sys

from hvdtrain.cli import main
from hvdtrain.runtime.launcher import launcher_rank

fields = {"{rank}": str(launcher_rank()), "{host}": os.environ.get("HOROVOD_HOSTNAME", "")}
args = sys.argv[1:]
for field, value in fields.items():
    args = [arg.replace(field, value) for arg in args]
sys.exit(main(args))
