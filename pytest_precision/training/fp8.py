"""Float8 training on ``torch._scaled_mm``: every ``nn.Linear`` of a model computes y = x W^T with x
and W cast to e4m3 and, in the backward, grad_input = g W and grad_weight = g^T x with the output
gradient g cast to e5m2, each at a per-tensor scale, as torchao's ``Float8Linear`` and
TransformerEngine train. The products run in ``torch._scaled_mm`` (on the CPU too, torch 2.13),
its outputs in float32; the bias is added outside, in the input's dtype.

**Scales.** A tensor is cast as ``clamp(x * s, -max, max).to(fp8)`` and ``_scaled_mm`` is handed
``1 / s`` to dequantise. ``s = max / amax`` in float32 (torchao's ``amax_to_scale``, its default
without power-of-two rounding), the amax chosen by the recipe's scaling:

- ``tensorwise`` (current scaling): the amax of the tensor being cast, at every call;
- ``delayed``: the largest amax in a history of the last ``history`` calls of that Linear and role
  (TransformerEngine's ``DelayedScaling(amax_history_len=16, amax_compute_algo="max")``, torchao's
  former delayed scaling): the tensor's own amax is recorded only after it is cast, so a tensor
  larger than every recorded one saturates. The first call, with an empty history, scales by its
  own amax (torchao initialised its history so), and so does a call whose history holds only
  zeros (a zero-initialised projection's weight, or the gradient behind it, before the first
  update): a floor on that amax would scale the first nonzero tensor by ``max / 1e-12`` and
  saturate all of it, and a scale of 1 (TransformerEngine's initial one) would lose a third of the
  gradients behind a zero-initialised projection at the first step after it moved (measured on
  tests/modern_gpt.py: 3,914 of 12,014 of a q/k/v Linear's output gradient).

**Recomputes.** An activation checkpoint's recompute runs a Linear's forward again inside the
backward. It casts its input and weight at the scales the forward used, and records and counts
nothing: TransformerEngine's recompute reuses its forward's scaling factors, and torchao's delayed
scales change only between steps. A recompute that moved the history would cast at other scales
than its forward whenever a micro-batch's amax grew the history (measured on nanoGPT with 2
micro-batches: SQNR 32 dB against the step without checkpointing, where both give the same bits).
The forward call is found by its operands (the input's and the weight's shapes, amaxes and sums;
calls with the same operands in the order they ran); a recompute that matches no forward call
(its inputs differ) casts at the history's scales as they stand.

**Counts.** Per Linear and role (``input``, ``weight``, ``grad``), over a run: the elements cast,
the *significant* ones (above 2^-24 of the tensor's amax, ``compare.NOISE_FLOOR``: below it a
value is the rounding noise of a sum that cancels, as an exactly-0 gradient's), the *saturated*
ones (the clamp changed their fp8 value: ``|x s|`` past the max by more than half the top
binade's spacing, 464 in e4m3, 61440 in e5m2) and the *underflowed* ones (significant, 0 in
fp8), beside those the careful recipe loses of the same tensors: current scaling in e4m3 for inputs
and weights, e5m2 for gradients. A tensor with many values far below its amax (a squared ReLU's
output) loses some in any fp8 recipe; what a recipe loses beyond the careful one is its own (a stale
history, a gradient cast to e4m3). Under delayed scaling the *careful saturated* count is what a
correct history of the same length saturates: the elements above every true amax of the role's
previous calls (a weight that starts at 0 and grows with each update, as a zero-initialised
projection at a learning rate of 0.02 does, outgrows its history at every step: 17.5 % of
tests/modern_gpt.py's ``blocks.1.proj`` weight over 4 steps, all of it the recipe's, none the
code's); a stale or wrongly fed history saturates beyond it. ``Fp8Counts`` holds them;
``fp8_problems`` judges what a recipe saturates and loses beyond the careful counts.

The operand layouts are those CUDA's kernels require (the first operand row-major, the second
column-major); the CPU accepts any (measured, torch 2.13: e4m3 and e5m2 in either position,
float32 scales of shape (), (1,) or (1, 1), row-wise scales, out_dtype float32, bfloat16 or
float16; a float64 scale is refused, and so is a 3-d operand).

Measured (CPU, torch 2.13): delayed scaling saturates, on the built-in GPT, 1028 of blocks.1.proj's
262144 input elements over 8 steps (0.39 %, at step 1; 0.23 % on the default ISA), and 0.66 % of fc1's
input on a 2-layer MLP whose inputs grow 1.3 x a step; e4m3 inputs and weights lose at most 2e-5 of
their values, e5m2 gradients none. On the built-in GPT a delayed history never updated is seen only by
the saturation count (5.4 % of blocks.1.proj's input): its loss, gradient SQNR (24.5 dB at the first
step, where nothing has grown yet) and final parameters stay where the correct recipe's are, and the
golden accepts them. Output gradients cast to e4m3 instead of e5m2 (17.8 binades below the amax
instead of 31.8) lose 0.396 % of blocks.1.qkv's gradient (2.5 % under delayed scaling) while their
gradient SQNR rises to 26.4 dB from e5m2's 24.5: only the count sees the range given up. torchao
0.18's ``Float8Linear`` on the CPU gives this recipe's forward to the bit and its gradients within
2.6e-7 relative (float32 summation order; ``tests/test_training_fp8.py``), but no longer has delayed
scaling and does not count what its casts lose, so the harness keeps its own recipe.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from ..numerics.formats import format_of
from ..numerics.problem import Problem
from .limits import count_text, limit_count, percent
from .loop_watch import recomputing

__all__ = ["Float8Recipe", "TensorCounts", "Fp8Counts", "scaled_mm_fp8_linears", "Float8Cast", "scaled_linear",
           "fp8_problems", "worst_text", "SATURATION_LIMIT", "UNDERFLOW_LIMIT", "ROLES"]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ROLES = ("input", "weight", "grad")
AMAX_EPS = 1e-12  # torchao's floor on an amax: an all-zero tensor gets a finite scale
NOISE_FLOOR = 2.0 ** -24  # compare.NOISE_FLOOR (compare imports the configs, which import this module)

# A run fails where more than these fractions of one Linear's tensor of one role (its elements over
# the run's calls) saturated, or of its significant elements were lost to 0; a count past one as
# limits.limit_count has it (the limit and a count's spread). Measured (torch 2.13, CPU): correct
# delayed scaling saturates the values that outgrow the history's amax at the call they appear,
# 0.39 % of the built-in GPT's blocks.1.proj input over 8 steps and 0.66 % of a 2-layer MLP's
# input growing 1.3 x a step, a history that is never updated 5.4 % and 21 %; correct e4m3 inputs
# and weights lose at most 2e-5 of their values to 0, e5m2 gradients none, e4m3 gradients 0.4 % of
# the GPT's q/k/v output gradient (current scaling) and 2.5 % (delayed)
SATURATION_LIMIT = 0.02
UNDERFLOW_LIMIT = 1e-3


@dataclass(frozen=True)
class Float8Recipe:
    """How the Linears are cast: ``scaling`` ``"tensorwise"`` (current amax) or ``"delayed"``
    (max of an amax history of ``history`` calls); ``forward_dtype`` for inputs and weights,
    ``grad_dtype`` for the output gradient."""

    scaling: str = "tensorwise"
    history: int = 16
    forward_dtype: torch.dtype = E4M3
    grad_dtype: torch.dtype = E5M2

    def __post_init__(self):
        if self.scaling not in ("tensorwise", "delayed"):
            raise ValueError(f"Float8Recipe.scaling must be 'tensorwise' or 'delayed', got {self.scaling!r}")
        if not (isinstance(self.history, int) and self.history >= 1):
            raise ValueError(f"Float8Recipe.history must be a positive int, got {self.history!r}")
        for name in ("forward_dtype", "grad_dtype"):
            if getattr(self, name) not in (E4M3, E5M2):
                raise ValueError(f"Float8Recipe.{name} must be torch.float8_e4m3fn or torch.float8_e5m2, "
                                 f"got {getattr(self, name)!r}")

    def dtype(self, role: str) -> torch.dtype:
        return self.grad_dtype if role == "grad" else self.forward_dtype


@dataclass
class TensorCounts:
    """One Linear's tensor of one role, over a run's calls."""

    calls: int = 0
    elements: int = 0
    significant: int = 0  # above the tensor's rounding noise (compare.NOISE_FLOOR of its amax)
    saturated: int = 0
    underflowed: int = 0
    careful_underflowed: int = 0  # significant elements current scaling in the careful format loses
    # elements a correct history of the same length saturates (delayed scaling; 0 under current scaling):
    # those above every amax of the previous calls, a tensor outgrowing its history
    careful_saturated: int = 0
    first_saturated_call: int | None = None  # the call (0-based) that first saturated an element
    dtype: str = ""  # the fp8 dtype its casts went to, where a recipe of the spec's own was observed (fp8_observed)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Fp8Counts:
    """Per Linear (its name in the model) and role, what the casts of a run saturated and lost."""

    recipe: Float8Recipe | None  # None: the spec's own conversion, its casts observed (training.fp8_observed)
    linears: list[str] = field(default_factory=list)  # the Linears run in fp8, by name
    tensors: dict[tuple[str, str], TensorCounts] = field(default_factory=dict)

    def of(self, linear: str, role: str) -> TensorCounts:
        return self.tensors.setdefault((linear, role), TensorCounts())

    def total(self, what: str) -> int:
        return sum(getattr(c, what) for c in self.tensors.values())

    def as_dict(self) -> dict:
        """JSON-ready: ``{"recipe": ..., "tensors": {"blocks.0.up input": {...}}}``."""
        r = self.recipe
        return {"recipe": "the spec's own" if r is None else
                {"scaling": r.scaling, "history": r.history, "forward_dtype": str(r.forward_dtype),
                 "grad_dtype": str(r.grad_dtype)},
                "tensors": {f"{n} {role}": c.as_dict() for (n, role), c in self.tensors.items()}}


def saturation_threshold(dtype: torch.dtype) -> float:
    """Where rounding alone leaves ``dtype``'s range: its max plus half the top binade's spacing (a
    scaled value past it saturated)."""
    fmt = format_of(dtype)
    return fmt.max + 2.0 ** (fmt.emax - fmt.mantissa_bits) / 2


def careful_dtype(role: str) -> torch.dtype:
    """The careful recipe's format for a role: e5m2 for output gradients, e4m3 for inputs and weights."""
    return E5M2 if role == "grad" else E4M3


def careful_lost(x: torch.Tensor, significant: torch.Tensor, role: str) -> int:
    """Of ``x``'s ``significant`` elements, those current scaling in the careful format casts to 0 (a
    scale is linear: ``x`` may be the tensor or any scaling of it)."""
    careful = careful_dtype(role)
    fmax = format_of(careful).max
    amax = x.detach().abs().max().float()
    kept = (x.detach().float() * (fmax / torch.clamp(amax, min=AMAX_EPS))).clamp(-fmax, fmax)
    return int(((kept.to(careful).float() == 0) & significant).sum())


class Float8Cast:
    """The cast of one Linear's tensors: the scales (current, or from each role's amax history) and
    the counts of what each cast saturated and lost."""

    # forward casts remembered for a recompute to find (per Linear; a step's micro-batches and the
    # Linear's uses per forward, with room to spare)
    REMEMBERED = 1024

    def __init__(self, name: str, recipe: Float8Recipe, counts: Fp8Counts):
        self.name, self.recipe, self.counts = name, recipe, counts
        self.history: dict[str, list[torch.Tensor]] = {role: [] for role in ROLES}
        # the true amaxes of each role's previous calls: the history a correct delayed recipe keeps,
        # what its saturation is judged against
        self.true_amax: dict[str, list[torch.Tensor]] = {role: [] for role in ROLES}
        # operands key -> the (input, weight) scales of the forward calls with those operands, in order
        self.forward_scales: OrderedDict[tuple, deque] = OrderedDict()

    def amax(self, role: str, x: torch.Tensor) -> torch.Tensor:
        """The amax the scale of ``x`` is drawn from under the recipe."""
        history = self.history[role]
        if self.recipe.scaling == "delayed" and history:
            held = torch.stack(history).max()
            if bool(held > 0):  # a history of zeros holds no scale yet (the module docstring)
                return held
        return x.detach().abs().max().float()

    def record(self, role: str, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
        """After ``x`` was cast to ``q`` at ``scale``: x's amax enters the role's history (delayed
        scaling). Not q's: a clamped tensor's amax never exceeds the history's."""
        if self.recipe.scaling == "delayed":
            history = self.history[role]
            history.append(x.detach().abs().max().float())
            del history[:-self.recipe.history]

    def _scale(self, role: str, x: torch.Tensor) -> torch.Tensor:
        return (format_of(self.recipe.dtype(role)).max / torch.clamp(self.amax(role, x), min=AMAX_EPS)).to(torch.float32)

    def _quantise(self, role: str, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x s in float32, clamp(x s) in the role's fp8 format)."""
        dtype = self.recipe.dtype(role)
        fmax = format_of(dtype).max
        scaled = x.detach().float() * scale
        return scaled, scaled.clamp(-fmax, fmax).to(dtype)

    def __call__(self, role: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` cast to the role's fp8 format at the recipe's scale, recorded and counted: (the fp8
        tensor, the float32 dequantisation scale 1/s)."""
        q, scale = self._cast(role, x)
        return q, scale.reciprocal()

    def _cast(self, role: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self._scale(role, x)
        scaled, q = self._quantise(role, x, scale)
        self.record(role, x, q, scale)
        c = self.counts.of(self.name, role)
        past = saturation_threshold(self.recipe.dtype(role))
        saturated = int((scaled.abs() > past).sum())
        careful_saturated = self._careful_saturated(role, x, past, saturated)
        if saturated and c.first_saturated_call is None:
            c.first_saturated_call = c.calls
        # an element counts as lost where it is above the rounding noise of the sum that gave it
        # (NOISE_FLOOR of the tensor's amax): the noise of an exactly-0 gradient is not a value
        magnitude = scaled.abs()
        significant = magnitude > NOISE_FLOOR * magnitude.max()
        c.calls += 1
        c.elements += x.numel()
        c.significant += int(significant.sum())
        c.saturated += saturated
        c.careful_saturated += careful_saturated
        lost = (q.float() == 0) & significant
        c.underflowed += int(lost.sum())
        if self.recipe.scaling == "tensorwise" and self.recipe.dtype(role) == careful_dtype(role):
            c.careful_underflowed += int(lost.sum())  # this cast is the careful one
        else:
            c.careful_underflowed += careful_lost(x, significant, role)
        return q, scale

    def _careful_saturated(self, role: str, x: torch.Tensor, past: float, saturated: int) -> int:
        """What a correct delayed recipe saturates of ``x`` (0 under current scaling), and x's amax into
        the true history: the elements above every amax of the previous ``history`` calls."""
        if self.recipe.scaling != "delayed":
            return 0
        true = self.true_amax[role]
        held = torch.stack(true).max() if true else None
        true.append(x.detach().abs().max().float())
        del true[:-self.recipe.history]
        if not saturated or held is None or not bool(held > 0):
            return 0
        scale = (format_of(self.recipe.dtype(role)).max / torch.clamp(held, min=AMAX_EPS)).to(torch.float32)
        return int(((x.detach().float() * scale).abs() > past).sum())

    @staticmethod
    def _operands_key(x: torch.Tensor, weight: torch.Tensor) -> tuple:
        """A forward call's operands as a recompute finds them again: shapes, amaxes and sums of both
        (the weight alone is the same at every use of the Linear in a step)."""
        return tuple((tuple(t.shape), float(t.detach().abs().max()), float(t.detach().float().sum()))
                     for t in (x, weight))

    def cast_operands(self, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A call's input and weight cast (``__call__``): (xq, 1/s_x, wq, 1/s_w). A checkpoint's recompute
        casts them at the scales the forward call with the same operands used (the module doc), in
        the order those calls ran, and records and counts nothing."""
        delayed = self.recipe.scaling == "delayed"
        if recomputing():
            scales = None
            if delayed:
                calls = self.forward_scales.get(self._operands_key(x, weight))
                if calls:  # the earliest forward call with these operands; the last one stays for a later recompute
                    scales = calls.popleft() if len(calls) > 1 else calls[0]
            out = []
            for i, (role, t) in enumerate((("input", x), ("weight", weight))):
                scale = scales[i] if scales is not None else self._scale(role, t)
                out += [self._quantise(role, t, scale)[1], scale.reciprocal()]
            return tuple(out)
        xq, x_scale = self._cast("input", x)
        wq, w_scale = self._cast("weight", weight)
        if delayed:
            key = self._operands_key(x, weight)
            self.forward_scales.setdefault(key, deque()).append((x_scale, w_scale))
            self.forward_scales.move_to_end(key)
            while len(self.forward_scales) > self.REMEMBERED:
                self.forward_scales.popitem(last=False)
        return xq, x_scale.reciprocal(), wq, w_scale.reciprocal()


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix stored column-major (what ``_scaled_mm`` wants of its second operand on CUDA)."""
    return t.t().contiguous().t()


class _ScaledLinear(torch.autograd.Function):
    """y = x W^T in fp8 (``Float8Cast`` casts), grad_input = g W and grad_weight = g^T x with g in
    the gradient format; every product in ``torch._scaled_mm``, float32 out."""

    @staticmethod
    def forward(ctx, x, weight, cast):
        xq, x_inv, wq, w_inv = cast.cast_operands(x.reshape(-1, x.shape[-1]), weight)
        y = torch._scaled_mm(xq, wq.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=torch.float32)
        ctx.save_for_backward(xq, x_inv, wq, w_inv)
        ctx.cast, ctx.shape, ctx.dtypes = cast, x.shape, (x.dtype, weight.dtype)
        return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        xq, x_inv, wq, w_inv = ctx.saved_tensors
        gq, g_inv = ctx.cast("grad", grad.reshape(-1, grad.shape[-1]))
        grad_x = torch._scaled_mm(gq, _column_major(wq), scale_a=g_inv, scale_b=w_inv, out_dtype=torch.float32)
        grad_w = torch._scaled_mm(gq.t().contiguous(), _column_major(xq), scale_a=g_inv, scale_b=x_inv,
                                  out_dtype=torch.float32)
        return grad_x.reshape(ctx.shape).to(ctx.dtypes[0]), grad_w.to(ctx.dtypes[1]), None


def scaled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cast: Float8Cast) -> torch.Tensor:
    """``F.linear`` in fp8 through ``torch._scaled_mm``; the bias added after, in x's dtype."""
    if x.is_cuda:  # CUDA's fp8 GEMMs take dimensions in multiples of 16 (the backward's too: the rows)
        dims = {"in_features": x.shape[-1], "out_features": weight.shape[0],
                "rows of the input": x.numel() // x.shape[-1]}
        odd = {k: v for k, v in dims.items() if v % 16}
        if odd:
            raise ValueError(f"Linear {cast.name!r}: torch._scaled_mm on CUDA needs dimensions in multiples of 16, got "
                             + ", ".join(f"{k} {v}" for k, v in odd.items()))
    y = _ScaledLinear.apply(x, weight, cast)
    return y if bias is None else y + bias.to(y.dtype)


@contextlib.contextmanager
def scaled_mm_fp8_linears(model: nn.Module, recipe: Float8Recipe, counts: Fp8Counts | None = None,
                   keep_fp32: tuple[str, ...] = ()) -> Iterator[Fp8Counts]:
    """Every nn.Linear of ``model`` runs through ``scaled_linear`` inside the block, each with its
    own casts (and amax histories, fresh for the block), but those declared float32 (``keep_fp32``,
    as ``module_dtypes.declared_fp32`` reads it); yields the counts, filled as it runs."""
    from .module_dtypes import declared_fp32

    counts = counts if counts is not None else Fp8Counts(recipe)
    linears = [(n, m) for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and not declared_fp32(n, keep_fp32)]
    counts.linears = [n for n, _ in linears]

    def fp8_forward(m, cast):
        return lambda x: scaled_linear(x, m.weight, m.bias, cast)
    for n, m in linears:
        m.forward = fp8_forward(m, Float8Cast(n, recipe, counts))
    try:
        yield counts
    finally:
        for _, m in linears:
            del m.forward


def fp8_problems(counts: Fp8Counts) -> list[Problem]:
    """The fp8 verdict: the tensor (Linear and role) furthest past
    ``SATURATION_LIMIT`` of its elements saturated (``overflow``), and the one furthest past
    ``UNDERFLOW_LIMIT`` of its significant elements lost to 0 beyond what the careful recipe loses
    of them (``underflow``), in counts (``limits.limit_count``: the limit and a count's spread)."""
    out = []
    for what, limit, total_of, category, word in (
            ("saturated", SATURATION_LIMIT, "elements", "overflow", "saturated at the format's max"),
            ("underflowed", UNDERFLOW_LIMIT, "significant", "underflow", "lost to 0 (significant values)")):
        bad = []
        for (name, role), c in counts.tensors.items():
            count, total = getattr(c, what), getattr(c, total_of)
            beyond = count - (c.careful_underflowed if what == "underflowed" else c.careful_saturated)
            if total and beyond > limit_count(limit, total):
                bad.append((count / total, name, role, count, total, c))
        if not bad:
            continue
        rate, name, role, count, total, c = max(bad, key=lambda b: (b[0], b[1], b[2]))
        dtype = c.dtype or str(counts.recipe.dtype(role)).replace("torch.", "")
        since = (f", from call {c.first_saturated_call} of {c.calls}" if what == "saturated" and
                 c.first_saturated_call is not None else "")
        if what == "underflowed" and c.careful_underflowed:
            careful = "e5m2" if role == "grad" else "e4m3"
            since = f"; current scaling in {careful}, the careful recipe, loses {c.careful_underflowed}"
        more = f"; {len(bad) - 1} more tensors past it" if len(bad) > 1 else ""
        own = counts.recipe is None
        allowed = (" more than current scaling in the careful format loses" if what == "underflowed" else
                   f" more than a correct amax history of {counts.recipe.history} calls saturates, "
                   f"{c.careful_saturated} here: what outgrows every earlier amax"
                   if not own and counts.recipe.scaling == "delayed" else
                   f" more than a scale from the earlier calls' amaxes saturates, {c.careful_saturated} here: what "
                   "outgrows every earlier amax" if own else "")
        if own:
            allowed += _own_cause(what, count, total, c)
        out.append(Problem("oracle", category, f"fp8 {word}: {count_text(count, total)} of {name}'s {role} in {dtype}"
                           f"{since} > {percent(limit)} allowed (up to {limit_count(limit, total)} elements{allowed})"
                           f"{more}"))
    return out


def _own_cause(what: str, count: int, total: int, c: TensorCounts) -> str:
    """What a recipe of the spec's own did, where its counts say it: values scaled below the range
    (a scale inverted or applied twice), a saturation a correct scale would not give."""
    if what == "underflowed" and count > total / 2 and c.careful_underflowed < count / 10:
        return ("; most values were scaled below the format's range: a scale inverted (amax / max for max / amax) or "
                "applied twice")
    if what == "saturated":
        return ("; the scale is larger than max / amax of the values cast: a stale or wrongly fed amax history, or a "
                "scale computed for another format")
    return ""


def worst_text(counts: Fp8Counts, what: str) -> str:
    """``"1028 of 262144 (0.392 %) blocks.1.proj input"``: a run's tensor with the largest rate of
    ``what`` (``saturated`` or ``underflowed``), or ``"0"``."""
    total_of = "elements" if what == "saturated" else "significant"
    rates = [(getattr(c, what) / getattr(c, total_of), n, role, c) for (n, role), c in counts.tensors.items()
             if getattr(c, total_of) and getattr(c, what)]
    if not rates:
        return "0"
    rate, n, role, c = max(rates, key=lambda r: (r[0], r[1], r[2]))
    return f"{getattr(c, what)} of {getattr(c, total_of)} ({percent(rate)}) {n} {role}"
