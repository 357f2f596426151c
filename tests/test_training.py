"""The pieces of pytest_precision.training: stochastic rounding, the fp8 Linear emulation, what a
run records (skipped steps, loss scale, first non-finite step), the contract (optimizer_fn taking
the model, loss_fn, determinism), the comparison of two runs, rates against the float64 step, the
golden budgets (a 3x degradation of each accepted metric fails, a correct run's spread does not)
and the fp32 reference."""
import dataclasses
import math
import time

import pytest
import torch
from torch import nn

from pytest_precision.numerics.configs import fp8_roundtrip
from pytest_precision.numerics.inputs import seeded_normal
from pytest_precision.training import (TRAIN_CONFIGS, MarkovText, TrainSpec, TrainingError, check_determinism,
                                       compare_trajectories, exact_first_step, emulated_fp8_linears, run_training, significant,
                                       stochastic_round, underflow_rates)


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
    with emulated_fp8_linears(lin) as n:
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
    ref = run_training(spec, TRAIN_CONFIGS["fp32"], "cpu")
    m = compare_trajectories(run, ref, TRAIN_CONFIGS["amp-fp16"])
    assert m.skipped == run.skipped
    assert run.skipped == list(range(len(run.skipped))) and run.first_step == len(run.skipped)
    assert m.grad_sqnr_db > 30  # compared with fp32's gradients of the same step and batch


def test_identical_runs_compare_as_equal():
    spec = TrainSpec(_Big, lambda p: torch.optim.SGD(p, lr=1e-6), _batch, steps=3)
    a = run_training(spec, TRAIN_CONFIGS["fp32"], "cpu")
    b = run_training(spec, TRAIN_CONFIGS["fp32"], "cpu")
    exact = exact_first_step(spec, 0, "cpu")
    m = compare_trajectories(b, a, TRAIN_CONFIGS["fp32"], exact)
    assert m.max_loss_deviation == 0 and m.grad_sqnr_db == math.inf and m.param_sqnr_db == math.inf
    assert m.worst_grad_sqnr_db == math.inf and m.group_grad_sqnr_db == {"all parameters": math.inf}
    assert m.grad_norm_ratio == [1.0, 1.0, 1.0] and m.worst_grad_norm_ratio == 1.0
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


def _attention_model() -> type:
    """The suite tests' attention layer with a q/k/v bias (training_helpers.ATTENTION_MODEL)."""
    from training_helpers import ATTENTION_MODEL

    namespace = {"torch": torch, "nn": nn, "F": torch.nn.functional}
    exec(ATTENTION_MODEL.format(SCALE=""), namespace)
    return namespace["TinyAttention"]


_Attention = _attention_model()


def _attention_loss(model, batch):
    return model(*batch)[1]


_TEXT = MarkovText(vocab_size=32, batch_size=4, block_size=16)


def test_an_exactly_zero_gradient_is_not_underflow():
    """The key bias: rounding noise in fp32 (1e-9 here) and 0 once rounded to fp16 (as DDP's fp16
    hook sends it); against fp32 a third of the bias would be 'underflow', against the float64
    step, where it is noise too, none is."""
    spec = TrainSpec(_Attention, lambda p: torch.optim.SGD(p, lr=0.1), _TEXT, steps=1, loss_fn=_attention_loss)
    fp32 = run_training(spec, TRAIN_CONFIGS["fp32"], "cpu")
    exact = exact_first_step(spec, 0, "cpu")
    key = slice(16, 32)
    sent = {n: (g / 2).half().float() * 2 for n, g in fp32.grads0.items()}  # divided by the world size, in fp16
    assert bool((sent["qkv.bias"][key] == 0).all())
    assert 0 < float(fp32.grads0["qkv.bias"][key].abs().max()) < 1e-8  # fp32 holds noise
    assert float(exact.grads["qkv.bias"][key].abs().max()) < 1e-15  # float64 too, far less
    # the planted judge (against fp32, every nonzero counted) sees a third of the bias underflow
    naive = int(((sent["qkv.bias"] == 0) & (fp32.grads0["qkv.bias"] != 0)).sum()) / 48
    assert naive >= 1 / 3
    judged = underflow_rates(sent, exact.grads, torch.finfo(torch.float16).smallest_normal)
    assert judged.rate["qkv.bias"] == 0.0 and judged.elements["qkv.bias"] == 32  # q and v parts only
    assert not bool(significant(exact.grads["qkv.bias"])[key].any())
    # a whole run in amp-fp16 (noise there too, not 0) against the float64 step: nothing counted
    m = compare_trajectories(run_training(spec, TRAIN_CONFIGS["amp-fp16"], "cpu"), fp32, TRAIN_CONFIGS["amp-fp16"], exact)
    assert max(m.underflow_rate.values()) == 0.0 and max(m.update_lost_rate.values()) == 0.0


def test_underflow_counts_within_the_range_at_the_loop_scale():
    exact = {"w": torch.tensor([1e-3, 1e-9, 1e-20, 0.0], dtype=torch.float64)}
    out = {"w": torch.tensor([1e-3, 0.0, 0.0, 0.0])}
    # at loss scale 65536 fp16 holds 1e-9 (6.6e-5 scaled): lost within range
    scaled = underflow_rates(out, exact, 6.1e-5 / 65536)
    assert scaled.rate == {"w": 0.5} and scaled.elements == {"w": 2} and scaled.below_range == {}
    # unscaled, 1e-9 is below fp16's range: shown apart, not counted; 1e-20 is rounding noise (2^-24 of 1e-3)
    plain = underflow_rates(out, exact, 6.1e-5)
    assert plain.rate == {"w": 0.0} and plain.below_range == {"w": 1.0}


def test_update_lost_counts_only_updates_fp32_weights_keep():
    from pytest_precision.training import ExactStep, update_lost_rates

    initial = {"w": torch.ones(3, dtype=torch.float64)}
    # 1e-9 at a weight of 1.0 is below half an fp32 ULP (6e-8): fp32 loses it too
    exact = ExactStep(0, {}, {"w": torch.tensor([1e-3, 1e-3, 1e-9], dtype=torch.float64)}, initial)
    lost, elements = update_lost_rates({"w": torch.tensor([True, False, False])}, exact)
    assert lost == {"w": 0.5} and elements == {"w": 2}


def test_optimizer_fn_may_take_the_model_and_loss_fn_gives_the_loss():
    class WithConfigure(_Attention):
        def configure_optimizers(self, lr):
            decay = [p for p in self.parameters() if p.dim() >= 2]
            rest = [p for p in self.parameters() if p.dim() < 2]
            return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=lr)

    def optimizer(model):  # a first parameter named model gets the model
        return model.configure_optimizers(1e-3)

    spec = TrainSpec(WithConfigure, optimizer, _TEXT, steps=2, loss_fn=_attention_loss)
    run = run_training(spec, TRAIN_CONFIGS["fp32"], "cpu")
    assert len(run.groups) == 2 and "qkv.weight" in run.groups[0] and "qkv.bias" in run.groups[1]
    assert len(run.losses) == 2 and run.first_step == 0
    # without a loss_fn the standard step says what to add
    with pytest.raises(TrainingError, match=r"returned tuple of 2 \(Tensor, Tensor\), not a scalar loss.*loss_fn"):
        run_training(TrainSpec(WithConfigure, optimizer, _TEXT, steps=1), TRAIN_CONFIGS["fp32"], "cpu")
    with pytest.raises(TrainingError, match=r"optimizer_fn returned NoneType"):
        run_training(TrainSpec(_Attention, lambda model: None, _TEXT, steps=1, loss_fn=_attention_loss),
                     TRAIN_CONFIGS["fp32"], "cpu")


def test_a_step_that_trains_nothing_is_the_targets_error_not_a_pass():
    """A step that never calls optimizer.step(), one that steps without backpropagating, and one whose
    loss is multiplied by 0 would agree with their own fp32 runs in every config; each is named.
    Under a GradScaler a skipped step is the scaler's verdict (amp-fp16 is not refused here), and
    the same step written right runs."""
    def step(trains=True, backward=True, factor=1.0):
        def step_fn(model, optimizer, scaler, batch, autocast):
            optimizer.zero_grad(set_to_none=True)
            with autocast():
                loss = _attention_loss(model, batch) * factor
            if backward:
                scaler.scale(loss).backward()
            if trains:
                scaler.step(optimizer)
                scaler.update()
            return loss
        return step_fn

    def spec(step_fn):
        return TrainSpec(_Attention, lambda p: torch.optim.SGD(p, lr=0.1), _TEXT, steps=2, step_fn=step_fn,
                         loss_fn=_attention_loss)

    fp32 = TRAIN_CONFIGS["fp32"]
    with pytest.raises(TrainingError, match=r"^t: optimizer.step\(\) never ran in the 2 step\(s\), in float32 where no "
                                            r"GradScaler skips a step: nothing was trained"):
        run_training(spec(step(trains=False)), fp32, "cpu", "t")
    with pytest.raises(TrainingError, match=r"no parameter had a gradient when optimizer.step\(\) ran \(2 of the 2 step\(s\)\)"
                                            r".*step_fn must backpropagate its loss"):
        run_training(spec(step(backward=False)), fp32, "cpu", "t")
    with pytest.raises(TrainingError, match=r"every gradient optimizer.step\(\) saw in the 2 step\(s\) it ran was exactly 0"):
        run_training(spec(step(factor=0.0)), fp32, "cpu", "t")
    assert run_training(spec(step(trains=False)), TRAIN_CONFIGS["amp-fp16"], "cpu").skipped == [0, 1]
    # gradients that underflow to 0 are what amp-fp16-noscale exists to show, not the target's error
    run_training(spec(step(factor=1e-30)), TRAIN_CONFIGS["amp-fp16-noscale"], "cpu")
    assert run_training(spec(step()), fp32, "cpu").first_step == 0
    # the standard step: the message names the loss_fn, the user's code in it
    zero = TrainSpec(_Attention, lambda p: torch.optim.SGD(p, lr=0.1), _TEXT, steps=1,
                     loss_fn=lambda m, b: _attention_loss(m, b) * 0)
    with pytest.raises(TrainingError, match=r"exactly 0: .*\(a loss in loss_fn that does not depend"):
        run_training(zero, fp32, "cpu", "t")

    def closure_step(model, optimizer, scaler, batch, autocast):
        def closure():  # LBFGS: the backward runs inside step(), after the pre-hook saw no gradient
            optimizer.zero_grad()
            loss = _attention_loss(model, batch)
            loss.backward()
            return loss
        return optimizer.step(closure)

    # step(closure) (SGD evaluates it once, at the start): the gradients recorded are the closure's,
    # those the step applied, not the previous step's (none at the first); one evaluation is a step
    # like any other (Lightning's loop steps so), LBFGS's several are not micro-batches (Trajectory.closure)
    sgd = TrainSpec(_Attention, lambda p: torch.optim.SGD(p, lr=0.1), _TEXT, steps=2, step_fn=closure_step,
                    loss_fn=_attention_loss)
    plain = TrainSpec(_Attention, lambda p: torch.optim.SGD(p, lr=0.1), _TEXT, steps=2, loss_fn=_attention_loss)
    closed, stepped = run_training(sgd, fp32, "cpu"), run_training(plain, fp32, "cpu")
    assert not closed.closure and not stepped.closure and closed.first_step == 0
    for step in (0, 1):
        assert closed.grads[step].keys() == stepped.grads[step].keys()
        assert all(torch.equal(closed.grads[step][n], stepped.grads[step][n]) for n in stepped.grads[step])
    lbfgs = TrainSpec(_Attention, lambda p: torch.optim.LBFGS(p, lr=0.1, max_iter=2), _TEXT, steps=1,
                      step_fn=closure_step, loss_fn=_attention_loss)
    evaluated = run_training(lbfgs, fp32, "cpu")
    assert evaluated.grads[0] and evaluated.closure


def test_markov_text_repeats_itself_and_is_contiguous():
    a, b = _TEXT(3), MarkovText(vocab_size=32, batch_size=4, block_size=16)(3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert a[0].shape == (4, 16) and a[0].is_contiguous() and a[1].is_contiguous()
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])  # targets are the next tokens
    assert not torch.equal(_TEXT(3)[0], _TEXT(4)[0])
    with pytest.raises(ValueError, match="vocab_size must be a positive int"):
        MarkovText(vocab_size=0)


def test_a_spec_that_does_not_repeat_itself_is_named():
    def unseeded(i):
        return torch.randint(0, 32, (4, 17))[:, :-1].contiguous(), torch.randint(0, 32, (4, 16))

    spec = TrainSpec(_Attention, lambda p: torch.optim.SGD(p, lr=0.1), unseeded, steps=2, loss_fn=_attention_loss)
    with pytest.raises(TrainingError, match=r"batch_fn\(0\) returned different data on two calls"):
        check_determinism(spec, "target 't'")

    def model_from_its_own_generator():
        lin = nn.Linear(4, 4)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(4, 4, generator=torch.Generator().manual_seed(time.perf_counter_ns())))
        return lin

    spec = TrainSpec(model_from_its_own_generator, lambda p: torch.optim.SGD(p, lr=0.1), _batch, steps=1)
    with pytest.raises(TrainingError, match=r"model_fn\(\) built different models on two calls .*parameter weight differs"):
        check_determinism(spec, "target 't'")
    check_determinism(TrainSpec(_Attention, lambda p: torch.optim.SGD(p, lr=0.1), _TEXT, steps=2), "t")  # repeats


# ---- golden budgets: what a correct run's spread passes, what a 3x degradation fails -----------------

_ACCEPTED = {"max_loss_deviation": 1e-4, "grad_sqnr_db": {"group 0": 45.0, "group 1": 50.0}, "worst_grad_sqnr_db": 30.0,
             "param_sqnr_db": 40.0, "grad_norm_ratio": 0.99, "update_ratio": 1.02,
             "underflow_rate": {"w": [0.1, 1000]}, "update_lost_rate": {"b": [0.2, 1000]}, "skipped_steps": 1,
             "first_nonfinite_step": None}


def _budget_for(acc: dict):
    """The budget a golden derives from ``acc`` (accepted metrics as the golden's JSON holds them)."""
    from pytest_precision.training.budget import TrajectoryAccepted, TrajectoryBudget

    return TrajectoryBudget.from_accepted(TrajectoryAccepted.from_json(acc))


def _violations(acc: dict, budget) -> list[tuple[str, str]]:
    """(category, sentence) for each way ``acc`` (as the golden's JSON holds it) is past ``budget``."""
    from pytest_precision.training.budget import TrajectoryAccepted

    return [(p.category, p.sentence) for p in budget.violations(TrajectoryAccepted.from_json(acc))]


def _degraded(acc: dict, metric: str, factor: float) -> dict:
    """``acc`` with one metric's error multiplied by ``factor``."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in acc.items()}
    if metric == "max_loss_deviation":
        out[metric] = acc[metric] * factor
    elif metric == "grad_sqnr_db":
        out[metric] = {g: v - 20 * math.log10(factor) for g, v in acc[metric].items()}
    elif metric.endswith("sqnr_db"):
        out[metric] = acc[metric] - 20 * math.log10(factor)
    elif metric.endswith("ratio"):
        out[metric] = math.exp(math.log(acc[metric]) * factor)
    else:  # a rate
        out[metric] = {n: [min(1.0, r * factor), count] for n, (r, count) in acc[metric].items()}
    return out


ERROR_METRICS = ("max_loss_deviation", "grad_sqnr_db", "worst_grad_sqnr_db", "param_sqnr_db", "grad_norm_ratio",
                 "update_ratio", "underflow_rate", "update_lost_rate")
_SPREAD_OF = {"max_loss_deviation": "loss_deviation", "grad_sqnr_db": "grad_sqnr", "worst_grad_sqnr_db": "worst_grad_sqnr",
              "param_sqnr_db": "param_sqnr", "grad_norm_ratio": "grad_norm_ratio", "update_ratio": "update_ratio"}


def _spread_factor(metric: str) -> float:
    """The largest factor another machine moves a correct run's metric by: the measured ratio, or
    for a rate (a count, 100 of 1000 in _ACCEPTED) what another summation order adds to the count."""
    from pytest_precision.training.limits import SPREAD, count_bound

    return count_bound(100) / 100 if metric.endswith("rate") else SPREAD[_SPREAD_OF[metric]][0]


@pytest.mark.parametrize("metric", ERROR_METRICS)
def test_a_3x_degradation_fails_and_the_measured_spread_passes(metric):
    budget = _budget_for(_ACCEPTED)
    assert _violations(_ACCEPTED, budget) == []
    # the largest machine-to-machine ratio measured for a correct run stays inside the budget
    assert _violations(_degraded(_ACCEPTED, metric, _spread_factor(metric)), budget) == []
    problems = _violations(_degraded(_ACCEPTED, metric, 3.0), budget)
    assert len(problems) == 1, problems


def test_skipped_steps_and_a_new_nonfinite_step_fail_the_golden():
    budget = _budget_for(_ACCEPTED)
    assert _violations(dict(_ACCEPTED, skipped_steps=2), budget) == []
    assert _violations(dict(_ACCEPTED, skipped_steps=3), budget) == [
        ("overflow", "3 steps skipped by the GradScaler > budget 2")]
    assert _violations(dict(_ACCEPTED, first_nonfinite_step=4), budget) == [("nan", "non-finite at step 4, accepted none")]


def test_the_committed_goldens_fail_a_3x_degradation_of_each_metric():
    """Every accepted metric of the built-in GPT's goldens, three times worse, fails its budget
    (metrics at the absolute floor of fp32's noise, or perfect ones such as fp32's, excepted)."""
    import json
    from pathlib import Path

    from pytest_precision.training.limits import SPREAD, rate_budget_count

    root = Path(__file__).resolve().parents[1] / "baselines" / "train_step" / "tiny_gpt" / "trajectory"
    checked = 0
    for path in sorted(root.glob("*.json")):
        if path.stem.startswith(("ddp-", "fsdp-")):
            continue
        for key, record in json.loads(path.read_text())["budgets"].items():
            acc = record["outputs"]["trajectory"]["accepted"]
            budget = _budget_for(acc)
            assert budget.to_json() == record["outputs"]["trajectory"]["budget"], (path.name, key)
            for metric in ERROR_METRICS:
                value = acc[metric]
                if metric.endswith("rate"):
                    # a count: 3x fails where it is past 1.5x and what another summation order adds
                    # (none lost, three times past every element, or within that slack, excepted)
                    counts = [(round(r * n), n) for r, n in value.values()]
                    if not any(c and 3 * c <= n and 3 * c > rate_budget_count(c, 1.5) for c, n in counts):
                        continue
                    assert _violations(_degraded(acc, metric, 3.0), budget), (path.name, key, metric)
                    checked += 1
                    continue
                ratio, absolute = SPREAD[_SPREAD_OF[metric]]
                error = min(value.values()) if isinstance(value, dict) else value
                if metric.endswith("sqnr_db"):
                    error = 10 ** (-error / 20) if math.isfinite(error) else 0.0
                elif metric.endswith("ratio"):
                    error = abs(math.log(error))
                # 3x fails where 3 e > 1.5 e + (ratio - 1) e + absolute: perfect metrics (fp32's) and those
                # within the absolute floor of fp32's noise excepted
                if error == 0 or error * (2.5 - ratio) <= absolute:
                    continue
                assert _violations(_degraded(acc, metric, 3.0), budget), (path.name, key, metric)
                checked += 1
    assert checked >= 40


def test_the_fp32_reference_notices_a_change_and_tolerates_another_machine():
    from pytest_precision.training.moved import fp32_moved
    from pytest_precision.training.limits import CROSS_KEY_RTOL, SAME_KEY_RTOL

    recorded = {"fp32_loss": [3.0, 2.9], "fp32_grad_norm": [1.0, 0.9],
                "fp32_first_grad_norms": {"qkv.weight": 0.8, "qkv.bias": 0.1, "head.weight": 0.5, "noise": 1e-11}}
    same = {"fp32_loss": [3.0, 2.9 * (1 + 2e-6)], "fp32_grad_norm": [1.0, 0.9],
            "fp32_first_grad_norms": {**recorded["fp32_first_grad_norms"], "noise": 3e-11}}  # noise moves freely
    assert fp32_moved(same, recorded, SAME_KEY_RTOL, "cpu-avx512") is None
    other_machine = dict(same, fp32_loss=[3.0, 2.9 * (1 + 5e-5)])
    assert fp32_moved(other_machine, recorded, SAME_KEY_RTOL, "cpu-avx512") is not None
    assert fp32_moved(other_machine, recorded, CROSS_KEY_RTOL, "cpu-avx2") is None
    changed = {"fp32_loss": [3.001, 2.95], "fp32_grad_norm": [1.1, 0.9],
               "fp32_first_grad_norms": {"qkv.weight": 1.6, "qkv.bias": 0.1, "head.weight": 0.51, "noise": 1e-11}}
    problem = fp32_moved(changed, recorded, CROSS_KEY_RTOL, "cpu-avx2")
    assert (problem.check, problem.category) == ("golden", "regression")
    sentence = problem.sentence
    assert sentence.startswith("the fp32 reference moved against cpu-avx2's (relative tolerance 0.0001): first-step "
                               "gradient norm 1.10 x the golden's, loss 1.00 x; first-step gradient norm of qkv.weight 1.6 "
                               "vs 0.8 (+1e+02 %), head.weight 0.51 vs 0.5 (+2 %); step 0 loss 3.001 vs 3: "), sentence


def test_format_floors():
    from pytest_precision.training.limits import first_step_floor_db, grad_norm_band, later_step_floor_db

    assert first_step_floor_db(torch.float16) == pytest.approx(6.0206 * 10 - 12, abs=1e-3)
    assert first_step_floor_db(torch.bfloat16) == pytest.approx(6.0206 * 7 - 12, abs=1e-3)
    assert later_step_floor_db(torch.bfloat16) == pytest.approx(6.0206 * 7 - 30, abs=1e-3)
    assert later_step_floor_db(torch.float8_e5m2) == 0.0
    low, high = grad_norm_band(torch.float16)
    assert 0.96 < low < 0.975 and 1.025 < high < 1.04
    assert grad_norm_band(torch.float8_e5m2) == (0.5, 2.0)
    # each config's precision: TF32 has no dtype and fp16's 10 mantissa bits; fp8's gradients are e5m2
    bits = {c.id: c.mantissa_bits for c in TRAIN_CONFIGS.values()}
    assert bits == {"fp32": 23, "tf32": 10, "amp-bf16": 7, "amp-fp16": 10, "amp-fp16-noscale": 10, "bf16": 7, "bf16-sr": 7,
                    "fp8-e4m3": 2, "fp8-tensorwise": 2, "fp8-delayed": 2, "fp8-own": 2, "ddp-fp16": 10, "ddp-bf16": 7,
                    "fsdp-bf16": 7, "fsdp-bf16-reduce-bf16": 7, "fsdp-fp16-reduce-fp16": 10}
    assert first_step_floor_db(TRAIN_CONFIGS["tf32"].mantissa_bits) == first_step_floor_db(torch.float16)


def test_ddp_golden_catches_a_regression(tmp_path):
    """The DDP golden: a correct rerun passes its budget, a worse SQNR, underflow rate or overflow
    count each fails it, named."""
    from pytest_precision.baselines.lifecycle import BaselineCheck
    from pytest_precision.baselines.store import BaselineStore
    from pytest_precision.training.baseline import DDPEntry
    from pytest_precision.training.distributed import HookComparison

    def check(update, result):
        golden = BaselineCheck(BaselineStore(tmp_path), "train_step/t/trajectory", "ddp-fp16", "cpu", update, "pytest ... --update")
        res = golden.check(DDPEntry(TRAIN_CONFIGS["ddp-fp16"], result))
        golden.commit()  # under the update flag the golden is written once the case's verdict allows
        return res

    good = HookComparison("fp16", 70.0, 0.01, {"w": 0.0}, 0, 1.0, 1.0, underflow_elements={"w": 1000})
    assert check(True, good).updated is not None
    again = check(False, good)
    assert again.error is None and again.problems == [], again.error
    bad = HookComparison("fp16", 40.0, 0.01, {"w": 0.3}, 2, 1.0, 1.0, underflow_elements={"w": 1000})
    problems = check(False, bad).problems
    assert [c for c, _ in problems] == ["accuracy", "underflow", "overflow"], problems
    assert problems[0][1].startswith("gradient SQNR 40 dB < budget")
    assert problems[1][1] == "gradient-underflow rate 300 of 1000 elements (30 %) in w > budget 13 elements (1.3 %)"
    assert problems[2][1] == "overflow 2 > 0 allowed"


def test_training_speedups_are_shown_only_clear_of_the_steps_spread():
    from pytest_precision.training.compare import speedup_text

    assert speedup_text(0.010, 0.05, 0.020, 0.05) == "2.00 x"  # twice as fast, steps within 5 %
    assert speedup_text(0.010, 0.30, 0.012, 0.30) == "noise"  # 1.2 x inside a 30 % spread
    assert speedup_text(0.010, None, 0.020, 0.05) == "noise"  # a spread not measured: nothing to tell
    assert speedup_text(float("nan"), 0.05, 0.020, 0.05) == "-"


# ---- rates are counts: what another summation order moves passes, a real loss fails ----------------

# gradient-underflow and update-lost counts of correct runs on two simulated machines (AVX512, AVX2
# with OpenBLAS's Haswell kernel, the default ISA; the built-in GPT, nanoGPT with and without bias,
# with dropout 0.1, seeds 0 to 2; training.limits): (accepted on one, given on another, elements)
MEASURED_MOVES = [(0, 1, 16384), (0, 2, 4096), (6, 11, 16384), (7, 12, 12287), (7, 23, 12286), (8, 23, 12286),
                  (8, 15, 12288), (10, 18, 12288), (13, 21, 12288), (16, 10, 12288), (35, 36, 64), (36, 37, 64),
                  (42, 43, 64)]


def _with_rates(acc: dict, underflow: tuple[int, int], lost: tuple[int, int]) -> dict:
    return dict(acc, underflow_rate={"w": [underflow[0] / underflow[1], underflow[1]]},
                update_lost_rate={"w": [lost[0] / lost[1], lost[1]]})


@pytest.mark.parametrize("accepted,other,elements", MEASURED_MOVES + [(0, 3, 12288)])
def test_rate_budgets_hold_the_counts_another_machine_gives(accepted, other, elements):
    """Every count measured on another machine passes the budget accepted from this one's, and so
    does the issue's 0 -> 3 of 12288 (a budget of two elements, crossed by one)."""
    budget = _budget_for(_with_rates(_ACCEPTED, (accepted, elements), (accepted, elements)))
    assert _violations(_with_rates(_ACCEPTED, (other, elements), (other, elements)), budget) == []


def test_a_real_loss_fails_the_rate_budgets_counted_in_elements():
    budget = _budget_for(_with_rates(_ACCEPTED, (0, 12288), (8, 12286)))
    # a lost loss scale: hundreds of gradients where none was lost; updates rounded away where 8 were
    problems = _violations(_with_rates(_ACCEPTED, (400, 12288), (300, 12286)), budget)
    assert problems == [
        ("underflow", "gradient-underflow rate 400 of 12288 elements (3.26 %) in w > budget 13 elements (0.106 %)"),
        ("accuracy", "update-lost rate 300 of 12286 elements (2.44 %) in w > budget 35 elements (0.285 %)")]
    # the count a budget allows where none was accepted is reached, not passed
    assert _violations(_with_rates(_ACCEPTED, (13, 12288), (35, 12286)), budget) == []
    assert len(_violations(_with_rates(_ACCEPTED, (14, 12288), (36, 12286)), budget)) == 2


def test_count_bounds_follow_the_sign_test():
    from pytest_precision.training.limits import RATE_ALPHA, count_bound, count_chance, limit_count

    for accepted in (0, 1, 8, 100, 1000):
        b = count_bound(accepted)
        assert count_chance(accepted, b) >= RATE_ALPHA > count_chance(accepted, b + 1)
    assert count_bound(0) == 13 and count_bound(8) == 31  # 2^-13 >= 1e-4 > 2^-14
    # the measured pair least likely under the model is 26 times above RATE_ALPHA
    assert 2e-3 < count_chance(7, 23) < 3e-3
    # the 5 % limits: a Poisson count of mean 5 % of the elements
    assert [limit_count(0.05, n) for n in (32, 64, 12288)] == [8, 12, 709]


def test_the_5_percent_limits_tolerate_a_count_at_the_limit_and_fail_a_loss():
    from pytest_precision.training.limits import limit_sentence

    assert limit_sentence("update-lost rate", {"b": 4 / 64}, {"b": 64}, 0.05) is None  # 6.25 %: 4 of 64
    assert limit_sentence("update-lost rate", {"w": 700 / 12288}, {"w": 12288}, 0.05) is None
    assert limit_sentence("gradient-underflow rate", {"b": 1.0, "w": 800 / 12288}, {"b": 64, "w": 12288}, 0.05) == (
        "gradient-underflow rate 64 of 64 elements (100 %) in b > 5 % allowed (up to 12 elements: the limit and a "
        "count's spread between machines)")


def test_a_golden_of_the_two_element_budgets_is_judged_with_the_count_slack():
    """A golden accepted before the count budgets (two elements over 1.9 x the accepted rate) gets
    the count slack when judged: nothing to re-accept."""
    import dataclasses

    from pytest_precision.training.baseline import TrajectoryEntry

    acc = _with_rates(_ACCEPTED, (0, 12288), (0, 64))
    old = dataclasses.replace(_budget_for(acc), max_underflow_rate={"w": 2 / 12288}, max_update_lost_rate={"w": 2 / 64})
    budget = TrajectoryEntry.budget_from(None, "trajectory", [{"budget": old.to_json(), "accepted": acc}], False)
    assert _violations(_with_rates(_ACCEPTED, (3, 12288), (3, 64)), old) != []  # the failure
    assert _violations(_with_rates(_ACCEPTED, (3, 12288), (3, 64)), budget) == []


# ---- a model built in bf16: float32 master weights, said ---------------------------------------------

def test_a_model_built_in_bf16_starts_every_config_from_the_same_float32_weights():
    spec = TrainSpec(lambda: _Attention().to(torch.bfloat16), lambda p: torch.optim.SGD(p, lr=0.1), _TEXT, steps=1,
                     loss_fn=_attention_loss)
    fp32 = run_training(spec, TRAIN_CONFIGS["fp32"], "cpu")
    bf16 = run_training(spec, TRAIN_CONFIGS["bf16"], "cpu")
    exact = exact_first_step(spec, 0, "cpu")
    torch.manual_seed(0)
    built = _Attention().to(torch.bfloat16)
    assert sorted(fp32.built_dtypes) == ["bfloat16"] and len(fp32.built_dtypes["bfloat16"]) == 5
    for n, p in built.named_parameters():  # the built weights, upcast exactly, in every config
        assert fp32.initial[n].dtype == torch.float32 and torch.equal(fp32.initial[n], p.float())
        assert torch.equal(bf16.initial[n], p.float()) and torch.equal(exact.initial[n], p.double())
    from pytest_precision.training.run import built_dtype_note

    note = built_dtype_note(fp32.built_dtypes, 5)
    assert note.startswith("model_fn() built the model in bfloat16 (5 of 5 parameter tensors: tok.weight, qkv.weight "
                           "and 3 more): every config starts from these weights cast to float32 master weights (exact;")
    assert "return the model in float32" in note
    assert run_training(TrainSpec(_Attention, lambda p: torch.optim.SGD(p, lr=0.1), _TEXT, steps=1,
                                  loss_fn=_attention_loss), TRAIN_CONFIGS["fp32"], "cpu").built_dtypes == {}


def test_a_model_built_in_float64_is_rounded_once_for_every_config():
    spec = TrainSpec(lambda: _Attention().double(), lambda p: torch.optim.SGD(p, lr=0.1), _TEXT, steps=1,
                     loss_fn=_attention_loss)
    fp32 = run_training(spec, TRAIN_CONFIGS["fp32"], "cpu")
    exact = exact_first_step(spec, 0, "cpu")
    assert sorted(fp32.built_dtypes) == ["float64"]
    for n in fp32.initial:  # the float64 truth starts from the float32 weights the run starts from
        assert torch.equal(exact.initial[n], fp32.initial[n].double())


# ---- random draws replay: dropout masks ---------------------------------------------------------------

class _Dropout(nn.Module):
    """A Linear with dropout before it: the gradient depends on the mask drawn."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc(self.drop(x)), y)


def _regression_batch(i):
    g = torch.Generator().manual_seed(50 + i)
    return seeded_normal(g, 32, 16), seeded_normal(g, 32, 8)


def test_reruns_of_a_step_draw_the_runs_dropout_masks_and_leave_the_callers_generator():
    from pytest_precision.training import prepare_training, tensors_sqnr_db

    spec = TrainSpec(_Dropout, lambda p: torch.optim.SGD(p, lr=0.1), _regression_batch, steps=3)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    run = run_training(spec, TRAIN_CONFIGS["fp32"], "cpu")
    assert torch.equal(torch.get_rng_state(), before)  # the caller's generator as it was
    assert len(run.rng_states) == 3 and run.rng_states[1].digest != run.rng_states[0].digest  # dropout drew
    # the float64 step from the state the run had at step 0 draws its masks: the same gradients to
    # float32's rounding; from another step's state, other masks
    same = exact_first_step(spec, 0, "cpu", rng_state=run.rng_states[0])
    other = exact_first_step(spec, 0, "cpu", rng_state=run.rng_states[1])
    assert tensors_sqnr_db(run.grads0, same.grads) > 100
    assert tensors_sqnr_db(run.grads0, other.grads) < 20
    # a prepared step called twice, after other draws, repeats its draws
    call = prepare_training(dataclasses.replace(spec, steps=1), TRAIN_CONFIGS["fp32"], "cpu")
    first = call()
    torch.rand(1000)
    again = prepare_training(dataclasses.replace(spec, steps=1), TRAIN_CONFIGS["fp32"], "cpu")
    assert torch.equal(first.grads0["fc.weight"], again().grads0["fc.weight"])
    assert torch.equal(first.grads0["fc.weight"], run.grads0["fc.weight"])
