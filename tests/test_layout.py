"""The package's shape: no import circles, no module over 450 lines, config a leaf."""
import ast
import pathlib
import re

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
            "hvdtrain.recipe", "hvdtrain.elastic", "hvdtrain.position"} <= names


# Modules without a test module of their own name, and where they are tested instead.
TESTED_ELSEWHERE = {
    "hvdtrain.chief": "rank 0's banner and callbacks: every run; banner lines in test_elastic.py and tools/test_verify.py",
    "hvdtrain.data.labels": "label checks: test_bad_input.py and data/test_in_memory.py, on every kind of data",
    "hvdtrain.data.loading": "opening the configured dataset: every run; ranks with other data in test_bad_input.py",
    "hvdtrain.ending": "every way a run ends, with real ranks: test_faults.py, test_cli.py, test_bad_input.py",
    "hvdtrain.keras2": "Keras 2's SyncBN and the default Keras's layer: test_kerases.py",
    "hvdtrain.keras_recipe": "a Keras model object's recipe steps at 2 ranks: test_keras_step.py; its data forms: data/test_examples.py",
    "hvdtrain.keras_callbacks": "a user's Keras callbacks at 2 ranks: test_users_keras.py, test_api.py",
    "hvdtrain.model.moving_statistics": "per-rank moving statistics averaged: test_trainer.py, model/test_sync_bn_keras*.py",
    "hvdtrain.model.sync_bn_statistics": "masked and unmasked statistics at 2 ranks: model/test_sync_bn*.py",
    "hvdtrain.model.sync_bn_kernels": "the kernels against TensorFlow's ops: model/test_sync_bn.py",
    "hvdtrain.outputs": "model.keras reloaded, curves.png: test_users_keras.py, test_keras3.py, test_install.py",
    "hvdtrain.recipe_steps": "the steps' numbering in test_recipe.py; the steps themselves run in every run",
    "hvdtrain.rundir": "run directories and --resume: test_cli.py, test_checkpoint.py, test_bad_input.py",
    "hvdtrain.runtime.devices": "a runtime started before pinning: runtime/test_dist.py, test_faults.py",
    "hvdtrain.runtime.launcher": "the rank before hvd.init (who reports argument errors): test_bad_input.py, test_faults.py",
    "hvdtrain.step": "the compiled step at N ranks against one process: test_trainer.py (workers/train_steps.py)",
}


def test_tests_mirror_the_package():
    """Each module has ``tests/<its folder>/test_<its name>.py``, or a line above saying where it is tested."""
    tests = pathlib.Path(__file__).resolve().parent
    missing = []
    for name, path in _modules().items():
        if path.name in ("__init__.py", "__main__.py") or name in TESTED_ELSEWHERE:
            continue
        relative = path.relative_to(PACKAGE)
        if not (tests / relative.parent / f"test_{relative.name}").exists():
            missing.append(name)
    assert not missing, f"modules without tests/<folder>/test_<name>.py or a reason in TESTED_ELSEWHERE: {missing}"
    assert set(TESTED_ELSEWHERE) <= set(_modules()), "TESTED_ELSEWHERE names a module that is gone"


def test_test_helpers_live_in_one_folder():
    """tests/ holds test modules and conftest.py; shared helpers are in tests/helpers/, rank scripts in tests/workers/."""
    tests = pathlib.Path(__file__).resolve().parent
    loose = [p.name for p in tests.glob("*.py") if not p.name.startswith("test_") and p.name not in ("__init__.py",
                                                                                                     "conftest.py")]
    assert not loose, f"helper modules loose in tests/: {loose}"
    borrowing = [f"{p.relative_to(tests)}: {line.strip()}" for p in tests.rglob("*.py")
                 for line in p.read_text().splitlines() if re.match(r"\s*from tests\.(\w+\.)*test_\w+ import", line)]
    assert not borrowing, "test modules importing from other test modules (share it in tests/helpers/):\n" + "\n".join(
        borrowing)
