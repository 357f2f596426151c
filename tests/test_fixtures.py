"""The precision_config and golden fixtures in users' own tests."""
from machine import configs_run

from pytest_precision.numerics.configs import CONFIG_IDS

pytest_plugins = ["pytester"]

USER_TEST = """
import pytest
import torch

def my_softmax(x):
    xf = x.float()
    e = (xf - xf.amax(-1, keepdim=True)).exp()
    return (e / e.sum(-1, keepdim=True)).to(x.dtype)

@pytest.mark.parametrize("n", [7, 300])
def test_softmax(precision_config, golden, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(4, n, generator=g) * 20
    inp = precision_config.prepare(x)
    with precision_config:
        out = my_softmax(inp.value)
    golden.check(out, torch.softmax(inp.exact, -1), inputs=x)
"""


def test_precision_config_ids_and_golden_roundtrip(pytester):
    pytester.makepyfile(test_user=USER_TEST)
    r = pytester.runpytest("--collect-only", "-q", "--precision-configs=fp32,fp16,amp-bf16")
    ids = {line for line in r.stdout.lines if "::" in line}
    assert ids == {f"test_user.py::test_softmax[{c}-{n}]" for c in ("fp32", "fp16", "amp-bf16") for n in (7, 300)}
    missing = pytester.runpytest("--precision-configs=fp16", "-k", "7")
    missing.assert_outcomes(failed=1)
    missing.stdout.fnmatch_lines([
        "*golden baseline: no golden baseline at *precision_baselines/test_user/test_softmax*7*/fp16.npz",
        "*if this run is right, accept it with: pytest 'test_user.py::test_softmax[[]fp16-7[]]' --precision-update-baselines"])
    ran = len(configs_run())  # the CPU: every config but tf32
    counts = dict(passed=2 * ran, skipped=2 * (len(CONFIG_IDS) - ran))
    pytester.runpytest("--precision-update-baselines").assert_outcomes(**counts)
    assert (pytester.path / "precision_baselines" / "test_user" / "test_softmax_7_" / "amp-bf16.npz").exists()
    pytester.runpytest().assert_outcomes(**counts)
    # `-m precision` selects tests that use the fixtures
    pytester.runpytest("-m", "precision", "--precision-configs=fp32").assert_outcomes(passed=2)


def test_golden_catches_a_regressed_user_function(pytester):
    pytester.makepyfile(test_user=USER_TEST)
    pytester.runpytest("--precision-update-baselines", "--precision-configs=bf16").assert_outcomes(passed=2)
    worse = USER_TEST.replace("xf = x.float()", "xf = x")  # now computes in bf16 arithmetic
    pytester.makepyfile(test_user=worse)
    r = pytester.runpytest("--precision-configs=bf16", "-k", "300")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines([
        "*test_user.py::test_softmax[[]bf16-300[]]: regressed against its golden (max ULP * > budget *",
        "*worst elements:*",
        "*if this run is right, accept it with: pytest 'test_user.py::test_softmax[[]bf16-300[]]' --precision-update-baselines"])
