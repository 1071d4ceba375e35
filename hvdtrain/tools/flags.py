"""Print the reference of every flag as Markdown, made from the config's declarations.

    python -m hvdtrain.tools.flags > docs/flags.md

Each setting is declared once (:func:`hvdtrain.config.setting`); ``tests/tools/test_flags.py``
fails when ``docs/flags.md`` differs from what this prints.
"""
from __future__ import annotations

import sys

from hvdtrain.config import SECTION_TITLES, declared_settings

HEADER = """# Flags

Every flag of `hvdtrain` (`python -m hvdtrain`), with its setting's key, type, default and range.
A key such as `optim.base_lr` is `optim: {base_lr: 0.1}` in a run file (`--config run.yaml`) and
`optim={"base_lr": 0.1}` in `hvdtrain.fit`. Flags given override the run file, which overrides the
defaults; `hvdtrain --print-config` prints the settings a command resolves to.
This page is generated: `python -m hvdtrain.tools.flags > docs/flags.md`.

Besides these: `--config FILE` (a YAML run file) and `--print-config` (print the resolved settings and exit).
"""


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("<", "\\<")


def flags_markdown() -> str:
    """The Markdown reference: one table per group of flags, in ``--help``'s order."""
    lines, section = [HEADER.rstrip("\n")], None
    for key, field, _ in declared_settings():
        meta = field.metadata
        if key.rpartition(".")[0] != section:
            section = key.rpartition(".")[0]
            lines += ["", f"## {SECTION_TITLES[section].capitalize()}", "",
                      "| flag | key | type | default | range | what it does |", "| --- | --- | --- | --- | --- | --- |"]
        if meta["switch"]:
            kind = "switch: sets " + ("false" if meta["switch"] == "off" else "true")
        else:
            kind = str(field.type).replace("Optional[str]", "str or null")
        requires = meta["requires"].text if meta["requires"] is not None and not meta["switch"] else ""
        lines.append(f"| `{meta['flag']}` | `{key}` | {kind} | `{field.default!r}` | {_cell(requires)} | "
                     f"{_cell(meta['help'])} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    sys.stdout.write(flags_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
