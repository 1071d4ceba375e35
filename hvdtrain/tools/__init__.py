"""Command-line tools around training: ``python -m hvdtrain.tools.<name> --help``."""
