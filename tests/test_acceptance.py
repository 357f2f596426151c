"""Only validated results become goldens: under --precision-update-baselines a case that fails its
oracle or peer check, its counts or its kind's contract writes nothing, says "not accepted" with
the reason, and the run exits non-zero; a dtype the config cannot produce breaks the contract in
every config."""
import json

import pytest

pytest_plugins = ["pytester"]

HEADER = "import torch\nimport pytest_precision\n"
CORRECT = """
@pytest_precision.register("mine", kind="softmax")
def mine(x):
    return torch.softmax(x.float(), -1).to(x.dtype)
"""
ALL_NAN = """
@pytest_precision.register("mine", kind="softmax")
def mine(x):
    return torch.full_like(x, float("nan"))
"""
FLOAT64 = """
@pytest_precision.register("mine", kind="softmax")
def mine(x):
    return torch.softmax(x.double(), -1)  # the right values in a dtype no config produces
"""


def _run(pytester, *args):
    return pytester.runpytest("--precision-suite", "--precision-no-speed", "-p", "no:cacheprovider", "-k",
                              "softmax and mine-", *args)


def _golden(pytester, config="fp32"):
    d = pytester.path / "precision_baselines" / "softmax" / "mine" / "unit"
    return d / f"{config}.npz", d / f"{config}.json"


def test_a_failing_result_is_not_accepted_and_the_old_golden_stays(pytester):
    pytester.makeconftest(HEADER + CORRECT)
    _run(pytester, "--precision-configs=fp32", "-k", "softmax and mine-fp32-unit",
         "--precision-update-baselines").assert_outcomes(passed=1)
    npz, meta = _golden(pytester)
    before = (npz.read_bytes(), meta.read_bytes())
    pytester.makeconftest(HEADER + ALL_NAN)
    result = _run(pytester, "--precision-configs=fp32", "-k", "softmax and mine-fp32-unit", "--precision-update-baselines")
    result.assert_outcomes(failed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([
        "*softmax[[]mine-fp32-unit[]]: FAIL nan,accuracy (oracle: NaN 4096 > 0 allowed*",
        "*max abs nan, RMS abs nan, max rel nan, SQNR nan dB, cosine nan*",  # never 0, inf dB or cosine 1
        "*golden baseline not accepted: the case failed (oracle: NaN 4096 > 0 allowed*); nothing written*",
        "*precision baselines not accepted: 1*",
        "softmax/mine/unit [[]fp32[]] on cpu-* not accepted: oracle: NaN 4096 > 0 allowed*",
        "*| mine *| fp32 *| *1 | *inf | *nan | *nan | *0 | *0 | *4096 | * | * | FAIL 1/1: accuracy,nan*",  # then the contract columns
    ])
    assert "precision baselines written" not in result.stdout.str()
    assert (npz.read_bytes(), meta.read_bytes()) == before


def test_a_failing_result_writes_no_new_golden(pytester):
    pytester.makeconftest(HEADER + ALL_NAN)
    result = _run(pytester, "--precision-configs=fp32", "-k", "softmax and mine-fp32-unit", "--precision-update-baselines")
    result.assert_outcomes(failed=1)
    assert not (pytester.path / "precision_baselines").exists()


@pytest.mark.parametrize("config", ["fp32", "amp-bf16", "amp-fp16", "fp8-e4m3", "bf16"])
def test_a_dtype_the_config_cannot_produce_breaks_the_contract(pytester, config):
    pytester.makeconftest(HEADER + FLOAT64)
    result = _run(pytester, f"--precision-configs={config}", "-k", f"softmax and mine-{config}-unit",
                  "--precision-update-baselines")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"*target 'mine' (softmax) under config {config} on regime unit: output dtype "
                                 "torch.float64, the kind gives *under " + config + "*"])
    result.stdout.fnmatch_lines([f"softmax/mine/unit [[]{config}[]] on cpu-* not accepted: *output dtype torch.float64*"])
    assert "3.7e" not in result.stdout.str()
    assert not (pytester.path / "precision_baselines").exists()


def test_the_dtypes_each_config_can_produce():
    import torch

    from pytest_precision.kinds.registry import get_kind
    from pytest_precision.numerics.configs import CONFIGS

    x = {"x": torch.ones(2, dtype=torch.float32)}
    kind = get_kind("softmax")
    assert kind.output_dtypes(CONFIGS["fp32"], x) == (torch.float32,)
    assert kind.output_dtypes(CONFIGS["amp-bf16"], x) == (torch.float32, torch.bfloat16)
    assert kind.output_dtypes(CONFIGS["fp8-e4m3"], x) == (torch.float32, torch.float8_e4m3fn)
    half = {"q": torch.ones(1, dtype=torch.float16), "k": torch.ones(1), "v": torch.ones(1)}
    assert get_kind("attention").output_dtypes(CONFIGS["fp16"], half) == (torch.float16,)


TRAINING = """
import torch
import torch.nn.functional as F
from torch import nn
import pytest_precision
from pytest_precision.numerics.inputs import seeded_normal


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x, y):
        return (self.fc(x) * 1e5 - y).square().mean()  # fc(x) * 1e5 is past fp16's range under autocast


def batch(i):
    g = torch.Generator().manual_seed(i)
    return seeded_normal(g, 32, 16), seeded_normal(g, 32, 8)


pytest_precision.register("net", pytest_precision.TrainSpec(Net, lambda p: torch.optim.SGD(p, lr=1e-12), batch, steps=2),
                          kind="train_step")
"""


def test_training_cases_go_through_the_same_acceptance(pytester):
    pytester.makeconftest(TRAINING)
    result = pytester.runpytest("--precision-suite", "-p", "no:cacheprovider", "--precision-configs=fp32,amp-fp16",
                                "-k", "train_step and not noscale", "--precision-update-baselines")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*train_step/net/trajectory [[]amp-fp16[]] on cpu-* not accepted: "
                                 "non-finite loss at step 0*"])
    gold = pytester.path / "precision_baselines" / "train_step" / "net" / "trajectory"
    assert sorted(p.name for p in gold.iterdir()) == ["fp32.json", "fp32.npz"]


def test_a_user_test_that_fails_after_its_golden_check_writes_nothing(pytester):
    pytester.makepyfile(test_user="""
import torch

def test_softmax(precision_config, golden):
    x = torch.linspace(-3, 3, 32).reshape(4, 8)
    inp = precision_config.prepare(x)
    with precision_config:
        out = inp.value.softmax(-1)
    golden.check(out, torch.softmax(inp.exact, -1), inputs=x)
    assert out.sum() < 0, "the test's own check fails"
""")
    result = pytester.runpytest("--precision-configs=fp32", "-p", "no:cacheprovider", "--precision-update-baselines")
    result.assert_outcomes(failed=1)
    assert not (pytester.path / "precision_baselines").exists()
    pytester.makepyfile(test_user=(pytester.path / "test_user.py").read_text().replace("out.sum() < 0", "out.sum() > 0"))
    pytester.runpytest("--precision-configs=fp32", "-p", "no:cacheprovider",
                       "--precision-update-baselines").assert_outcomes(passed=1)
    assert json.loads((pytester.path / "precision_baselines/test_user/test_softmax/fp32.json").read_text())["budgets"]
