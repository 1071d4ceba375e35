"""Command line: ``hvdtrain`` / ``python -m hvdtrain``, one process per rank under a launcher.

    horovodrun -np 2 --gloo python -m hvdtrain
    mpirun -np 4 -bind-to none -map-by slot python -m hvdtrain --model resnet20 --epochs 30
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Tuple

from hvdtrain.config import SECTION_TITLES, Config, ConfigError, declared_settings
from hvdtrain.config_file import config_from_flat, config_to_yaml, read_config_file
from hvdtrain.ending import EXIT_ERROR, leave, quiet_exit
from hvdtrain.errors import HvdtrainError, RunEnded
from hvdtrain.console import say
from hvdtrain.runtime.launcher import launcher_rank
from hvdtrain.runtime.signals import defer_stop_signals, install_stop_handlers



class _RankAwareParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (not its usage block), printed from rank 0 only;
    every rank still exits with status 2."""

    def error(self, message):
        if launcher_rank() == 0:
            say(f"{self.prog}: error: {message} (see {self.prog} --help)", sys.stderr)
            sys.exit(EXIT_ERROR)
        sys.exit(quiet_exit())


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to each flag's help, except where the default is None: those flags
    say in their help what happens without them."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, made from the config's declared settings (:func:`hvdtrain.config.setting`);
    ``--help`` documents every flag with its default and unit."""
    p = _RankAwareParser(
        prog="hvdtrain",
        description="Data-parallel training on Horovod + TensorFlow 2. Start one process per rank with "
                    "horovodrun or mpirun, e.g. 'horovodrun -np 2 --gloo python -m hvdtrain'. 'hvdtrain verify "
                    "--help': check that a model trains at N ranks as at one process.",
        formatter_class=_DefaultsHelpFormatter,
    )
    p.add_argument("--config", metavar="FILE", default=None,
                   help="YAML run file of settings (as --print-config writes them); flags given override it")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved settings (defaults, --config, flags) as YAML and exit")
    groups = {}
    for key, field, _ in declared_settings():
        section = key.rpartition(".")[0]
        if section not in groups:
            groups[section] = p.add_argument_group(SECTION_TITLES[section])
        meta, dest = field.metadata, flag_dest(field.metadata["flag"])
        requires = meta["requires"] if not meta["choices"] and not meta["switch"] else None
        help_text = (meta["help"] + (f"; {requires.text}" if requires else "")).replace("%", "%%")  # argparse's %
        if meta["switch"]:
            groups[section].add_argument(meta["flag"], dest=dest, action="store_true", help=help_text)
        else:
            groups[section].add_argument(meta["flag"], dest=dest, type=_type_of(field), default=field.default,
                                         choices=meta["choices"], metavar=meta["metavar"], help=help_text)
    return p


def flag_dest(flag: str) -> str:
    """argparse's attribute for ``flag``: ``--batch-size`` -> ``batch_size``."""
    return flag[2:].replace("-", "_")


def _type_of(field) -> type:
    """The type argparse converts a flag's value to: the field's (``Optional[str]`` is str)."""
    return {"int": int, "float": float}.get(str(field.type), str)


# Each flag's setting in the config tree; "!" marks a flag that switches its setting off.
FLAG_SETTINGS = {flag_dest(field.metadata["flag"]): ("!" if field.metadata["switch"] == "off" else "") + key
                 for key, field, _ in declared_settings()}
_NOT_GIVEN = object()


def parse_command_line(argv: Optional[List[str]] = None) -> Tuple[Config, bool]:
    """Parse ``argv`` into a validated :class:`Config`: the defaults, then the settings of
    ``--config FILE``, then the flags given, each overriding the one before.

    Returns:
        ``(config, print_config)``: the config and whether ``--print-config`` was given.

    Raises:
        HvdtrainError: for a bad config file, or a value outside its range, naming the flag (or
            the file's key, where the value came from the file). Type errors in flags exit
            through argparse.
    """
    # Flags not given keep the sentinel (argparse sets defaults only for attributes not already
    # present), so that a config file's setting is overridden by given flags only.
    given = build_parser().parse_args(argv, argparse.Namespace(**{dest: _NOT_GIVEN for dest in FLAG_SETTINGS}))
    from_file = read_config_file(given.config) if given.config else {}
    from_flags = {}
    for dest, key in FLAG_SETTINGS.items():
        value = getattr(given, dest)
        if value is not _NOT_GIVEN:
            from_flags[key.lstrip("!")] = (not value) if key.startswith("!") else value
    if "data.function" in from_flags and "data.dataset" not in from_flags:
        from_flags["data.dataset"] = "function"  # --data names a dataset of its own
    if from_flags.get("data.dataset", "function") != "function" and "data.function" not in from_flags:
        from_flags["data.function"] = None  # --dataset replaces a run file's --data
    try:
        return config_from_flat({**from_file, **from_flags}), given.print_config
    except ConfigError as e:
        key = FLAG_SETTINGS.get(flag_dest(e.flag), "").lstrip("!")
        if key in from_file and key not in from_flags:
            raise HvdtrainError(f"config file {given.config}: {key} ({e.flag}) must be {e.requirement}, "
                                f"got {e.value!r}") from None
        raise


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point. Returns the process exit status: 0, or 2 for any error on any rank; exits with 130
    on Ctrl-C, 75 on SIGTERM or SIGUSR1 once every rank stopped at one step and it was checkpointed
    (143 before training), the watchdog with 3 on a stall and 2 on a lost rank (docs/faults.md)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["verify"]:  # hvdtrain verify: N ranks against one process (no launcher needed)
        from hvdtrain.tools.verify import main as verify

        return verify(argv[1:])
    try:
        config, print_config = parse_command_line(argv)
    except HvdtrainError as e:  # the same flags on every rank: the launcher's rank 0 reports
        if launcher_rank() != 0:
            return quiet_exit()
        say(f"hvdtrain: error: {e}", sys.stderr)
        return EXIT_ERROR
    if print_config:
        if launcher_rank() == 0:
            print(config_to_yaml(config), end="")
        return 0
    from hvdtrain.runtime.tf_banner import import_tensorflow

    import_tensorflow()  # after argument checks, so --help is fast; without TensorFlow's banner
    from hvdtrain.recipe import run

    install_stop_handlers()  # launchers pass Ctrl-C on as SIGTERM, as Slurm does on scancel
    try:
        run(config)
    except RunEnded as ended:
        return leave(ended)
    defer_stop_signals()
    return 0


if __name__ == "__main__":
    sys.exit(main())
