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
