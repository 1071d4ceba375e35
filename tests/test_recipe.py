"""One numbering of the recipe: README's "What it does", recipe.run's comments and recipe_steps agree.

(The recipe itself runs in every multi-process test: tests/test_cli.py, tests/test_trainer.py, ...)
"""
import inspect
import pathlib
import re

from hvdtrain import recipe, recipe_steps

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _readme_steps():
    section = README.read_text().split("## What it does", 1)[1].split("\n## ", 1)[0]
    return [(int(n), name, fn) for n, name, fn in re.findall(r"^(\d+)\. \*\*(.+?)\*\* \(`(\w+)`", section, re.M)]


def test_the_readme_recipe_steps_docstring_and_run_number_the_steps_alike():
    readme = _readme_steps()
    docstring = [(int(n), re.sub(r" \(.*\)$", "", name), fn) for n, name, fn in
                 re.findall(r"^(\d+)\. (.+?) -- :func:`(\w+)`", recipe_steps.__doc__, re.M)]
    comments = [(int(n), name.lower()) for n, name in re.findall(r"# (\d+)\. ([\w ]+?):", inspect.getsource(recipe.run))]
    assert [n for n, _, _ in readme] == list(range(1, 10))
    assert docstring == readme
    assert comments == [(n, name) for n, name, _ in readme]


def test_each_step_is_a_function_that_run_calls_in_order():
    source = inspect.getsource(recipe.run)
    positions = []
    for n, _, fn in _readme_steps():
        assert callable(getattr(recipe_steps, fn)), fn
        positions.append(source.index(f"steps.{fn}("))
    assert positions == sorted(positions)
    assert len(source.splitlines()) <= 80, "recipe.run reads top to bottom in at most 80 lines"
