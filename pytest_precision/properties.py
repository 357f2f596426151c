"""Property helpers for users' own Hypothesis tests: each returns a :class:`PropertyResult` with the
measured error, its budget and the core comparison's statistics, and steers Hypothesis toward
the worst case with ``hypothesis.target()`` when called inside a ``@given`` test.

One argument rule: the output under test comes first, then the inputs it came from
(``softmax_order_preserved(probs, logits)``); a property that calls the function itself takes the
function first, then its inputs (``softmax_shift_invariant(softmax, x)``). Calls that look
swapped raise a ValueError or TypeError naming the helper and the argument (``property_arguments``).

    @given(logits(torch.float16))
    def test_my_softmax(x):
        softmax_rows_sum_to_one(my_softmax(x), x).assert_ok()

``softmax_rows_sum_to_one``'s bound, measured on a CPU (torch 2.13): torch's softmax (also on AVX2 and
without SIMD) and fp32-then-round pass rows of 8192 and 32768 in fp32, fp16 and bf16, and logits
drawn with every regime. Rows of 1000 N(0, 1) logits summing to 1 + 1e-3 fail in all three dtypes
with the logits (bf16 bounds 5e-6 to 3e-4), and without them in fp32 and fp16 (bf16's bound is 2e-3
to 3.4e-3 there: its rounding alone can move such a row that far). Where a few probabilities near 0.3
carry a row (logits of scale 3), bf16's rounding of those moves the sum by up to 1.7e-3 and the bound
follows. fp16 rows of 1000 summing to 1.2 and fp32 rows of 8192 scaled by 1.0004 (4e-4 against a
bound of 1.2e-4) fail. ``softmax_shift_invariant`` with ``c=None`` shifts by at most 16 in fp16 and
128 in fp32 and bf16 (enough to carry logits near 0 past exp's overflow point); a row with no exact
shift (one mixing 1e4 and 1e-30) is left out and counted in the message.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from hypothesis import currently_in_test_context, target
from hypothesis.errors import InvalidArgument

from .kinds.outcome import PrecisionFailure
from .numerics.formats import FORMATS, format_of, ulp
from .numerics.describe import comparison_lines
from .numerics.inputs import seeded_normal
from .numerics.metrics import Comparison, compare
from .property_arguments import check_callable, check_probs
from .property_budgets import row_sum_budget

__all__ = [
    "PropertyResult", "Verdict", "softmax_rows_sum_to_one", "softmax_shift_invariant", "softmax_order_preserved",
    "softmax_masked_positions_zero", "softmax_in_unit_interval", "attention_key_permutation_equivariant",
    "attention_output_in_value_range", "attention_causal_ignores_future",
]

_TARGET_CAP = 1e300  # hypothesis.target() takes finite floats: inf and NaN climb to this


@dataclass
class PropertyResult:
    """Outcome of one property: ``error`` (in ``unit``) against ``budget``."""

    name: str
    passed: bool
    error: float
    budget: float
    unit: str
    detail: str = ""
    comparison: Comparison | None = None

    def __bool__(self) -> bool:
        return self.passed

    def message(self) -> str:
        head = f"{self.name}: {'holds' if self.passed else 'VIOLATED'}: {self.unit} {self.error:.4g}" \
               f" (budget {self.budget:.4g})"
        lines = [head] + ([f"  {self.detail}"] if self.detail else [])
        if self.comparison is not None:
            lines += comparison_lines(self.comparison, None)
        return "\n".join(lines)

    def assert_ok(self) -> "PropertyResult":
        __tracebackhide__ = True  # the failure is the message, not this frame
        if not self.passed:
            raise PrecisionFailure(self.message())
        return self


Verdict = PropertyResult  # its earlier name


def _steer(value: float, label: str) -> None:
    """hypothesis.target() under ``label``; Hypothesis refuses a label twice in one example, so
    the k-th call of a helper within an example takes "label (k)", the same in every example."""
    for k in range(1, 65):
        try:
            target(value, label=label if k == 1 else f"{label} ({k})")
            return
        except InvalidArgument:
            continue


def _verdict(name: str, error: float, budget: float, unit: str, detail: str = "",
             comparison: Comparison | None = None, score: float | None = None) -> PropertyResult:
    """``score``: what Hypothesis should climb, when not the error itself (a ratio to a budget
    that differs from row to row)."""
    if currently_in_test_context():
        s = error if score is None else score
        _steer(min(s, _TARGET_CAP) if not math.isnan(s) else _TARGET_CAP, name)
    return PropertyResult(name, bool(error <= budget), error, budget, unit, detail, comparison)


def _compare_dtype(t: torch.Tensor) -> torch.dtype:
    return t.dtype if t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) else torch.float32


def _live_rows(logits: torch.Tensor | None, probs: torch.Tensor) -> torch.Tensor:
    """Rows with a defined softmax: not fully masked and free of +inf and NaN logits. The others
    are NaN by IEEE arithmetic (-inf - -inf, inf - inf), which is the documented rule."""
    if logits is None:
        return torch.ones(probs.shape[:-1], dtype=torch.bool, device=probs.device)
    bad = torch.isnan(logits) | torch.isposinf(logits)
    return ~torch.isneginf(logits).all(dim=-1) & ~bad.any(dim=-1)


# ---- softmax ---------------------------------------------------------------------------------

def softmax_rows_sum_to_one(probs: torch.Tensor, logits: torch.Tensor | None = None, *,
                            ulp_budget: float | None = None,
                            working_dtype: torch.dtype | None = None) -> PropertyResult:
    """Each row of ``probs`` sums (in float64) to 1 within a bound derived from the arithmetic.

    Error and budget are in ULPs of probs' dtype at 1.0 (2^-mantissa_bits: fp32 1.19e-7, fp16
    9.77e-4, bf16 7.81e-3); the message gives the worst row against its own bound. Per row of n
    elements, with u the unit roundoff of ``working_dtype`` (the dtype the softmax computes in;
    default float32, float64 for float64 probs: what torch's softmax, autocast, Triton and
    FlashAttention kernels use for 16-bit outputs), the bound is:

    * ``(min(n - 1, n/4 + 20) + 4) u`` for the normalizer. A sum of n positive terms is off by at
      most (its longest chain of additions) x u: the whole row when short, else a quarter of it
      (every SIMD and GPU reduction keeps at least four partial sums) plus leftovers and the
      combining levels. 4 u more for rounding the sum or its reciprocal, and for numerators whose
      exps were computed apart from the summed ones. A single running sum can reach n u in
      theory; measured, one over 131072 fp32 exps is off by 5543 u, inside the 32792 u here.
    * without ``logits`` (or when probs are as precise as the working dtype): half an ULP of each
      output, in the coarser of the two dtypes, for its final rounding (half the subnormal
      spacing for outputs that are 0 or subnormal). All in one direction at worst: between a
      quarter and half an ULP at 1.0, plus the subnormal terms, so a bf16 row off by 1e-3
      (0.13 ULP) can pass.
    * with ``logits`` and probs narrower than the working dtype: instead of that worst case, the
      sums of the lowest and the highest values each output can round to, from the exact softmax
      of ``logits`` and the working dtype's errors (the normalizer's, and exp's argument: 2 u per
      unit of |x - max| + |x| + |max|, which covers exp2 kernels that scale by log2(e) before
      subtracting the max). The rounding is then known, so the bound is tight in every dtype:
      bf16 rows of 1000 N(0, 1) logits get 5e-6 to 3e-4 against a planted 1e-3.

    ``logits`` must be what the softmax was computed from. A softmax that rounds its exps or their
    sum to 16 bits on the way is judged with ``working_dtype=torch.float16`` (or bfloat16), whose
    bound is as loose as that arithmetic. ``ulp_budget`` replaces the bound with a fixed one. Rows
    whose logits are fully masked, +inf or NaN are skipped (their softmax is NaN by rule).
    """
    helper = "softmax_rows_sum_to_one"
    check_probs(helper, probs, logits)
    dtype = probs.dtype if probs.dtype in FORMATS else torch.float32
    work = working_dtype or (torch.float64 if dtype == torch.float64 else torch.float32)
    n = probs.shape[-1]
    eps = format_of(dtype).eps
    live = _live_rows(logits, probs)
    sums = probs.to(torch.float64).sum(-1)[live]
    dev = torch.nan_to_num((sums - 1).abs(), nan=math.inf)
    if ulp_budget is None:
        budget, how = row_sum_budget(probs, logits, dtype, work)
        budget = torch.nan_to_num(budget[live], nan=0.0)  # a NaN output: its own verdict, not a NaN bound
    else:
        budget, how = torch.full_like(sums, ulp_budget * eps), "ulp_budget"
    if not dev.numel():
        return _verdict("softmax rows sum to 1", 0.0, 0.0, "ULP", "no row to judge (all masked)")
    over = dev - budget
    i = int(over.argmax())
    worst, allowed = float(dev[i]) / eps, float(budget[i]) / eps
    detail = f"worst row sums to {float(sums[i])!r} ({n} elements); bound {allowed:.3g} ULP at 1.0 from {how}"
    score = float((dev / budget.clamp_min(1e-300)).max())
    return _verdict("softmax rows sum to 1", worst, allowed, "ULP", detail, score=score)


def _exact_sum(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Where ``x + c`` is exact in x's dtype (non-finite elements count as exact)."""
    x64 = x.to(torch.float64)
    c64 = c.to(torch.float64)
    s = x64 + c64
    b = s - x64
    err = (x64 - (s - b)) + (c64 - b)  # TwoSum: the float64 sum's rounding error, exactly
    exact = (err == 0) & torch.isfinite(s)
    if x.dtype != torch.float64:
        exact &= s.to(x.dtype).to(torch.float64) == s
    return exact | ~torch.isfinite(x64)


def _row_shifts(x: torch.Tensor, sign: float) -> torch.Tensor:
    """Per row, the largest power of two c (times ``sign``) with x + c exact on every element,
    up to twice exp's overflow point of x's dtype (far enough to carry a row past overflow or
    underflow, no further); 0 where no shift is exact (a row mixing 1e4 and 1e-30)."""
    top = int(math.floor(math.log2(2 * math.log(format_of(x.dtype).max))))
    x64 = x.to(torch.float64)
    big = torch.where(torch.isfinite(x64), x64.abs(), torch.zeros_like(x64)).amax(-1)
    # no shift finer than the spacing at a row's largest element is exact there
    low = int(math.floor(math.log2(float(ulp(big, x.dtype).min())))) if big.numel() else top
    cands = sign * torch.pow(2.0, torch.arange(top, low - 1, -1, dtype=torch.float64, device=x.device))
    best = torch.zeros(x.shape[:-1], dtype=torch.float64, device=x.device)
    chunk = max(1, 2 ** 20 // max(x.numel(), 1))  # candidates tried at once, about 8 MB of float64
    for i in range(0, cands.numel(), chunk):
        c = cands[i:i + chunk]
        ok = _exact_sum(x, c.view(-1, *([1] * x.dim()))).all(-1)  # (candidates, rows...)
        first = c[ok.to(torch.int8).argmax(0)]  # the largest exact one in this chunk
        best = torch.where((best == 0) & ok.any(0), first, best)
        if bool((best != 0).all()):
            break
    return best


def softmax_shift_invariant(softmax: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                            c: float | torch.Tensor | None = None, *, ulp_budget: float = 2.0) -> PropertyResult:
    """``softmax(x + c)`` against ``softmax(x)``: with x + c exact, a max-subtracting softmax
    gives the same bits, and one that depends on the logits' level (no max subtraction, a clamp)
    does not.

    ``c=None`` (the default) picks the shifts itself, per row (softmax is invariant row by row):
    the largest power of two up, and the largest down, that keep every element of the row exact,
    at most twice exp's overflow point (fp16: 16, fp32 and bf16: 128). Both are judged. A row
    with no exact shift (mixing magnitudes such as 1e4 and 1e-30) is left out and counted in the
    detail. An explicit ``c`` (a float, or a tensor broadcasting against x) must keep x + c exact:
    a ValueError names the elements where it does not.
    """
    helper = "softmax_shift_invariant"
    check_callable(helper, "softmax", softmax, x)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{helper}: `x` must be a tensor of logits, got {type(x).__name__}")
    name = "softmax shift invariance"
    if c is not None:
        ct = torch.as_tensor(c, dtype=torch.float64, device=x.device)
        exact = _exact_sum(x, ct)
        if not bool(exact.all()):
            xb, cb = torch.broadcast_tensors(x.to(torch.float64), ct)
            where = torch.nonzero(~exact)
            first = tuple(where[0].tolist())
            xv, cv = float(xb[first]), float(cb[first])
            got = float((xb[first] + cb[first]).to(x.dtype))
            raise ValueError(f"{helper}: x + c is not exact in {x.dtype} at {len(where)} element(s), first at "
                             f"{first}: {xv!r} + {cv!r} rounds to {got!r}; pass c=None to let the helper pick an "
                             "exact shift per row")
        shifts = [ct]
    else:
        shifts = [_row_shifts(x, 1.0)[..., None], _row_shifts(x, -1.0)[..., None]]
    a = softmax(x)
    ref = a.to(torch.float64)
    worst: Comparison | None = None
    for s in shifts:
        shifted = (x.to(torch.float64) + s).to(x.dtype)
        cmp = compare(softmax(shifted), ref, _compare_dtype(a))
        if worst is None or not cmp.max_ulp <= worst.max_ulp:
            worst = cmp
    if c is None:
        up, down = shifts[0][..., 0], shifts[1][..., 0]
        rows = max(up.numel(), 1)
        detail = f"exact shifts per row: up {_span(up)}, down {_span(down)}"
        skipped = int((up == 0).sum()) + int((down == 0).sum())
        if skipped:
            detail += f"; {skipped} of {2 * rows} row shifts impossible (no exact one), left out"
    else:
        detail = f"c = {c!r}" if not isinstance(c, torch.Tensor) else "c as given"
    return _verdict(name, worst.max_ulp, ulp_budget, "ULP", detail, comparison=worst)


def _span(c: torch.Tensor) -> str:
    nz = c[c != 0].abs()
    if not nz.numel():
        return "none"
    lo, hi = float(nz.min()), float(nz.max())
    return f"{hi:g}" if lo == hi else f"{lo:g} to {hi:g}"


def softmax_order_preserved(probs: torch.Tensor, logits: torch.Tensor) -> PropertyResult:
    """x_i < x_j implies p_i <= p_j in every row; error is the number of violating pairs."""
    check_probs("softmax_order_preserved", probs, logits)
    xs, order = torch.sort(logits.to(torch.float64), dim=-1, stable=True)
    ps = torch.gather(probs.to(torch.float64), -1, order)
    strictly_up = xs[..., 1:] > xs[..., :-1]
    down = ps[..., 1:] < ps[..., :-1]
    bad = strictly_up & (down | torch.isnan(ps[..., 1:]) | torch.isnan(ps[..., :-1]))
    bad &= _live_rows(logits, probs)[..., None]
    n = int(bad.sum())
    return _verdict("softmax preserves order", float(n), 0.0, "violating pairs")


def softmax_masked_positions_zero(probs: torch.Tensor, logits: torch.Tensor) -> PropertyResult:
    """Positions whose logit is -inf get probability exactly 0 (rows not fully masked)."""
    check_probs("softmax_masked_positions_zero", probs, logits)
    masked = torch.isneginf(logits) & _live_rows(logits, probs)[..., None]
    bad = masked & (probs != 0)
    n = int(bad.sum())
    detail = f"first at {tuple(torch.nonzero(bad)[0].tolist())}: {float(probs[bad][0])!r}" if n else ""
    return _verdict("softmax masked positions are 0", float(n), 0.0, "nonzero masked positions", detail)


def softmax_in_unit_interval(probs: torch.Tensor, logits: torch.Tensor | None = None) -> PropertyResult:
    """Every probability is in [0, 1] and not NaN (rows whose logits are fully masked, +inf or
    NaN are skipped)."""
    check_probs("softmax_in_unit_interval", probs, logits)
    live = _live_rows(logits, probs)[..., None].expand_as(probs)
    bad = live & ~((probs >= 0) & (probs <= 1))  # NaN fails both comparisons
    n = int(bad.sum())
    detail = f"first at {tuple(torch.nonzero(bad)[0].tolist())}: {float(probs[bad][0])!r}" if n else ""
    return _verdict("softmax outputs in [0, 1]", float(n), 0.0, "elements outside", detail)


# ---- attention -------------------------------------------------------------------------------

def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _row_scaled_error(a: torch.Tensor, b: torch.Tensor) -> tuple[float, torch.Tensor]:
    """max |a - b| in ULPs of each output row's largest magnitude (cancellation-proof)."""
    dtype = _compare_dtype(a)
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    scale = a64.abs().amax(-1, keepdim=True).clamp_min(format_of(dtype).smallest_normal)
    spacing = scale * format_of(dtype).eps
    err = ((a64 - b64).abs() / spacing)
    err = torch.where(torch.isnan(a64) != torch.isnan(b64), torch.full_like(err, math.inf), err)
    err = torch.nan_to_num(err, nan=0.0)
    return float(err.max()) if err.numel() else 0.0, err


def attention_key_permutation_equivariant(attention: Callable, q, k, v, *, causal: bool = False,
                                          perm: torch.Tensor | None = None, budget: float = 4.0) -> PropertyResult:
    """Permuting keys together with values leaves the output unchanged (non-causal attention).
    Error in ULPs of each output row's largest value, so cancellation does not inflate it."""
    check_callable("attention_key_permutation_equivariant", "attention", attention, q)
    if causal:
        raise ValueError("attention_key_permutation_equivariant: causal attention depends on key order")
    perm = torch.randperm(k.shape[-2], generator=torch.Generator().manual_seed(0)) if perm is None else perm
    out = attention(q, k, v, causal=False)
    out_p = attention(q, k[..., perm, :], v[..., perm, :], causal=False)
    err, _ = _row_scaled_error(out, out_p)
    return _verdict("attention equivariant to key/value permutation", err, budget, "row-ULP")


def attention_output_in_value_range(out: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                                    key_padding_mask: torch.Tensor | None = None, budget: float = 2.0) -> PropertyResult:
    """Each output is a convex combination of the value rows it attends to, so every feature lies
    within their min and max (plus ``budget`` ULPs of the output dtype at that bound)."""
    helper = "attention_output_in_value_range"
    if not (isinstance(out, torch.Tensor) and isinstance(v, torch.Tensor)) or out.dim() != 4 or v.dim() != 4:
        raise TypeError(f"{helper}: `out` (B, H, S_q, D) and `v` (B, H_kv, S_k, D) must be 4-D tensors: pass the "
                        "attention output first, then the values")
    if out.shape[0] != v.shape[0] or out.shape[3] != v.shape[3] or out.shape[1] % v.shape[1]:
        raise ValueError(f"{helper}: `out` {tuple(out.shape)} does not fit `v` {tuple(v.shape)} (batch, heads "
                         "divisible by kv heads, head dim): pass the attention output first, then the values")
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (v.shape[0], v.shape[2]):
        raise ValueError(f"{helper}: key_padding_mask {tuple(key_padding_mask.shape)} must be (B, S_k) = "
                         f"{(v.shape[0], v.shape[2])}")
    b, h, sq, d = out.shape
    sk = v.shape[-2]
    v64 = _expand_kv(v, h).to(torch.float64)
    allowed = torch.ones(b, 1, sq, sk, dtype=torch.bool, device=out.device)
    if causal:
        allowed = allowed & torch.ones(sq, sk, dtype=torch.bool, device=out.device).tril()
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    vv = v64[:, :, None, :, :]  # b h 1 sk d
    al = allowed[..., None]  # b 1 sq sk 1
    hi = torch.where(al, vv, torch.full_like(vv, -math.inf)).amax(-2)
    lo = torch.where(al, vv, torch.full_like(vv, math.inf)).amin(-2)
    o = out.to(torch.float64)
    dtype = _compare_dtype(out)
    over = torch.clamp(o - hi, min=0) + torch.clamp(lo - o, min=0)
    bound = torch.maximum(hi.abs(), lo.abs()).clamp_min(format_of(dtype).smallest_normal)
    err = over / (bound * format_of(dtype).eps)
    has_keys = allowed.any(-1)[..., None].expand_as(o)
    err = torch.where(has_keys & torch.isnan(o), torch.full_like(err, math.inf), torch.nan_to_num(err, nan=0.0))
    err = torch.where(has_keys, err, torch.zeros_like(err))
    worst = float(err.max()) if err.numel() else 0.0
    return _verdict("attention output inside the value range", worst, budget, "ULP outside")


def attention_causal_ignores_future(attention: Callable, q, k, v, *, split: int | None = None,
                                    budget: float = 0.0) -> PropertyResult:
    """Causal attention: replacing the keys and values at positions >= ``split`` leaves the outputs
    of queries before ``split`` unchanged (top-left aligned causal mask, as torch's is_causal)."""
    check_callable("attention_causal_ignores_future", "attention", attention, q)
    sk = k.shape[-2]
    split = max(1, sk // 2) if split is None else split
    g = torch.Generator().manual_seed(1)
    k2, v2 = k.clone(), v.clone()
    k2[..., split:, :] = seeded_normal(g, *k2[..., split:, :].shape, scale=3.0, dtype=k.dtype)
    v2[..., split:, :] = seeded_normal(g, *v2[..., split:, :].shape, scale=3.0, dtype=v.dtype)
    a = attention(q, k, v, causal=True)[..., :split, :]
    b = attention(q, k2, v2, causal=True)[..., :split, :]
    err, e = _row_scaled_error(a, b)
    detail = ""
    if err > budget:
        rows = torch.nonzero((e > budget).any(-1))[:, -1].unique().tolist()
        detail = f"query rows changed by future keys: {rows[:8]} (split {split})"
    return _verdict("causal attention ignores future keys", err, budget, "row-ULP", detail)
