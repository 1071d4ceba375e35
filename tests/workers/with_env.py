"""Worker: hvdtrain's command line in an environment of its own: the leading ``NAME=VALUE``
arguments are set before hvdtrain (and Keras) is imported, e.g. ``KERAS_BACKEND=jax``."""
import os
import sys

args = sys.argv[1:]
while args and "=" in args[0] and not args[0].startswith("-"):
    name, value = args.pop(0).split("=", 1)
    os.environ[name] = value

from hvdtrain.cli import main  # noqa: E402

sys.exit(main(args))
