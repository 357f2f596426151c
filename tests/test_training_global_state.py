"""torch's process-wide state a training target's callables leave changed (the step, model_fn,
optimizer_fn, batch_fn, loss_fn) fails that target's cases naming the callable and the change, is
restored before the next case, and writes no golden; a step that changes state inside and puts it
back, enters the config's autocast or draws random numbers is not flagged, under fp32 and under
amp-bf16, whose autocast the step enters."""
import dataclasses

import pytest
import torch

from pytest_precision.numerics.global_state import snapshot
from pytest_precision.training import TrainingError, TrainSpec, check_determinism, run_training, TRAIN_CONFIGS
from pytest_precision.training.distributed import exact_gradients

pytest_plugins = ["pytester"]

# a small regression model, one step: each session takes a few seconds
CONFTEST = """
import contextlib

import torch
import torch.nn.functional as F
from torch import nn
import pytest_precision
from pytest_precision.numerics.inputs import seeded_normal
from pytest_precision.training import standard_step


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x, y):
        return F.mse_loss(self.fc2(F.dropout(torch.relu(self.fc1(x)), 0.1)), y)


def batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return seeded_normal(g, 64, 16), seeded_normal(g, 64, 8)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def clean_step(model, optimizer, scaler, batch, autocast):
    # changes state inside and puts it back, draws random numbers (and dropout masks)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        torch.rand(3)
    torch.set_grad_enabled(False)
    torch.set_grad_enabled(True)
    return standard_step(model, optimizer, scaler, batch, autocast)


def leaky_step(model, optimizer, scaler, batch, autocast):
    loss = standard_step(model, optimizer, scaler, batch, autocast)
    {LEAK}
    return loss


def leaky_model():
    model = Net()
    {MODEL_LEAK}
    return model


# registered first: its cases run before clean's, which would run under the leaked state
pytest_precision.register("leaky", pytest_precision.TrainSpec(leaky_model, sgd, batch, steps=1, step_fn=leaky_step),
                          kind="train_step")
pytest_precision.register("clean", pytest_precision.TrainSpec(Net, sgd, batch, steps=1, step_fn=clean_step),
                          kind="train_step")
"""
STATE = "left process-wide state changed"


@pytest.fixture(autouse=True)
def _state_restored():
    """No session leaves torch's state changed in this process (pytester runs them in it); what
    one leaked (without the snapshots around the calls) is put back, out of the other tests."""
    before = snapshot()
    yield
    changed = before.changes(snapshot(rng=False))
    before.restore()
    assert changed == []


def _session(pytester, leak="pass", model_leak="pass", configs="fp32"):
    pytester.makeconftest(CONFTEST.replace("{LEAK}", leak).replace("{MODEL_LEAK}", model_leak))
    pytester.makeini("[pytest]\n")
    return pytester.runpytest("--precision-suite", f"--precision-configs={configs}", "--precision-no-speed",
                              "-p", "no:cacheprovider", "-k", "train_step", "--precision-update-baselines")


def _goldens(pytester, target):
    return sorted(p.name for p in (pytester.path / "precision_baselines" / "train_step" / target).rglob("*")
                  if p.is_file())


@pytest.mark.parametrize("leak, said", [
    ("torch.set_default_dtype(torch.float64)", "default dtype float32 -> float64"),
    ("torch.set_grad_enabled(False)", "grad mode True -> False"),
    ("torch.use_deterministic_algorithms(True)", "deterministic algorithms False -> True"),
])
def test_a_step_that_leaks_fails_its_case_and_no_other(pytester, leak, said):
    result = _session(pytester, leak=leak)
    # leaky's case fails, then clean's runs as it would alone (it seeds, builds and steps under
    # torch's defaults) and passes
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([f"*train_step[[]leaky-fp32-trajectory[]]*target 'leaky' (train_step) under config "
                                 f"fp32: step 0 (step_fn) {STATE}: {said} (restored;*restore what step_fn changes*"])
    assert _goldens(pytester, "leaky") == []  # a failed case writes no golden
    assert _goldens(pytester, "clean") == ["fp32.json", "fp32.npz"]


def test_a_step_that_leaks_only_under_amp_fails_that_case_and_a_correct_step_passes(pytester):
    """amp-bf16: the step enters the config's autocast itself (``autocast()``). clean enters and
    leaves it; leaky leaves one more entered, only where the config has an autocast: its amp-bf16
    case fails, naming that config, and its fp32 case and clean's two pass, with no word of the
    state."""
    result = _session(pytester, configs="fp32,amp-bf16", leak="if autocast is not contextlib.nullcontext: "
                                                             "torch.autocast('cpu', dtype=torch.bfloat16).__enter__()")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines([f"*train_step[[]leaky-amp-bf16-trajectory[]]*target 'leaky' (train_step) under config "
                                 f"amp-bf16: step 0 (step_fn) {STATE}: autocast on cpu False -> True; autocast nesting "
                                 "0 -> 1 (restored;*"])
    said = [line for line in result.outlines if STATE in line]  # the failure, its summary and its unaccepted golden
    assert said and all("target 'leaky' (train_step) under config amp-bf16: step 0" in line for line in said)
    assert _goldens(pytester, "leaky") == ["fp32.json", "fp32.npz"]
    assert _goldens(pytester, "clean") == ["amp-bf16.json", "amp-bf16.npz", "fp32.json", "fp32.npz"]


def test_a_model_fn_that_leaks_fails_naming_it(pytester):
    result = _session(pytester, model_leak="torch.set_default_dtype(torch.float64)")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([f"*train_step[[]leaky-fp32-trajectory[]]*target 'leaky' (train_step): model_fn() "
                                 f"{STATE}: default dtype float32 -> float64 (restored;*restore what model_fn changes*"])
    assert _goldens(pytester, "leaky") == []
    assert _goldens(pytester, "clean") == ["fp32.json", "fp32.npz"]


# the other callables, called directly (no session): each leak is named and restored at once


def _net():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def _loss(model, batch):
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _dtype_leaking(fn):
    def leaking(*a):
        out = fn(*a)
        torch.set_default_dtype(torch.float64)
        return out
    return leaking


@pytest.mark.parametrize("field, said", [
    ("batch_fn", "batch_fn(0)"),
    ("optimizer_fn", "optimizer_fn(params)"),
    ("loss_fn", "step 0 (loss_fn, in the standard step)"),
])
def test_each_callable_of_a_run_is_judged(field, said):
    spec = TrainSpec(_net, _sgd, _batch, steps=1, loss_fn=_loss)
    spec = dataclasses.replace(spec, **{field: _dtype_leaking(getattr(spec, field))})
    with pytest.raises(TrainingError, match=rf"^here: {said.replace('(', '[(]').replace(')', '[)]')} {STATE}: "
                                           "default dtype float32 -> float64 [(]restored;"):
        run_training(spec, TRAIN_CONFIGS["fp32"], "cpu", "here")
    assert torch.get_default_dtype() is torch.float32


def test_determinism_check_and_the_ddp_exact_gradients_judge_model_fn():
    spec = TrainSpec(_dtype_leaking(_net), _sgd, _batch, steps=1, loss_fn=_loss)
    with pytest.raises(TrainingError, match=rf"^here: model_fn[(][)] {STATE}: default dtype float32 -> float64"):
        check_determinism(spec, "here")
    assert torch.get_default_dtype() is torch.float32
    with pytest.raises(TrainingError, match=rf"^model_fn[(][)] {STATE}: default dtype float32 -> float64"):
        exact_gradients(spec, [_batch(0), _batch(1)])
    assert torch.get_default_dtype() is torch.float32
