"""Property helpers for users' own Hypothesis tests: each returns a :class:`PropertyResult` with the
measured error, its budget and the core comparison's statistics, and steers Hypothesis toward
the worst case with ``hypothesis.target()`` when called inside a ``@given`` test.

    @given(logits(torch.float16))
    def test_my_softmax(x):
        softmax_rows_sum_to_one(my_softmax(x), x).assert_ok()
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from hypothesis import currently_in_test_context, target

from .kinds.outcome import PrecisionFailure
from .numerics.formats import format_of, ulp_distance
from .numerics.inputs import seeded_normal
from .numerics.metrics import Comparison, compare

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
            c = self.comparison
            lines.append(f"  shape {c.shape}, ULPs in {c.dtype}")
            lines += [f"  {s}" for s in c.statistics_lines()]
            if c.worst:
                lines += ["  worst elements:"] + ["    " + r for r in c.worst_table().splitlines()]
        return "\n".join(lines)

    def assert_ok(self) -> "PropertyResult":
        __tracebackhide__ = True  # the failure is the message, not this frame
        if not self.passed:
            raise PrecisionFailure(self.message())
        return self


Verdict = PropertyResult  # its earlier name


def _verdict(name: str, error: float, budget: float, unit: str, detail: str = "",
             comparison: Comparison | None = None) -> PropertyResult:
    if currently_in_test_context():
        target(min(error, _TARGET_CAP) if not math.isnan(error) else _TARGET_CAP, label=name)
    return PropertyResult(name, bool(error <= budget), error, budget, unit, detail, comparison)


def _compare_dtype(t: torch.Tensor) -> torch.dtype:
    return t.dtype if t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) else torch.float32


def _live_rows(logits: torch.Tensor | None, probs: torch.Tensor) -> torch.Tensor:
    """Rows that are not fully masked (those are NaN by the documented rule)."""
    if logits is None:
        return torch.ones(probs.shape[:-1], dtype=torch.bool, device=probs.device)
    return ~torch.isneginf(logits).all(dim=-1)


# ---- softmax ---------------------------------------------------------------------------------

def softmax_rows_sum_to_one(probs: torch.Tensor, logits: torch.Tensor | None = None, *,
                            ulp_budget: float | None = None) -> PropertyResult:
    """Each row of ``probs`` sums (in float64) to 1 within ``ulp_budget`` ULPs of probs' dtype at 1.0.

    Default budget: half an ULP per element plus one (each rounded probability contributes at
    most half an ULP of itself, which is at most half an ULP of 1). Fully masked rows of
    ``logits`` are skipped (they are NaN by rule).
    """
    live = _live_rows(logits, probs)
    sums = probs.to(torch.float64).sum(-1)[live]
    dtype = _compare_dtype(probs)
    n = probs.shape[-1]
    budget = 1.0 + 0.5 * n if ulp_budget is None else ulp_budget
    err = ulp_distance(sums, torch.ones_like(sums), dtype) if sums.numel() else sums
    worst = float(err.max()) if err.numel() else 0.0
    detail = ""
    if err.numel() and worst > budget:
        i = int(torch.nan_to_num(err, nan=math.inf).argmax())
        detail = f"worst row sums to {float(sums[i])!r} ({n} elements)"
    return _verdict("softmax rows sum to 1", worst, budget, "ULP", detail)


def softmax_shift_invariant(softmax: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, c: float, *,
                            ulp_budget: float = 2.0) -> PropertyResult:
    """``softmax(x + c)`` against ``softmax(x)``. ``c`` must keep ``x + c`` exact in x's dtype (a
    ValueError says so otherwise): then a max-subtracting softmax gives the same bits."""
    shifted = x + c
    finite = torch.isfinite(x)
    if not bool(((shifted.to(torch.float64) - c)[finite] == x.to(torch.float64)[finite]).all()):
        raise ValueError(f"softmax_shift_invariant: x + {c!r} is not exact in {x.dtype}; pick c so it is "
                         "(a small multiple of the largest ULP of x)")
    a, b = softmax(x), softmax(shifted)
    cmp = compare(b, a.to(torch.float64), _compare_dtype(a))
    err = cmp.max_ulp
    return _verdict(f"softmax shift invariance (c={c!r})", err, ulp_budget, "ULP", comparison=cmp)


def softmax_order_preserved(x: torch.Tensor, probs: torch.Tensor) -> PropertyResult:
    """x_i < x_j implies p_i <= p_j in every row; error is the number of violating pairs."""
    xs, order = torch.sort(x.to(torch.float64), dim=-1, stable=True)
    ps = torch.gather(probs.to(torch.float64), -1, order)
    strictly_up = xs[..., 1:] > xs[..., :-1]
    down = ps[..., 1:] < ps[..., :-1]
    bad = strictly_up & (down | torch.isnan(ps[..., 1:]) | torch.isnan(ps[..., :-1]))
    bad &= _live_rows(x, probs)[..., None]
    n = int(bad.sum())
    return _verdict("softmax preserves order", float(n), 0.0, "violating pairs")


def softmax_masked_positions_zero(logits: torch.Tensor, probs: torch.Tensor) -> PropertyResult:
    """Positions whose logit is -inf get probability exactly 0 (rows not fully masked)."""
    masked = torch.isneginf(logits) & _live_rows(logits, probs)[..., None]
    bad = masked & (probs != 0)
    n = int(bad.sum())
    detail = f"first at {tuple(torch.nonzero(bad)[0].tolist())}: {float(probs[bad][0])!r}" if n else ""
    return _verdict("softmax masked positions are 0", float(n), 0.0, "nonzero masked positions", detail)


def softmax_in_unit_interval(probs: torch.Tensor, logits: torch.Tensor | None = None) -> PropertyResult:
    """Every probability is in [0, 1] and not NaN (fully masked rows of ``logits`` skipped)."""
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
    spacing = scale * 2.0 ** -format_of(dtype).mantissa_bits
    err = ((a64 - b64).abs() / spacing)
    err = torch.where(torch.isnan(a64) != torch.isnan(b64), torch.full_like(err, math.inf), err)
    err = torch.nan_to_num(err, nan=0.0)
    return float(err.max()) if err.numel() else 0.0, err


def attention_key_permutation_equivariant(attention: Callable, q, k, v, *, causal: bool = False,
                                          perm: torch.Tensor | None = None, budget: float = 4.0) -> PropertyResult:
    """Permuting keys together with values leaves the output unchanged (non-causal attention).
    Error in ULPs of each output row's largest value, so cancellation does not inflate it."""
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
    err = over / (bound * 2.0 ** -format_of(dtype).mantissa_bits)
    has_keys = allowed.any(-1)[..., None].expand_as(o)
    err = torch.where(has_keys & torch.isnan(o), torch.full_like(err, math.inf), torch.nan_to_num(err, nan=0.0))
    err = torch.where(has_keys, err, torch.zeros_like(err))
    worst = float(err.max()) if err.numel() else 0.0
    return _verdict("attention output inside the value range", worst, budget, "ULP outside")


def attention_causal_ignores_future(attention: Callable, q, k, v, *, split: int | None = None,
                                    budget: float = 0.0) -> PropertyResult:
    """Causal attention: replacing the keys and values at positions >= ``split`` leaves the outputs
    of queries before ``split`` unchanged (top-left aligned causal mask, as torch's is_causal)."""
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
