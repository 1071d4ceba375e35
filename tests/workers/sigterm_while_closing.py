"""Worker: hvdtrain's command line, with a SIGTERM that arrives while the finished run closes its
logs (sent by this process to itself, so it lands there every time, as a scheduler's might by chance).

Usage: python -m tests.workers.sigterm_while_closing [hvdtrain flags]
"""
import os
import signal
import sys

from hvdtrain import callbacks
from hvdtrain.cli import main

close_all = callbacks.close_all


def close_all_after_a_sigterm(to_close):
    os.kill(os.getpid(), signal.SIGTERM)  # handled in this (the main) thread before the next line
    close_all(to_close)


callbacks.close_all = close_all_after_a_sigterm
sys.exit(main(sys.argv[1:]))
