"""No stale pointer: every repository path and ``hvdtrain.`` name that the code and docs mention exists."""
import importlib
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md",
         *sorted((REPO / "examples").glob("*.md"))]
# benchmarks/HISTORY.md is dated history: it names the files of its day.
SOURCES = sorted(p for d in ("hvdtrain", "benchmarks", "tests", "examples", "scripts", "launch")
                 for p in (REPO / d).rglob("*") if p.suffix in (".py", ".sh", ".md") and "__pycache__" not in p.parts
                 and p.name != "HISTORY.md" and p not in PAGES)
# A path in the repository: one of its top folders, then a path that ends in a file or folder name.
PATH = re.compile(r"(?<![\w/.-])((?:hvdtrain|tests|benchmarks|scripts|docs|launch|examples|requirements)"
                  r"/[\w./-]*[\w/])")
# Not in quotes, nor after "allreduce ": "hvdtrain.start" and the like name Horovod's collectives.
NAME = re.compile(r"(?<![\w.\"'])(?<!allreduce )(hvdtrain(?:\.[A-Za-z_]\w*)+)")


def _mentions(pattern, files):
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in pattern.finditer(line):
                yield path.relative_to(REPO), number, match.group(1)


def test_every_repository_path_mentioned_exists():
    missing = [f"{where}:{n}: {path}" for where, n, path in _mentions(PATH, PAGES + SOURCES)
               if not (REPO / path.rstrip("/.")).exists() and "<" not in path and "*" not in path
               and not path.startswith(("tests/tmp", "benchmarks/figures/"))]
    assert not missing, "stale paths:\n" + "\n".join(missing)


def test_every_markdown_link_resolves():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "#")):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve()
            if not resolved.exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
            elif anchor and resolved.suffix == ".md":
                headings = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                            for h in re.findall(r"^#+ (.*)$", resolved.read_text(), re.M)}
                if anchor not in headings:
                    broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.timeout(600)
def test_every_hvdtrain_name_mentioned_exists():
    """Each dotted hvdtrain name in code, comments and docs is importable (modules renamed leave none behind)."""
    names = {}
    for where, n, name in _mentions(NAME, PAGES + SOURCES):
        names.setdefault(name.rstrip("."), f"{where}:{n}")
    stale = [f"{where}: {name}" for name, where in sorted(names.items()) if not _resolves(name)]
    assert not stale, "stale names:\n" + "\n".join(stale)


def test_the_readme_is_a_ten_minute_read():
    """What it is, the two commands, two examples, the recipe, the main flags, where to read more."""
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: reference material goes to docs/"
    headings = [line for line in lines if line.startswith("## ")]
    assert headings == ["## From the command line", "## From Python", "## What it trains", "## What it does", "## Main flags",
                        "## Read more"]


@pytest.mark.timeout(600)
def test_every_import_of_hvdtrain_and_test_helpers_resolves():
    """An import of hvdtrain's (or the tests' helpers') names anywhere -- inside functions too, which
    run only in some ranks or benchmarks -- names something that exists: a moved name breaks here."""
    import ast

    missing = []
    for path in SOURCES:
        if path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(("hvdtrain",
                                                                                                      "tests")):
                missing += [f"{path.relative_to(REPO)}:{node.lineno}: {node.module}.{alias.name}"
                            for alias in node.names if not _resolves(f"{node.module}.{alias.name}")]
    assert not missing, "imports of names that do not exist:\n" + "\n".join(missing)
