"""The installed distribution: pytest finds the plugin, and suites/kernels live in our namespace."""
from importlib.metadata import distribution


def test_entry_point_and_namespace():
    dist = distribution("pytest-precision")
    eps = [ep for ep in dist.entry_points if ep.group == "pytest11"]
    assert [(ep.name, ep.value) for ep in eps] == [("precision", "pytest_precision.plugin")]
    assert "Framework :: Pytest" in dist.metadata.get_all("Classifier")
    import pytest_precision.kernels
    import pytest_precision.suites.softmax

    assert pytest_precision.suites.softmax.SOFTMAX.name == "softmax"
    top = (dist.read_text("top_level.txt") or "pytest_precision").split()
    assert "suites" not in top and "kernels" not in top


def test_the_wheel_holds_every_module(tmp_path):
    """Build the wheel and import every module from it, not from this source tree: a subpackage
    missing from pyproject's package list fails here, where the editable install would hide it."""
    import os
    import shutil
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    source = tmp_path / "source"  # a copy: an in-tree build/ directory would hand stale modules to the wheel
    shutil.copytree(root, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info",
                                                                 "__pycache__", ".pytest_cache", ".hypothesis"))
    # the build backend already here when it is new enough (no download), else pip's isolated build
    offline = ["--no-build-isolation"] if _setuptools_at_least(77) else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), *offline,
                    str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("pytest_precision-*.whl")
    unpacked = tmp_path / "unpacked"
    zipfile.ZipFile(wheel).extractall(unpacked)
    script = f"""
import importlib, pkgutil, sys
sys.path.insert(0, {str(unpacked)!r})
# an editable install of this checkout answers for pytest_precision.* itself: not here
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
import pytest_precision
assert pytest_precision.__file__.startswith({str(unpacked)!r}), pytest_precision.__file__
names = [m.name for m in pkgutil.walk_packages(pytest_precision.__path__, "pytest_precision.")]
for name in names:
    assert importlib.import_module(name).__file__.startswith({str(unpacked)!r}), name
for sub in ("numerics", "baselines", "explain", "speed", "training", "kinds", "reporting", "runner", "suites", "kernels"):
    assert f"pytest_precision.{{sub}}" in names, sub
from pytest_precision.kinds.registry import kinds
print(len(names), [k.name for k in kinds()])
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "['softmax', 'log_softmax', 'attention', 'train_step', 'layer_norm', 'rms_norm', 'cross_entropy', 'op']" \
        in out.stdout
    assert not any(n.startswith(("suites/", "kernels/")) for n in zipfile.ZipFile(wheel).namelist())


def _setuptools_at_least(major: int) -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    return int(setuptools.__version__.split(".")[0]) >= major
