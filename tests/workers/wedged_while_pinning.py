"""Worker: hvdtrain's command line, where rank 1 wedges in its first device query after
``hvd.init()`` (as on a faulted GPU) while rank 0 goes on to the pinning collective.

Usage: python -m tests.workers.wedged_while_pinning [hvdtrain flags]
"""
import sys
import time

import tensorflow as tf

from hvdtrain.cli import main
from hvdtrain.runtime.launcher import launcher_rank

if launcher_rank() == 1:
    tf.config.list_physical_devices = lambda *args, **kwargs: time.sleep(3600)
sys.exit(main(sys.argv[1:]))
