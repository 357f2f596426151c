"""The cross_entropy kind: the mean negative log-likelihood of class targets, as a loss.

Target contract::

    fn(logits, target, ignore_index=-100, label_smoothing=0.0) -> loss

``logits`` is (rows, classes), floating; ``target`` is (rows,) int64 class indices, rows whose
target is ``ignore_index`` contribute nothing; ``loss`` is a 0-dim tensor, the mean over the rows
not ignored of (1 - s) (lse - logit[target]) + s (lse - mean(logits)), s the label smoothing and
lse the row's logsumexp (torch's ``F.cross_entropy`` with its defaults). The loss comes back in
the logits' dtype or in float32; under autocast in float32 (torch's CPU autocast runs
cross_entropy in fp32, as CUDA's does). Outputs: the loss and the gradient of the logits under a
seeded upstream gradient. Only the logits are rounded by configs: the targets are integers. Under the fp8 recipe the logits
are quantised and the loss is not (a loss is a reduction kept in fp32; its gradient is, in e5m2).

A batch whose rows are all ignored has no mean: the expected loss is NaN (0 / 0, what torch
returns), and the expected gradient is 0 everywhere (no row contributes). A target returning a
loss of 0 there fails with "NaN expected but missing", unless it declares that convention
(``all_ignored="zero"``, as some kernel libraries choose): then 0 is expected, and NaN fails; one
whose gradient is NaN fails with NaN either way.

The peer is best practice, what autocast runs and what Hugging Face's causal-LM loss does
(``logits.float()`` first): torch's ``F.cross_entropy`` on the logits upcast to float32, in
every config. The same op on 16-bit logits is the defect it catches: measured on CPU, torch
2.13, its loss is 1.7 to 1.85 times the budget on the scale40 regime in fp16 and bf16 (0.46 off
in bf16, where float32 arithmetic is 7e-6 off), and a failing loss about as far off says so
(``naive_loss_hint``).
The built-in target ``torch.cross_entropy`` is torch's op as careful code calls it, upcast: the
peer itself, held against an independent composite in float32 (``composite_cross_entropy``).

The loss is judged on absolute error (the log-domain rule of log_softmax: a loss near 0 is a
probability near 1, where precision is absolute; the summary shows its ULPs counted at
max(|loss|, 1)): ULP_FLOOR float32 steps at max(|loss|, 1) plus the rounding of lse and of the
row's sum, and, for a loss returned in 16 bits, half a step of its dtype at the loss (its final
rounding; a loss computed in 16 bits is off by more). The gradient on absolute error (it crosses
zero: p - 1 at the target column), in steps of the logits' dtype.
Keywords a regime needs (``ignore_index`` where rows are ignored, ``label_smoothing``) are passed
only there; a target without that keyword is skipped on those regimes with the reason.

More measured (torch 2.13, CPU): the loss on 16-bit logits is also 1.34 x the budget on ``ignored``
in fp16; on vocab32768's 2 rows the row-rounded layout (Liger-Kernel's: a correct kernel storing its
float32 row losses in the logits' dtype, each within a few float32 steps of a midpoint rounding
either way) is within budget. A drawn-regime and fresh search over the correct targets (the built-in
ones, a loss in float32 rounded once to the logits' dtype, and that row-rounded layout) in fp16,
bf16, amp-fp16, amp-bf16 and fp8-e4m3, 60 seeds under ``--precision-explore``, found no failure.
torch's fp32 gradient over 32768 classes is 3.1e-7 off, the exp/sum composite's 1.4e-8. Found by the
drawn regime: torch's CPU ``label_smoothing`` on fp16 logits sums a row's log-probabilities in fp16
and returns inf once that passes 65504 (4000 classes of N(0, 5^2) logits), one more reason to upcast.
The ``hypothesis`` regime draws 10 examples: 1 to 1000 classes, scales 1 to 40, confident rows,
ignored rows and smoothing where the target takes the keywords.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from pytest_precision.kinds import (GRAD_PEER_FACTOR, ULP_FLOOR, Case, Declaration, DrawnRegime, MeasureContext,
                                    OutputRule, Regime, Target, TensorKind, compare, format_of, sum_chain,
                                    ulp)

from .cross_entropy_inputs import (BASE_SEED, IGNORE_INDEX, REGIMES, CrossEntropyInputs, draw_inputs,
                                   fresh_cross_entropy_regime)

__all__ = ["CrossEntropyKind", "CrossEntropyInputs", "CROSS_ENTROPY", "BASE_SEED",
           "IGNORE_INDEX", "cross_entropy_reference", "composite_cross_entropy", "naive_loss_hint",
           "NAIVE_HINT_RATIO"]

def cross_entropy_reference(logits, target, ignore_index=IGNORE_INDEX, label_smoothing=0.0):
    """The loss as defined (module docstring), in the dtype of ``logits`` (float64 for the oracle).
    An all-ignored batch: NaN, added as a constant so that the gradient stays 0 (a target declaring
    ``all_ignored="zero"`` is held to 0 by ``invoke``, for the oracle and the peers alike)."""
    lse = torch.logsumexp(logits, -1)
    valid = target != ignore_index
    picked = logits.gather(-1, torch.where(valid, target, 0)[:, None]).squeeze(-1)
    per_row = lse - picked
    if label_smoothing:
        per_row = (1 - label_smoothing) * per_row + label_smoothing * (lse - logits.mean(-1))
    count = int(valid.sum())
    loss = torch.where(valid, per_row, torch.zeros_like(per_row)).sum() / max(count, 1)
    return loss if count else loss + math.nan


def composite_cross_entropy(logits, target, ignore_index=IGNORE_INDEX, label_smoothing=0.0):
    """The same loss from separate ops in the logits' dtype, each rounding there: log-probabilities
    as (x - max) - log(sum(exp(x - max))), then the mean over the rows not ignored."""
    m = logits.amax(-1, keepdim=True)
    z = logits - m
    logp = z - z.exp().sum(-1, keepdim=True).log()
    valid = target != ignore_index
    nll = -logp.gather(-1, torch.where(valid, target, 0)[:, None]).squeeze(-1)
    if label_smoothing:
        nll = (1 - label_smoothing) * nll - label_smoothing * logp.mean(-1)
    return torch.where(valid, nll, torch.zeros_like(nll)).sum() / valid.sum()


FLOAT32_ROW_STEPS = 4.0  # float32 steps (at the row's lse and largest logit) a correct row loss may be off


def _row_roundings(logits: torch.Tensor, a: CrossEntropyInputs, dtype: torch.dtype) -> float:
    """How much further than half a step of ``dtype`` the loss is when each row's term of the mean (its loss
    / the rows counted) is rounded to ``dtype`` first and the rounded terms summed, then rounded again
    (Liger-Kernel's layout: a correct kernel, its float32 row losses stored in the logits' dtype): that
    layout computed on the exact row losses. Its rounding errors fall as they fall on these inputs; a loss
    computed on 16-bit logits errs past them (bf16 scale40: 0.46 off, where 0.5 ULP is 0.25)."""
    valid = a.target != a.ignore_index
    count = int(valid.sum())
    if not count:
        return 0.0
    with torch.no_grad():
        x = logits[valid].to(torch.float64)
        lse = torch.logsumexp(x, -1)
        per_row = lse - x.gather(-1, a.target[valid][:, None]).squeeze(-1)
        if a.label_smoothing:
            per_row = (1 - a.label_smoothing) * per_row + a.label_smoothing * (lse - x.mean(-1))
        terms = per_row / count
        loss = float(terms.sum())
        # a kernel's float32 row loss is a few float32 steps of its terms off the exact one: a term that close
        # to a midpoint of ``dtype`` may round either way (both are tried, up to 2^8 combinations)
        slack = FLOAT32_ROW_STEPS * 2.0 ** -24 * (lse.abs() + x.abs().amax(-1) + 1) / count
        low, high = (terms - slack).to(dtype).to(torch.float64), (terms + slack).to(dtype).to(torch.float64)
    either = [i for i in range(len(terms)) if low[i] != high[i]][:8]
    worst = 0.0
    for mask in range(2 ** len(either)):
        chosen = low.clone()
        for bit, i in enumerate(either):
            if mask >> bit & 1:
                chosen[i] = high[i]
        layered = float(chosen.sum().to(dtype))
        if math.isfinite(layered):
            worst = max(worst, abs(layered - loss))
    return max(0.0, worst - 0.5 * float(ulp(loss, dtype)))


def _exp_condition(logits: torch.Tensor, a: CrossEntropyInputs) -> float:
    """max over the rows not ignored of p (|x| + |lse| + sqrt(n) / 2 + the smoothing's sum): how far
    the fp32 rounding of a log-probability and of the row's sum move p, in units of 2^-24. With label
    smoothing every class carries a term of the upstream gradient (eps / n each, 1 - eps at the
    target), and log_softmax's backward sums them over the row before taking p x that sum: an
    error of up to ``sum_chain(n)`` units of their total, 1. Measured (CPU, torch 2.13, fp32):
    ``F.cross_entropy(label_smoothing=0.1)`` over 3571 classes at scale 5 is 243 units off where
    p = 0.92 (8 units without smoothing), past the sqrt(n) / 2 = 30 this term held before."""
    x = logits[a.target != a.ignore_index]
    if not x.numel():
        return 0.0
    lse = torch.logsumexp(x, -1, keepdim=True)
    smoothing_sum = sum_chain(x.shape[-1]) if a.label_smoothing else 0.0
    return float((torch.exp(x - lse) * (x.abs() + lse.abs() + 0.5 * math.sqrt(x.shape[-1]) + smoothing_sum)).max())


# a failing loss is "as far off as the loss on 16-bit logits" within this factor of that loss's error:
# measured (CPU, torch 2.13, fp16 and bf16, four seeds of each regime), losses computed in 16 bits
# (F.cross_entropy, log_softmax, exp-sum-log, a sum then a division) are 0.40 to 1.00 of it; a loss
# that upcasts and has another bug (the sum over rows for the mean) is thousands of times it
NAIVE_HINT_RATIO = 2.0


def naive_loss_hint(case: Case, m, a: CrossEntropyInputs) -> str | None:
    """Why a loss failing in a 16-bit config may fail: the loss computed on the 16-bit logits
    (cross_entropy without ``logits.float()`` first) misses the same budget, and the target's error
    is within ``NAIVE_HINT_RATIO`` of its error; else None (a target off by more has another bug)."""
    logits, budget = m.values["logits"], m.results["loss"].peer_budget.max_abs
    dtype, mine = logits.dtype, m.results["loss"].oracle.max_abs
    if dtype not in (torch.float16, torch.bfloat16) or budget is None or not mine > budget:
        return None
    with torch.no_grad():
        naive = F.cross_entropy(logits, a.target.to(logits.device), **_keywords(a)).cpu()
        ref = cross_entropy_reference(m.exact["logits"], a.target, a.ignore_index, a.label_smoothing)
    error = compare(naive, ref, dtype, log_domain=True).max_abs
    if not error > budget or not mine <= NAIVE_HINT_RATIO * error:
        return None
    name = str(dtype).removeprefix("torch.")
    return (f"cross_entropy computed on the {name} logits misses the budget too (max abs {error:.3g} > {budget:.3g}): the "
            f"loss is held to float32 arithmetic on these {name} logits, as autocast runs it; upcast the logits "
            "(logits.float()) before the loss")


def _keywords(a: CrossEntropyInputs) -> dict:
    """The keywords a case passes: only those its inputs need."""
    kw = {}
    if a.ignores:
        kw["ignore_index"] = a.ignore_index
    if a.label_smoothing:
        kw["label_smoothing"] = a.label_smoothing
    return kw


class CrossEntropyKind(TensorKind):
    name = "cross_entropy"
    contract = ("fn(logits, target, ignore_index=-100, label_smoothing=0.0) -> mean loss over the rows not ignored, "
                "0-dim, in the logits' dtype or float32")
    regimes = REGIMES
    drawn = DrawnRegime("hypothesis", examples=10)  # few: each example runs forward and backward three ways
    forward_output = "loss"
    grad_inputs = ("logits",)

    declarations = {
        **TensorKind.declarations,
        "all_ignored": "'nan' (default: torch's 0 / 0) or 'zero': the loss it returns for a batch whose rows are all "
                       "ignored (its gradient is 0 either way)",
    }

    def normalise_declaration(self, name, key, value):
        if key == "all_ignored":
            if value not in ("nan", "zero"):
                raise ValueError(f"target {name!r}: all_ignored={value!r}: expected 'nan' (torch's convention) or "
                                 "'zero'")
            return value
        return super().normalise_declaration(name, key, value)

    def for_target(self, case: Case, a: CrossEntropyInputs) -> CrossEntropyInputs:
        convention = case.target.declared.get("all_ignored", "nan")
        return a if convention == a.all_ignored else dataclasses.replace(a, all_ignored=convention)

    def default_targets(self) -> list[Target]:
        return [Target("torch.cross_entropy", self.peer, self.name, origin="built-in")]

    def fresh_regime(self, target: Target, seed: int) -> Regime:
        return fresh_cross_entropy_regime(target, seed)

    def unsupported(self, case: Case, a: CrossEntropyInputs | None = None) -> str | None:
        reason = super().unsupported(case, a)
        if reason or a is None:
            return reason
        needed = [k for k in _keywords(a) if not case.target.accepts(k)]
        if needed:
            return (f"the {case.regime} regime needs the {' and '.join(needed)} keyword"
                    f"{'s' if len(needed) > 1 else ''} (see the cross_entropy contract)")
        return None

    # ---- calling convention ----

    def floating_inputs(self, a: CrossEntropyInputs) -> dict[str, torch.Tensor]:
        return {"logits": a.logits}

    def checksum_input(self, a: CrossEntropyInputs) -> torch.Tensor:
        # the targets too: another draw of them is another case
        return torch.cat([a.logits.flatten(), a.target.to(torch.float32)])

    def invoke(self, fn, values, a: CrossEntropyInputs, device):
        out = fn(values["logits"], a.target.to(device), **_keywords(a))
        if getattr(fn, "__self__", None) is self and a.all_ignored == "zero" and a.none_counted:
            # the oracle and the peers under the target's convention: 0 for a batch with nothing to count
            out = torch.where(torch.isnan(out), torch.zeros_like(out), out)
        return out

    def expected_shape(self, values, a):
        return ()

    # batch probes: the loss is a mean, so a row's own result is its gradient row times the number of
    # rows counted, exact where that number is a power of two (scaling by one moves no bit) and the
    # gradient is no subnormal: values below 2^12 x the smallest normal (counts up to 4096) are not
    # compared (torch's own fp32 gradient of the scale40 regime lost bits there: 821 of 4096)
    batch_gradients = True

    def batch_size(self, case, a: CrossEntropyInputs, values):
        return None if "logits" not in self.case_grad_inputs(case, a) else a.logits.shape[0]

    def rows_of(self, case, a: CrossEntropyInputs, values, rows):
        sub = dataclasses.replace(a, logits=a.logits[rows], target=a.target[rows])
        return sub, {"logits": values["logits"][rows.to(values["logits"].device)]}

    def row_results(self, case, a: CrossEntropyInputs, outputs):
        counted = int((a.target != a.ignore_index).sum())
        if "dlogits" not in outputs or counted < 1 or counted & (counted - 1):
            return None
        r = outputs["dlogits"] * counted
        return torch.where(r.abs() < torch.finfo(r.dtype).tiny * 2 ** 12, torch.zeros_like(r), r)

    def output_dtypes(self, config, values) -> tuple[torch.dtype, ...]:
        """The logits' dtype or float32, never the autocast dtype: autocast runs losses in fp32."""
        return tuple(dict.fromkeys((values["logits"].dtype, torch.float32)))

    def reference(self, logits, target, ignore_index=IGNORE_INDEX, label_smoothing=0.0):
        return cross_entropy_reference(logits, target, ignore_index, label_smoothing)

    peer_name = "torch's cross_entropy on the logits upcast to float32"

    def peer(self, logits, target, ignore_index=IGNORE_INDEX, label_smoothing=0.0):
        # upcast as autocast does (and Hugging Face's causal-LM loss): the loss comes back in float32
        return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, label_smoothing=label_smoothing)

    independent_peer_name = "log-probabilities from exp, sum and log on the logits upcast to float32"

    def independent_peer(self, logits, target, ignore_index=IGNORE_INDEX, label_smoothing=0.0):
        return composite_cross_entropy(logits.float(), target, ignore_index, label_smoothing)

    def conventions(self, case: Case, m, a: CrossEntropyInputs) -> list:
        """A batch whose rows are all ignored, where the target returned a loss of 0 (``all_ignored``)."""
        loss = m.outputs["loss"]
        if bool((a.target == a.ignore_index).all()) and a.all_ignored == "nan" and bool((loss == 0).all()):
            return [(Declaration("all_ignored", "zero"),
                     "every row ignored: the target returned a loss of 0, where the default all_ignored='nan' "
                     "expects NaN (torch's 0 / 0): declare all_ignored='zero'")]
        return []

    def hint(self, case: Case, m, a: CrossEntropyInputs) -> str | None:
        """A loss past its budget in a 16-bit config, as far off as torch's op on the 16-bit logits: say so."""
        return naive_loss_hint(case, m, a)

    # ---- numerics ----

    def output_rule(self, ctx: MeasureContext, name, out, peer, ref) -> OutputRule:
        case, a, logits = ctx.case, ctx.inputs, ctx.exact["logits"]
        if name == self.forward_output:
            # never quantised, fp8 recipes included: a loss is a reduction kept in fp32 or wider
            dtype = out.dtype if out.dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float32
            rule = OutputRule(dtype, log_domain=True, out=out, peer=peer)
            # judged on absolute error as float32 arithmetic on these logits reaches it: ULP_FLOOR
            # float32 steps at max(|loss|, 1) (below 1 the loss is a probability near 1, where
            # precision is absolute), plus lse rounded at its own magnitude and the row's sum of
            # exps off by about sqrt(n) 2^-24 relative, in whatever order; a loss returned in 16
            # bits adds its final rounding, half a step at the loss. Measured (CPU, torch 2.13):
            # logits.float() first, returned in 16 bits, is at most 0.84 of this (bf16 vocab32768,
            # its rounding); without the upcast 1.85 (bf16 scale40), 1.84 (fp16 vocab32768), 1.70
            # (fp16 scale40), 1.34 (fp16 ignored) and under 1 elsewhere. Absolute rather than ULP budgets
            # because the loss is one number: a ULP budget's mean-ULP limit (1.5 x accepted +
            # 0.25) would be tighter than its max for it, and a one-ULP move between machines
            # would fail; here the RMS limit (the one number's error again) gets the same floor.
            lse = float(torch.logsumexp(logits, -1).abs().max()) if logits.numel() else 0.0
            loss = float(ref) if math.isfinite(float(ref)) else 1.0
            fp32_step = float(ulp(max(1.0, abs(loss)), torch.float32))
            rule.abs_floor = ULP_FLOOR * (fp32_step + (lse + 0.5 * math.sqrt(max(1, logits.shape[-1]))) * 2.0 ** -24)
            if dtype != torch.float32:
                # a loss computed in float32 and returned in 16 bits: half a step of its dtype at the loss,
                # plus what rounding each row's term to that dtype before the sum adds on these inputs
                rule.abs_floor += 0.5 * float(ulp(loss, dtype)) + _row_roundings(logits, a, dtype)
            rule.rms_floor = rule.abs_floor
            return rule
        rule = super().output_rule(ctx, name, out, peer, ref)
        if case.config.fp8 is None:  # autocast runs the loss in fp32: its gradient counts in the logits' dtype
            rule.dtype = out.dtype
        rule.peer_factor = GRAD_PEER_FACTOR
        # the gradient is (softmax - onehot) / rows, times the upstream gradient: at the target
        # column p - 1 cancels terms of 1 / rows (a confident row's exact value is -5e-8 / rows),
        # so ULPs at that magnitude; plus exp's conditioning, as attention's floor: a log-probability
        # x - lse held in fp32 is off by (|x| + |lse|) 2^-24, and the row's sum by sqrt(n) 2^-24
        # relative, each moving p by as much relative. Measured on CPU, torch 2.13, fp32 over 32768
        # classes: F.cross_entropy's gradient is 3.1e-7 off where p reaches 0.2 and lse is 22.5
        # (5 ULPs at 0.5), the composite exp / sum 1.4e-8.
        rows = max(1, int((a.target != a.ignore_index).sum()))
        upstream = abs(float(ctx.upstream(())))  # the gradient's floor is in units of the (scalar) upstream gradient
        rule.abs_floor = ULP_FLOOR * upstream / rows * (format_of(rule.dtype).eps
                                                        + _exp_condition(logits, a) * 2.0 ** -24)
        # zeros within the floor are probabilities too small to matter at this scale, not lost values
        rule.underflow_floor = rule.abs_floor
        return rule

    def input_spec(self, regime: Regime, a: CrossEntropyInputs) -> dict:
        return {"regime": regime.name, "seed": regime.seed, **regime.parameters}

    # ---- drawn inputs ----

    def draw(self, case: Case):
        from hypothesis import strategies as st

        ignores = case.target.accepts("ignore_index")
        smooths = case.target.accepts("label_smoothing")

        @st.composite
        def inputs(draw) -> CrossEntropyInputs:
            g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
            margin = draw(st.sampled_from([None, 5.0, 20.0]))
            return draw_inputs(g, draw(st.integers(1, 4)), draw(st.sampled_from([1, 2, 7, 100, 1000])),
                           scale=draw(st.sampled_from([1.0, 10.0, 40.0])), margin=margin,
                           ignored=draw(st.sampled_from([0.0, 0.5])) if ignores else 0.0,
                           label_smoothing=draw(st.sampled_from([0.0, 0.1])) if smooths else 0.0)

        return inputs()

    def describe_drawn(self, example: CrossEntropyInputs, case: Case) -> list[str]:
        return [f"Hypothesis found (after shrinking) {example!r}"]


CROSS_ENTROPY = CrossEntropyKind()
