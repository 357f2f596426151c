"""The built-in kinds are written as a user's kind is: ``suites/`` imports from the package only
through its public namespaces, never from a module behind them (``pytest_precision.kinds``'s
docstring draws the line)."""
import ast
import pathlib

import pytest

import pytest_precision.kinds

ROOT = pathlib.Path(__file__).resolve().parents[1]
# a kind author's surface (and a kind on the training engine's), the user's API, the strategies, the
# training specs; and the
# project's own Triton kernels, which only the built-in kinds offer as targets
PUBLIC = {"pytest_precision", "pytest_precision.kinds", "pytest_precision.kinds.training", "pytest_precision.strategies",
          "pytest_precision.training", "pytest_precision.kernels.builtin"}


def _imports(source: str):
    """(line, module) of every import of the package in ``source``, at any depth."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("pytest_precision"):
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("pytest_precision"):
                    yield node.lineno, alias.name


def internal_imports(source: str) -> list[tuple[int, str]]:
    return [(line, module) for line, module in _imports(source) if module not in PUBLIC]


def test_suites_import_only_the_public_surface():
    found = [f"suites/{path.name}:{line}: {module}" for path in sorted(ROOT.joinpath("suites").glob("*.py"))
             for line, module in internal_imports(path.read_text())]
    assert not found, "suites/ imports internal modules (use pytest_precision.kinds):\n" + "\n".join(found)


@pytest.mark.parametrize("planted", ["from pytest_precision.kinds.fresh import Plan",
                                     "def f():\n    from pytest_precision.numerics.budgets import PEER_FACTOR",
                                     "import pytest_precision.kinds.tables",
                                     "from pytest_precision.training.verdicts import judge_run"])
def test_the_scan_finds_a_planted_internal_import(planted):
    assert internal_imports(planted)


def test_every_public_name_is_there_and_documented():
    """Each name the kinds namespace exports exists and its docstring names it."""
    import re

    doc = pytest_precision.kinds.__doc__
    for name in pytest_precision.kinds.__all__:
        assert hasattr(pytest_precision.kinds, name), name
        # as a name in backticks (``NO_VARIANT``, :class:`Kind`), not a part of another word
        assert re.search(rf"`{re.escape(name)}`", doc), f"pytest_precision.kinds exports {name}; its docstring does not say so"


def test_every_name_of_the_training_kinds_namespace_is_there_and_documented():
    import re

    import pytest_precision.kinds.training as surface

    for name in surface.__all__:
        assert hasattr(surface, name), name
        assert re.search(rf"`{re.escape(name)}`", surface.__doc__), f"{surface.__name__} exports {name} undocumented"
