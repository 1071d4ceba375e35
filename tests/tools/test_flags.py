"""One home for each flag: the parser, run files and docs/flags.md are made from the config's declarations."""
import pathlib
import re

from hvdtrain.cli import FLAG_SETTINGS, build_parser
from hvdtrain.config import Config, declared_settings
from hvdtrain.config_file import leaf_types
from hvdtrain.tools.flags import flags_markdown

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_docs_flags_md_is_what_the_declarations_print():
    assert (REPO / "docs" / "flags.md").read_text() == flags_markdown(), \
        "docs/flags.md is stale: python -m hvdtrain.tools.flags > docs/flags.md"


def test_every_setting_has_one_flag_and_every_flag_one_setting():
    parser_flags = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")}
    declared = [field.metadata["flag"] for _, field, _ in declared_settings()]
    assert len(declared) == len(set(declared))
    assert parser_flags == set(declared) | {"--help", "--config", "--print-config"}
    assert {key.lstrip("!") for key in FLAG_SETTINGS.values()} == set(leaf_types(Config))


def test_the_parsers_defaults_are_the_configs():
    parsed = vars(build_parser().parse_args([]))
    for key, field, _ in declared_settings():
        dest = field.metadata["flag"][2:].replace("-", "_")
        assert parsed[dest] == (False if field.metadata["switch"] else field.default), key


def test_every_flag_the_readme_and_docs_name_exists():
    """README.md's and docs/'s ``hvdtrain`` command lines and flag tables name only real flags."""
    flags = {o for a in build_parser()._actions for o in a.option_strings}
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    unknown = set()
    for page in pages:
        for line in page.read_text().splitlines():
            command = line.partition("python -m hvdtrain ")[2]
            if command and not command.startswith("verify"):
                unknown |= set(re.findall(r"\s(--[a-z][a-z0-9-]+)", " " + command)) - flags
            if line.startswith("| `--"):
                flag = re.match(r"\| `(--[a-z0-9-]+)", line).group(1)
                unknown |= {flag} - flags
    assert not unknown, f"flags named in the docs that hvdtrain does not have: {sorted(unknown)}"
