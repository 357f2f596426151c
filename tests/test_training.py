"""The pieces of pytest_precision.training: stochastic rounding, the fp8 Linear emulation, what a
run records (skipped steps, loss scale, first non-finite step) and the comparison of two runs."""
import math

import pytest
import torch
from torch import nn

from pytest_precision.numerics.configs import fp8_roundtrip
from pytest_precision.inputs import seeded_normal
from pytest_precision.training import (TRAIN_CONFIGS, TrainSpec, TrainingError, compare_trajectories, fp8_linears,
                                       run_training, stochastic_round)


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    ulp = 2.0 ** -7  # bf16 at 1.0
    x = torch.full((200_000,), 1.0 + 0.3 * ulp)
    r = stochastic_round(x, generator=torch.Generator().manual_seed(0)).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + ulp}
    # E[r] = x: P(up) = 0.3, standard error sqrt(0.21 / n) ulp
    assert abs(float(r.double().mean()) - float(x[0])) < 4 * math.sqrt(0.21 / x.numel()) * ulp
    # round to nearest would always go down: the bias stochastic rounding removes
    assert float(x.to(torch.bfloat16)[0]) == 1.0


def test_stochastic_rounding_negative_values_and_specials():
    ulp = 2.0 ** -7
    x = torch.full((100_000,), -(1.0 + 0.75 * ulp))
    r = stochastic_round(x, generator=torch.Generator().manual_seed(1)).double()
    assert abs(float(r.mean()) - float(x[0])) < 4 * math.sqrt(0.1875 / x.numel()) * ulp
    specials = torch.tensor([math.inf, -math.inf, math.nan, 0.0, 3.0])
    out = stochastic_round(specials, generator=torch.Generator().manual_seed(2))
    assert out.dtype == torch.bfloat16
    assert out[0] == math.inf and out[1] == -math.inf and torch.isnan(out[2]) and out[3] == 0 and out[4] == 3
    a = stochastic_round(x[:100], generator=torch.Generator().manual_seed(5))
    b = stochastic_round(x[:100], generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)  # seeded: the same draws every run
    with pytest.raises(ValueError, match="only bfloat16"):
        stochastic_round(x, torch.float16)


def test_fp8_linears_quantise_forward_and_gradients_and_restore():
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    x = seeded_normal(torch.Generator().manual_seed(1), 4, 16).requires_grad_(True)
    exact = lin(x)
    with fp8_linears(lin) as n:
        assert n == 1
        y = lin(x)
        y.backward(torch.ones_like(y))
    xq, _ = fp8_roundtrip(x.detach(), torch.float8_e4m3fn)
    wq, _ = fp8_roundtrip(lin.weight.detach(), torch.float8_e4m3fn)
    torch.testing.assert_close(y, xq @ wq.t() + lin.bias, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(y, exact, rtol=1e-4, atol=1e-4)  # quantised, not the fp32 product
    # grad_out of ones is exact in e5m2, so dx is the e4m3 weight summed over the outputs
    torch.testing.assert_close(x.grad, torch.ones(4, 8) @ wq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lin.weight.grad, torch.ones(8, 4) @ xq, rtol=1e-6, atol=1e-6)
    assert torch.equal(lin(x), exact)  # the original forward is back


class _Big(nn.Module):
    """A loss of about 30: with the initial loss scale 65536 its fp16 gradients overflow, and the
    GradScaler skips steps while it halves the scale."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return (self.fc(x) * 10.0).pow(2).mean()


def _batch(i):
    return (seeded_normal(torch.Generator().manual_seed(i), 16, 8),)


def test_scaler_skips_and_scale_history_are_recorded():
    spec = TrainSpec(_Big, lambda p: torch.optim.SGD(p, lr=1e-6), _batch, steps=6)
    run = run_training(spec, TRAIN_CONFIGS["amp-fp16"], "cpu")
    assert run.skipped and run.skipped[0] == 0
    assert run.scales[0] == 32768.0  # halved after the skipped first step
    assert all(b <= a for a, b in zip(run.scales, run.scales[1:]) if b is not None)
    assert run.first_nonfinite is None  # the loss is finite: overflowing scaled gradients are the scaler's to skip
    ref = run_training(spec, TRAIN_CONFIGS["fp32"], "cpu", keep_grads=True)
    m = compare_trajectories(run, ref)
    assert m.skipped == run.skipped
    assert run.skipped == list(range(len(run.skipped))) and run.first_step == len(run.skipped)
    assert m.grad_sqnr_db > 30  # compared with fp32's gradients of the same step and batch


def test_identical_runs_compare_as_equal():
    spec = TrainSpec(_Big, lambda p: torch.optim.SGD(p, lr=1e-6), _batch, steps=3)
    a = run_training(spec, TRAIN_CONFIGS["fp32"], "cpu", keep_grads=True)
    b = run_training(spec, TRAIN_CONFIGS["fp32"], "cpu")
    m = compare_trajectories(b, a)
    assert m.max_loss_deviation == 0 and m.grad_sqnr_db == math.inf and m.param_sqnr_db == math.inf
    assert m.update_ratio == 1.0 and max(m.underflow_rate.values()) == 0 and max(m.update_lost_rate.values()) == 0


def test_first_nonfinite_step_is_named():
    class Explodes(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return (self.w * x).sum() * (math.inf if self.calls == 2 else 1.0)

    spec = TrainSpec(Explodes, lambda p: torch.optim.SGD(p, lr=0.1), lambda i: torch.ones(4), steps=3)
    run = run_training(spec, TRAIN_CONFIGS["fp32"], "cpu")
    assert run.first_nonfinite is not None and run.first_nonfinite[0] == 1


def test_errors_name_the_callable():
    spec = TrainSpec(lambda: "not a module", lambda p: None, _batch, steps=1)
    with pytest.raises(TrainingError, match=r"model_fn\(\) returned str, expected an nn.Module"):
        run_training(spec, TRAIN_CONFIGS["fp32"], "cpu")

    def bad_batch(i):
        raise KeyError(i)
    spec = TrainSpec(_Big, lambda p: torch.optim.SGD(p, lr=0.1), bad_batch, steps=1)
    with pytest.raises(TrainingError, match=r"batch_fn\(0\) raised KeyError"):
        run_training(spec, TRAIN_CONFIGS["fp32"], "cpu")
    spec = TrainSpec(lambda: nn.LayerNorm(8), lambda p: torch.optim.SGD(p, lr=0.1), _batch, steps=1)
    with pytest.raises(TrainingError, match="no nn.Linear layer for the fp8 emulation"):
        run_training(spec, TRAIN_CONFIGS["fp8-e4m3"], "cpu")


def _metrics(**changes):
    spec = TrainSpec(_Big, lambda p: torch.optim.SGD(p, lr=1e-6), _batch, steps=3)
    ref = run_training(spec, TRAIN_CONFIGS["fp32"], "cpu", keep_grads=True)
    m = compare_trajectories(run_training(spec, TRAIN_CONFIGS["fp32"], "cpu"), ref)
    for k, v in changes.items():
        setattr(m, k, v)
    return m


def test_trajectory_regression_budget_catches_each_metric():
    """The golden's budget on each training metric: within it nothing, past it a named problem."""
    from pytest_precision.training.baseline import _budget, _accepted, _violations

    accepted = _metrics(max_loss_deviation=1e-3, underflow_rate={"fc.weight": 0.1}, update_lost_rate={"fc.bias": 0.0})
    budget = _budget(_accepted(accepted), TRAIN_CONFIGS["amp-bf16"])
    assert _violations(accepted, budget) == []
    worse = {
        "max_loss_deviation": (dict(max_loss_deviation=5e-3), "accuracy", "max loss deviation from fp32 0.005 > budget"),
        "underflow": (dict(underflow_rate={"fc.weight": 0.5}), "underflow", "gradient-underflow rate 50.0 % in fc.weight > budget 12.0 %"),
        "update_lost": (dict(update_lost_rate={"fc.bias": 0.5}), "accuracy", "update-lost rate 50.0 % in fc.bias > budget 2.0 %"),
        "skipped": (dict(skipped=[0, 1]), "overflow", "2 steps skipped by the GradScaler > budget 1"),
        "nonfinite": (dict(first_nonfinite=(1, "loss")), "nan", "non-finite at step 1, accepted none"),
    }
    for name, (change, category, sentence) in worse.items():
        m = _metrics(**{**dict(max_loss_deviation=1e-3, underflow_rate={"fc.weight": 0.1},
                               update_lost_rate={"fc.bias": 0.0}), **change})
        problems = _violations(m, budget)
        assert len(problems) == 1 and problems[0][0] == category and problems[0][1].startswith(sentence), (name, problems)


def test_ddp_golden_catches_a_regression(tmp_path):
    from pytest_precision.baselines import BaselineStore
    from pytest_precision.distributed import HookComparison
    from pytest_precision.baselines.lifecycle import BaselineCheck
    from pytest_precision.training.baseline import DDPEntry

    def golden(update):
        return BaselineCheck(BaselineStore(tmp_path), "train_step/t/trajectory", "ddp-fp16", "cpu", update, "pytest ... --update")

    def _check_golden(check, config, result):
        res = check.check(DDPEntry(config, result))
        check.commit()  # under the update flag the golden is written once the case's verdict allows
        return res

    good = HookComparison("fp16", 70.0, 0.01, {"w": 0.0}, 0, 1.0, 1.0)
    assert _check_golden(golden(True), TRAIN_CONFIGS["ddp-fp16"], good).updated.endswith(
        "SQNR >= 64 dB, underflow rate <= 2.0 %, overflow <= 0")
    assert _check_golden(golden(False), TRAIN_CONFIGS["ddp-fp16"], good).problems == []
    bad = HookComparison("fp16", 60.0, 0.01, {"w": 0.3}, 2, 1.0, 1.0)
    problems = _check_golden(golden(False), TRAIN_CONFIGS["ddp-fp16"], bad).problems
    assert problems == [("accuracy", "gradient SQNR 60 dB < budget 64 dB"),
                        ("underflow", "gradient-underflow rate 30.0 % > budget 2.0 %"),
                        ("overflow", "overflow 2 > 0 allowed")]


def test_first_nonfinite_gradient_is_named():
    class InfGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * math.inf

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return InfGrad.apply(self.w * x).sum()

    spec = TrainSpec(Net, lambda p: torch.optim.SGD(p, lr=0.1), lambda i: torch.ones(4), steps=2)
    run = run_training(spec, TRAIN_CONFIGS["fp32"], "cpu")
    assert run.first_nonfinite == (0, "gradient of w")
