"""The package's shape: no import circles, no module over 450 lines, config a leaf."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "hvdtrain"
MAX_LINES = 450


def _modules() -> dict:
    """``{dotted name: path}`` of every module in the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict) -> set:
    """The package's modules that ``name`` imports anywhere in its code (functions included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            imported |= {f"{base}.{alias.name}" for alias in node.names} | {base}
    # A module's own package's __init__ runs on any import of it: only explicit edges count.
    return {m for m in imported if m in modules and m != "hvdtrain" and m != name}


def test_no_import_circle_inside_the_package():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    state, stack, circles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_config_and_errors_are_leaves():
    """The config tree and the error types import nothing else of hvdtrain's but the errors."""
    modules = _modules()
    assert _imports("hvdtrain.errors", modules["hvdtrain.errors"], modules) == set()
    assert _imports("hvdtrain.config", modules["hvdtrain.config"], modules) == {"hvdtrain.errors"}


def test_no_module_is_over_450_lines():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them; notes that are not API docs go to docs/): {long}"


def test_the_layout_under_test_is_the_packages():
    """The walk above sees the packages the tests mirror (a renamed package would pass it empty)."""
    names = set(_modules())
    assert {"hvdtrain.runtime.dist", "hvdtrain.data.sharding", "hvdtrain.model.sync_bn", "hvdtrain.trainer",
            "hvdtrain.recipe", "hvdtrain.elastic", "hvdtrain.state"} <= names
