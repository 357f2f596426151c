"""What a session registers is its own (kinds.registry): a session run inside another (pytester's)
neither sees the outer one's targets and kinds nor drops them, and what the plugin installs for a
session (the fused statistics on CUDA) is removed when it ends."""
import pytest

import pytest_precision
from pytest_precision.kinds import registry
from pytest_precision.numerics import metrics

pytest_plugins = ["pytester"]

INNER = """
import pytest_precision

@pytest_precision.register("inner_softmax", kind="softmax")
def inner_softmax(x):
    return x.float().softmax(-1).to(x.dtype)
"""


def _softmax(x):
    return x.float().softmax(-1).to(x.dtype)


class _Kind(pytest_precision.Kind):
    name = "outer_kind"

    def run(self, case, baseline):
        raise AssertionError("not run here")

    def bench_call(self, case):
        return None

    def trace_call(self, case):
        return None


def test_a_session_inside_another_neither_sees_nor_drops_the_outer_registrations(pytester):
    outer = registry.open_session()
    try:
        pytest_precision.register("outer_softmax", _softmax, kind="softmax")
        pytest_precision.register_kind(_Kind())
        pytester.makeconftest(INNER)
        result = pytester.runpytest("-p", "no:cacheprovider", "--precision-suite", "--collect-only", "-q",
                                    "--precision-device=cpu", "--precision-configs=fp32", "-k", "unit")
        collected = result.stdout.str()
        assert "softmax[inner_softmax-fp32-unit]" in collected
        assert "outer_softmax" not in collected and "outer_kind" not in collected
        assert [t.name for t in registry.registered()] == ["outer_softmax"]
        assert "outer_kind" in registry.kind_names()
    finally:
        registry.close_session(outer)
    assert "outer_kind" not in registry.kind_names()
    assert "outer_softmax" not in [t.name for t in registry.registered()]


def test_a_session_that_ends_drops_its_registrations(pytester):
    pytester.makeconftest(INNER)
    pytester.runpytest("-p", "no:cacheprovider", "--precision-suite", "--collect-only", "-q", "--precision-device=cpu")
    assert "inner_softmax" not in [t.name for t in registry.registered()]


def test_the_fused_statistics_a_session_installed_are_removed_as_it_ends(pytester, monkeypatch):
    from pytest_precision import plugin

    def statistics(*args, **kwargs):
        raise AssertionError("not called here")

    monkeypatch.setattr(plugin, "_install_fused_statistics",
                        lambda: metrics.install_fused_statistics(statistics, ()) or True)
    config = pytester.parseconfig()
    config.stash[plugin._FUSED_KEY] = plugin._install_fused_statistics()
    assert metrics._FUSED is not None
    plugin.pytest_unconfigure(config)
    assert metrics._FUSED is None
