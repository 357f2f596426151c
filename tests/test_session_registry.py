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


def test_a_session_whose_conftest_raises_leaves_no_registry_open(pytester):
    before = len(registry._SESSIONS)
    pytester.makeconftest(INNER + "\nraise RuntimeError('broken conftest')\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "--precision-suite", "--collect-only", "-q",
                                "--precision-device=cpu")
    assert result.ret != 0
    assert len(registry._SESSIONS) == before
    assert "inner_softmax" not in [t.name for t in registry.registered()]


def test_a_target_registered_outside_any_session_is_seen_by_each_session(pytester):
    process = registry._SESSIONS[0]  # where a script's register() goes before it calls pytest.main
    process.targets["process_softmax"] = registry.Target("process_softmax", _softmax, "softmax")
    try:
        result = pytester.runpytest("-p", "no:cacheprovider", "--precision-suite", "--collect-only", "-q",
                                    "--precision-device=cpu", "--precision-configs=fp32", "-k", "unit")
        assert "softmax[process_softmax-fp32-unit]" in result.stdout.str()
    finally:
        del process.targets["process_softmax"]


def test_the_fused_statistics_a_session_installs_are_put_back_as_it_ends(pytester):
    from pytest_precision import plugin
    from pytest_precision.kernels import error_stats

    def outer(*args, **kwargs):
        raise AssertionError("not called here")

    before = metrics.install_fused_statistics(outer, ())
    try:
        config = pytester.parseconfig()
        plugin._install_fused_statistics(config)
        assert metrics._FUSED[0] is error_stats.error_statistics
        config._ensure_unconfigure()
        assert metrics._FUSED[0] is outer  # the outer session's, as it was
    finally:
        metrics.restore_fused_statistics(before)
