"""The layer_norm and rms_norm kinds (suite ``norm``): normalisation over the last dimension.

Target contract, the same call for both kinds::

    fn(x, weight, bias, eps) -> y       # y shaped and typed as x

``x`` is (rows, n); ``weight`` and ``bias`` are (n,) in x's dtype; ``eps`` is a float. The regimes
draw the weights as trained norms have them: ``weight`` N(1, 0.1^2), ``bias`` N(0, 0.1^2).
``layer_norm``: y = (x - mean) / sqrt(var + eps) * weight + bias, var the biased variance of the
row. ``rms_norm``: y = x / sqrt(mean(x^2) + eps) * weight, and the target is called with
``bias=None``. Outputs: y and the gradients of x, weight (and bias for layer_norm) under a
seeded upstream gradient. The peer is best practice, what fused kernels and Hugging Face's
LlamaRMSNorm do: statistics in float32 (``composite_norm``: the mean and the variance, or the
mean square, in float32 from the config's inputs, normalised, the affine applied, the result
rounded once to x's dtype; gradients by autograd through it). The built-in target is torch's op
in the config (``F.layer_norm``, ``F.rms_norm``), held against that peer; its CPU layer_norm
backward saves the mean and rstd in 16 bits, a known limit its drawn cases name
(``torch_backward_limit``); on the fixed regimes it passes.

Budgets are on absolute error, as attention's: y crosses zero (the normalised row has mean 0),
and the weight's gradient is a sum over rows of terms of both signs. On outputs of at least
``Y_RMS_MIN_ELEMENTS`` elements y's RMS error is held too, to ``Y_RMS_FACTOR`` x the larger RMS
error of two careful composites, the peer (one rounding of y) and ``composite_norm_affine_in_dtype``
(normalised in float32, rounded, the affine in x's dtype: three), plus ``Y_RMS_FLOOR_ULPS`` and
``Y_RSTD_ROUNDINGS`` (a row's rstd one float32 rounding off): statistics kept in 16 bits add roundings to every element, past the careful ones, where y's max
error is one element's rounding and hides them. Measured (CPU, torch 2.13; y's RMS error over its
budget, 300 seeds of each fixed regime and 3000 drawn inputs per kind and 16-bit dtype): careful
code at most 0.82 (the three-rounding pattern and LlamaRMSNorm as written 0.78 to 0.82,
torch's ops 0.59); statistics in x's dtype median 1.12 to 1.63 on unit,
near-eps and long, over the budget on 73 to 99% of seeds (fp16 overflows on scale300 as well). On
the committed seeds: layer_norm with 16-bit statistics 1.05 to 1.29 (fp16) and 1.02 to 1.48
(bf16), rms_norm 1.25 to 1.42 (fp16) and, in bf16, 1.10 to 1.51 on near-eps, long and scale300
(0.996 on unit, which passes).

More measured (torch 2.13, CPU): in fp32 on ``offset``, ``F.layer_norm``'s y is 9.0e-4 off (floor
1.7e-3), dx 1.0e-3 (floor 4.3e-3; the two-pass backward's 2.0e-4); on centred rows 0.5 to 1 ULP at
the largest term (floor 2). Without the rstd term, torch's ``F.layer_norm`` in fp32 went 1.46 x past
y's RMS budget on 1 row of 1170, 4 of 700 random shapes of the fresh regime (at most 0.81 with it);
on a row of 64 the three-rounding pattern went 1.15 x past a budget of twice the peer's RMS, which is
why smaller outputs are judged on max abs alone. The mean's rounding counts in fp32 for y and also in
x's dtype for gradients, because torch's CPU kernel saves mean and rstd in fp16/bf16 for its backward;
dx also allows the fp32 terms that torch's ``a dy + b x + c`` form cancels. Two limits of torch's CPU
op: on rows whose mean dwarfs their spread its 16-bit backward is 2 to 20 x a two-pass backward's
error, and in fp16 rows that round to a constant at 1e4 its y is 0.10 off (it computes
``x (rstd w) + (b - mean rstd w)``), where the exact y is the bias. The ``hypothesis`` regime draws
10 examples: means 0 to 1e4, spreads 0 to 300, rows of 1 to 300, eps 1e-5 or 1e-6.
"""
from __future__ import annotations

import dataclasses

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pytest_precision.kinds import (ABS_ERROR_TABLE, GRAD_PEER_FACTOR, PEER_FACTOR, ULP_FLOOR, Case, DrawnRegime,
                                    MeasureContext, OutputRule, Regime, Target, TensorKind, compare,
                                    declared_flag, format_of, seeded_normal)

from .norm_inputs import BASE_SEED, EPS, NormInputs, affine_parameters, fresh_norm_regime, norm_regimes

__all__ = ["NormKind", "NormInputs", "LAYER_NORM", "RMS_NORM", "BASE_SEED", "EPS",
           "norm_reference", "composite_norm", "sensitivity", "Sensitivity", "MEAN_ROUNDING", "torch_backward_limit"]

def norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, rms: bool,
                   mean_shift: torch.Tensor | None = None):
    """The kind's formula as written, run in the dtype of its inputs (float64 for the oracle).
    ``mean_shift`` (rows, 1) moves each row's mean, as a kernel's rounding of it would."""
    if rms:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    else:
        mean = x.mean(-1, keepdim=True)
        d = x - (mean if mean_shift is None else mean + mean_shift)
        y = d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + eps)
    y = y * weight
    return y if bias is None else y + bias


def composite_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, rms: bool):
    """Two passes from separate ops (mean, then the mean of squared deviations), statistics in
    fp32 for 16-bit inputs as every fused kernel keeps them, rounded once to x's dtype."""
    wide = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    y = norm_reference(x.to(wide), weight.to(wide), None if bias is None else bias.to(wide), eps, rms)
    return y.to(x.dtype)


def composite_norm_affine_in_dtype(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                                   rms: bool):
    """The other careful pattern: normalised with float32 statistics, rounded to x's dtype, the
    affine applied in x's dtype (LlamaRMSNorm's ``weight * hidden_states.to(input_dtype)``): up to
    three roundings of y (the normalised value, the product, the sum) where ``composite_norm`` has one."""
    wide = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    y = norm_reference(x.to(wide), torch.ones((), dtype=wide), None, eps, rms).to(x.dtype) * weight
    return y if bias is None else y + bias


# y's RMS error budget: Y_RMS_FACTOR x the larger RMS error of the two careful composites (one
# rounding of y, or three: composite_norm_affine_in_dtype), plus Y_RMS_FLOOR_ULPS ULPs at y's RMS
# magnitude over sqrt(elements), on outputs of at least Y_RMS_MIN_ELEMENTS elements, where the RMS
# of the roundings is a settled statistic: on rows of 64 a few elements' roundings decide it (there
# the three-rounding pattern went 1.15 x past twice the peer's RMS, and code rounding twice, the
# weight applied in float32, past 1.25 x the larger composite's); max abs judges such outputs. Measured (CPU,
# torch 2.13; fp16 and bf16, 300 seeds of each fixed regime, 3000 drawn inputs per kind and dtype):
# careful code at most 0.82 of the budget; statistics in 16 bits median 1.12 to 1.63 on unit,
# near-eps and long, over it on 73 to 99% of seeds (the module docstring has the committed seeds')
Y_RMS_FACTOR = 1.2
Y_RMS_FLOOR_ULPS = 1.0
Y_RMS_MIN_ELEMENTS = 1024
# float32 roundings of y's RMS magnitude added to that floor: a row's rstd, one rounding off in a correct
# kernel, moves every element of the row by as much relative, and on a few rows that is not averaged
# out. Without it torch's own F.layer_norm in fp32 (and the amp configs, which feed norms float32) went
# past the RMS limit on 4 of 700 random shapes (the fresh regime's: 1.46 x on 1 row of 1170, 1.25 x on
# 3 rows of 474 and of 1968, 1.02 x on 11 rows of 135; at most 0.81 with it); in 16-bit dtypes it is
# below 1 % of the floor
Y_RSTD_ROUNDINGS = 1.0
MEAN_ROUNDING = 2.0 ** -24  # one fp32 rounding of a row's mean, relative
# torch's CPU layer_norm backward, measured over 400 inputs (means 0 to 1e4, spreads 0 to 10, rows
# of 7 to 2000, fp32): its dx is up to 5 fp32 roundings of the cancelling terms off (Sensitivity);
# with ULP_FLOOR this allows 6
CANCELLING_ROUNDINGS = 3.0


@dataclass
class Sensitivity:
    """What the floors of one measurement rest on, per output (float64, on the rounded inputs):
    ``terms``, the largest magnitude among the terms the output sums (a gradient cancels: the
    gradient of x on a row of length 1 is exactly 0, the difference of two terms of rstd w g);
    ``moved``, how far each element moves when each row's mean is off by one fp32 rounding;
    ``moved_saved``, the same when the mean is also kept in x's dtype (its rounding there);
    ``cancelling``, the magnitude of fp32 terms that cancel in a form some correct kernels use."""

    terms: dict[str, float]
    moved: dict[str, torch.Tensor]
    moved_saved: dict[str, torch.Tensor]
    cancelling: dict[str, float]


def sensitivity(exact: dict[str, torch.Tensor], eps: float, grad_out: torch.Tensor, rms: bool,
                saved_dtype: torch.dtype = torch.float32) -> Sensitivity:
    """The :class:`Sensitivity` of the kind's outputs under the upstream gradient ``grad_out``.

    Each row's mean moved by |mean| 2^-24, one row at a time, the moves summed in absolute value
    over rows (the weight's gradient sums rows); first order, so a mean kept in ``saved_dtype``
    (off by its rounding there as well) moves each output proportionally more. Where the mean
    dwarfs the spread it dominates every other error: on the offset regime (mean 1e4, spread 1)
    y moves by 6e-4, on a constant row of 1.0 (rstd 1/sqrt(eps)) by 2e-5 where y's exact value
    is the bias. rms_norm subtracts no mean: nothing moves."""
    x, w, g = exact["x"], exact["weight"], grad_out
    stat = x.pow(2).mean(-1, keepdim=True) if rms else x.var(-1, unbiased=False, keepdim=True)
    rstd = torch.rsqrt(stat + eps)
    mean = x.mean(-1, keepdim=True)
    xhat = x * rstd if rms else (x - mean) * rstd
    terms = {"y": float((xhat * w).abs().max()) + (float(exact["bias"].abs().max()) if "bias" in exact else 0.0),
             "dx": float((rstd * w * g).abs().max()),
             "dweight": float((g * xhat).abs().sum(0).max()),
             "dbias": float(g.abs().sum(0).max())}

    def outputs(shift):
        leaves = {n: t.detach().clone().requires_grad_(True) for n, t in exact.items()}
        y = norm_reference(leaves["x"], leaves["weight"], leaves.get("bias"), eps, rms, shift)
        y.backward(g)
        return {"y": y.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}

    base = outputs(None)
    moved = {n: torch.zeros_like(t) for n, t in base.items()}
    moved_saved = {n: torch.zeros_like(t) for n, t in base.items()}
    step = torch.zeros_like(stat) if rms else mean.abs() * MEAN_ROUNDING
    saved = step + (mean - mean.to(saved_dtype).to(mean.dtype)).abs()  # a constant row's mean stays exact
    for r in range(x.shape[0]):  # one row at a time, so that a sum over rows adds their moves
        if step[r] == 0:
            continue
        shift = torch.zeros_like(step)
        shift[r] = step[r]
        for n, t in outputs(shift).items():
            move = (t - base[n]).abs()
            moved[n] += move
            moved_saved[n] += move * (saved[r] / step[r])
    # dx as torch's CPU kernel forms it, a dy + b x + c per row, sums fp32 terms of about
    # rstd^2 |mean| mean|w dy| that cancel where the mean dwarfs the spread
    cancelling = {"dx": 0.0 if rms else float((rstd.pow(2) * mean.abs() * (w * g).abs().mean(-1, keepdim=True)).max())}
    return Sensitivity({n: terms[n] for n in base}, moved, moved_saved, cancelling)


def torch_backward_limit(a: NormInputs | None, dtype: torch.dtype, failed: set[str]) -> str | None:
    """Why torch's own layer_norm misses on the gradients of ``a`` in ``dtype``, where it is known
    to (``failed``: the outputs past their budget), else None.

    torch 2.13's CPU layer_norm saves the row mean and rstd for its backward in fp16 or bf16 and
    forms dx as a dy + b x + c: where a row's mean dwarfs its spread (|mean| rstd above 10), its
    gradients in 16-bit configs go past the floors, which allow one rounding of the saved mean
    (measured: rows of mean 100 and spread 1 in fp16, lengths 64 to 1024, its dx is 2 to 20 times
    as far off as a two-pass backward holding fp32 statistics; 1.0e-2 against 9.6e-4 on 4 rows of
    64). The drawn regime finds such rows; the built-in target's case says so."""
    if a is None or dtype not in (torch.float16, torch.bfloat16) or not failed or not failed <= {"dx", "dweight", "dbias"}:
        return None
    x = a.x.to(dtype).to(torch.float64)
    mean = x.mean(-1)
    if float((mean.abs() * torch.rsqrt(x.var(-1, unbiased=False) + a.eps)).max()) <= 10:
        return None
    return (f"torch's CPU layer_norm saves mean and rstd in {str(dtype).removeprefix('torch.')} for its backward, whose "
            f"{', '.join(sorted(failed))} lose accuracy on rows whose mean dwarfs their spread, as on this input (a known "
            "limit of torch's op, not of the harness)")


class NormKind(TensorKind):
    """layer_norm (``rms=False``) or rms_norm (``rms=True``) over the last dimension."""

    suite = "norm"
    table = ABS_ERROR_TABLE  # y crosses zero: judged on absolute error
    forward_output = "y"
    drawn = DrawnRegime("hypothesis", examples=10)  # few: each example runs forward and backward three ways

    def __init__(self, rms: bool):
        self.rms = rms
        self.name = "rms_norm" if rms else "layer_norm"
        formula = "x / sqrt(mean(x^2) + eps) * weight" if rms else "(x - mean) / sqrt(var + eps) * weight + bias"
        self.contract = (f"fn(x, weight, bias, eps) -> {formula} over the last dimension, shaped and typed as x"
                         + (" (called with bias=None)" if rms else ""))
        self.regimes = norm_regimes(rms)
        self.grad_inputs = ("x", "weight") if rms else ("x", "weight", "bias")
        super().__init__()

    def default_targets(self) -> list[Target]:
        return [Target(f"torch.{self.name}", self.torch_op, self.name, origin="built-in")]

    # ---- calling convention ----

    def floating_inputs(self, a: NormInputs) -> dict[str, torch.Tensor]:
        values = {"x": a.x, "weight": a.weight}
        if a.bias is not None:
            values["bias"] = a.bias
        return values

    declarations = {
        **TensorKind.declarations,
        "weight": "False: no weight nor bias (called fn(x), or fn(x, eps=) where it takes eps); default True",
        "eps": "the eps it uses whatever it is passed: a float, or 'finfo' for torch.finfo(x.dtype).eps (what "
               "F.rms_norm uses when eps is None); default: the regime's (1e-5), passed",
    }

    def normalise_declaration(self, name, key, value):
        if key == "weight":
            return declared_flag(name, key, value)
        if key == "eps":
            if isinstance(value, str) and value != "finfo":  # an ini line's 1e-6
                try:
                    value = float(value)
                except ValueError:
                    pass
            if value == "finfo" or (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0):
                return value if value == "finfo" else float(value)
            raise ValueError(f"target {name!r}: eps={value!r}: expected a number or 'finfo' (torch.finfo(x.dtype).eps)")
        return super().normalise_declaration(name, key, value)

    def for_target(self, case: Case, a: NormInputs) -> NormInputs:
        """The inputs as a target declaring ``weight=False`` or ``eps=`` reads them."""
        declared = case.target.declared
        changes = {}
        if not declared.get("weight", True):
            changes.update(weight=torch.ones_like(a.weight), bias=None if a.bias is None else torch.zeros_like(a.bias),
                           affine=False, eps_keyword=case.target.accepts("eps"))
        eps = declared.get("eps")
        if eps is not None:
            dtype = getattr(case.config, "input_dtype", None) or a.x.dtype
            changes["eps"] = float(torch.finfo(dtype).eps) if eps == "finfo" else eps
        return dataclasses.replace(a, **changes) if changes else a

    def case_grad_inputs(self, case: Case, inputs=None) -> tuple[str, ...]:
        grads = super().case_grad_inputs(case, inputs)
        return grads if case.target.declared.get("weight", True) else tuple(n for n in grads if n == "x")

    def invoke(self, fn, values, a: NormInputs, device):
        if not a.affine and getattr(fn, "__self__", None) is not self:  # the target, declared weight=False
            return fn(values["x"], eps=a.eps) if a.eps_keyword else fn(values["x"])
        return fn(values["x"], values["weight"], values.get("bias"), a.eps)

    def expected_shape(self, values, a: NormInputs):
        return tuple(values["x"].shape)

    def batch_size(self, case, a: NormInputs, values):
        return a.x.shape[0] if a.x.dim() >= 2 else None  # each row is normalised on its own

    def rows_of(self, case, a: NormInputs, values, rows):
        return (dataclasses.replace(a, x=a.x[rows]),
                {**values, "x": values["x"][rows.to(values["x"].device)]})

    def reference(self, x, weight, bias, eps):
        return norm_reference(x, weight, bias, eps, self.rms)

    def fresh_regime(self, target: Target, seed: int) -> Regime:
        return fresh_norm_regime(seed, self.rms)

    def torch_op(self, x, weight, bias, eps):
        """The built-in target: torch's op in the config, as a model calls it."""
        if self.rms:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)

    peer_name = "a composite with float32 statistics"

    def peer(self, x, weight, bias, eps):
        return composite_norm(x, weight, bias, eps, self.rms)

    # ---- numerics ----

    def rule_facts(self, ctx: MeasureContext) -> Sensitivity:
        """The oracle's sensitivity under this measurement's upstream gradient: output_rule's floors rest on it."""
        exact = ctx.exact
        return sensitivity(exact, ctx.inputs.eps, ctx.upstream(tuple(exact["x"].shape)), self.rms,
                           ctx.case.config.input_dtype)

    def output_rule(self, ctx: MeasureContext, name, out, peer, ref) -> OutputRule:
        """Absolute-error budgets, with a floor of ULP_FLOOR x (one ULP of the dtype at the largest
        term the output sums + how far one rounding of the row means moves it + CANCELLING_ROUNDINGS
        fp32 roundings of the terms a dy + b x + c cancels, for dx). The mean's rounding is taken
        in fp32 for y, where a correct kernel keeps its statistics in fp32 at best, and in x's dtype
        as well for the gradients, as torch's CPU kernel saves mean and rstd in fp16 or bf16 for its
        backward. Measured on CPU, torch 2.13, offset regime in fp32: F.layer_norm's y is 9.0e-4
        off (floor 1.7e-3), its dx 1.0e-3 (4.3e-3; the two-pass composite's 2.0e-4) and its
        dweight 5.6e-3 (2.2e-2); on rows centred on 0 the floor is the ULP term alone, 2 ULPs at
        the largest term, as for rms_norm (torch's errors there: 0.5 to 1 of them)."""
        rule = super().output_rule(ctx, name, out, peer, ref)
        config, facts = ctx.case.config, ctx.facts
        forward = name == self.forward_output
        if not forward and config.autocast_dtype is not None and config.fp8 is None:
            # autocast runs norms in fp32 (on CPU and CUDA): gradients count in the dtype the
            # target's y came back in, not in the autocast dtype (y is compared first)
            rule.dtype = ctx.rules[self.forward_output].dtype
        rule.peer_factor = PEER_FACTOR if forward else GRAD_PEER_FACTOR
        moved = (facts.moved if forward else facts.moved_saved)[name]
        terms = facts.terms[name]
        cancelling = facts.cancelling.get(name, 0.0) * CANCELLING_ROUNDINGS * 2.0 ** -24
        rule.abs_floor = ULP_FLOOR * (terms * format_of(rule.dtype).eps + float(moved.max()) + cancelling)
        # the regression budget's RMS: a row's mean, rounded in another order, moves the whole row alike
        rule.rms_floor = ULP_FLOOR * float(moved.pow(2).mean().sqrt())
        # zeros within the floor are cancellation (dx of a row that rounds to a constant), not lost values
        rule.underflow_floor = rule.abs_floor
        if forward and ref.numel() >= Y_RMS_MIN_ELEMENTS:
            # y's typical error too: statistics kept in 16 bits add roundings to every element, and its
            # RMS error shows them where its max (one element's rounding) cannot
            rms = float(ref.pow(2).mean().sqrt())
            floor = rule.rms_floor + Y_RMS_FLOOR_ULPS * rms * format_of(rule.dtype).eps / math.sqrt(ref.numel())
            # and each row's rstd one float32 rounding off, as it is at best: it moves the whole row alike,
            # which a few rows do not average out (Y_RSTD_ROUNDINGS)
            floor += Y_RSTD_ROUNDINGS * rms * 2.0 ** -24
            # Y_RMS_FACTOR x the larger of the peer's RMS error and that of composite_norm_affine_in_dtype
            rule.peer_rms_floor, rule.peer_rms_factor = floor, Y_RMS_FACTOR
            rule.careful_rms = self._affine_in_dtype_rms(ctx, rule, ref)
        return rule

    def _affine_in_dtype_rms(self, ctx: MeasureContext, rule: OutputRule, ref: torch.Tensor) -> float:
        """The RMS error of ``composite_norm_affine_in_dtype`` on the case's inputs (on the CPU, from
        the rounded inputs: its statistics' fp32 rounding moves y by far less than one rounding of
        y). 16-bit inputs only: for fp32 ones (autocast and fp8 configs too) it is the peer."""
        dtype = ctx.case.config.input_dtype
        if dtype not in (torch.float16, torch.bfloat16):
            return 0.0
        e = ctx.exact
        y = composite_norm_affine_in_dtype(e["x"].to(dtype), e["weight"].to(dtype),
                                           e["bias"].to(dtype) if "bias" in e else None, ctx.inputs.eps, self.rms)
        rms = compare(y, ref, rule.dtype, underflow_floor=rule.underflow_floor).rms_abs
        return 0.0 if math.isnan(rms) else rms

    def input_spec(self, regime: Regime, a: NormInputs) -> dict:
        return {"regime": regime.name, "seed": regime.seed, "shape": list(a.x.shape), "eps": a.eps}

    # ---- drawn inputs ----

    def draw(self, case: Case):
        from hypothesis import strategies as st

        rms = self.rms

        @st.composite
        def inputs(draw) -> NormInputs:
            rows, cols = draw(st.integers(1, 4)), draw(st.sampled_from([1, 2, 7, 64, 300]))
            shift = draw(st.sampled_from([0.0, 1.0, -30.0, 1e3, 1e4]))
            scale = draw(st.sampled_from([1.0, 0.0, 1e-3, 1e-2, 10.0, 300.0]))
            eps = draw(st.sampled_from([EPS, 1e-6]))
            g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
            x = seeded_normal(g, rows, cols, scale=scale, shift=shift)
            weight, bias = affine_parameters(g, cols, rms)
            return NormInputs(x, weight, bias, eps)

        return inputs()

    def describe_drawn(self, example: NormInputs, case: Case) -> list[str]:
        return [f"Hypothesis found (after shrinking) {example!r}"]

    def known_limit(self, case: Case, example: NormInputs, m) -> str | None:
        """The built-in torch target failing on a drawn input at a limit of torch's op
        (``torch_backward_limit``)."""
        if case.target.fn != self.torch_op or self.rms:
            return None
        return torch_backward_limit(example, case.config.input_dtype, m.failed_outputs())


LAYER_NORM = NormKind(rms=False)
RMS_NORM = NormKind(rms=True)
