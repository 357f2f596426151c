"""Each package's ``__init__.py`` docstring says what every module of its folder is, and names no
module that is not there; the README's Layout section names the modules of the folders its table
leaves out (the top-level package, ``benchmarks/``, ``suites/``, ``kernels/``), and no other.

The convention: a package docstring names a module by its name without ``.py``, in double backticks
followed by a colon, as an item of a list: ``- ``store``: where goldens live;`` (several may share an
item, separated by semicolons). A name in double backticks without a colon after it (``train_step``,
``pytest_precision.plugin``) is not read as a module."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent for p in [*(ROOT / "pytest_precision").glob("*/__init__.py"),
                                     ROOT / "suites" / "__init__.py", ROOT / "kernels" / "__init__.py"])
NAMED = re.compile(r"``([A-Za-z_][A-Za-z0-9_]*)``:")


def modules(folder: Path) -> set[str]:
    return {p.stem for p in folder.glob("*.py") if p.name != "__init__.py"}


def named(docstring: str) -> set[str]:
    return set(NAMED.findall(docstring))


def docstring(folder: Path) -> str:
    return ast.get_docstring(ast.parse((folder / "__init__.py").read_text(encoding="utf-8"))) or ""


def mismatch(folder: Path, root: Path = ROOT) -> str | None:
    """What is wrong with ``folder``'s package docstring, in words, or None."""
    present, listed = modules(folder), named(docstring(folder))
    missing, stale = sorted(present - listed), sorted(listed - present)
    if not missing and not stale:
        return None
    where = folder.relative_to(root).as_posix()
    return (f"{where}/__init__.py docstring: " + "; ".join(
        part for part in (f"modules not named: {', '.join(f'{m}.py' for m in missing)}" if missing else "",
                          f"names no module of {where}/: {', '.join(stale)}" if stale else "") if part))


def test_the_packages_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in PACKAGES}
    assert {"suites", "kernels", "pytest_precision/training", "pytest_precision/kinds"} <= names
    assert all(modules(p) for p in PACKAGES)


@pytest.mark.parametrize("folder", PACKAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_package_docstring_names_each_module_of_its_folder(folder):
    problem = mismatch(folder)
    assert problem is None, problem


def test_a_missing_and_a_stale_name_are_reported_with_the_package(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text('"""A package.\n\n- ``alpha``: one;\n- ``gone``: was here."""\n')
    for name in ("alpha", "beta"):
        (package / f"{name}.py").write_text("")
    assert mismatch(package, tmp_path) == ("pkg/__init__.py docstring: modules not named: beta.py; "
                                           "names no module of pkg/: gone")
    assert named("``run`` / ``bench_call`` and ``spec``: the contract") == {"spec"}


def _layout() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### Layout"):]
    return "\n".join(line for line in section.splitlines() if not line.startswith("|"))  # the table: test_layers


def test_the_readme_layout_names_the_modules_outside_its_table():
    folders = [ROOT / "pytest_precision", ROOT / "pytest_precision" / "benchmarks", ROOT / "suites", ROOT / "kernels"]
    present = {p.name for folder in folders for p in folder.glob("*.py") if p.name != "__init__.py"}
    mentioned = set(re.findall(r"`([a-z_0-9]+\.py)`", _layout())) - {"__init__.py"}
    assert sorted(present - mentioned) == [], "README Layout: modules not named"
    assert sorted(mentioned - present) == [], "README Layout: names no module of pytest_precision/, benchmarks/, suites/ or kernels/"
