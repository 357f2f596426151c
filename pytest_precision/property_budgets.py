"""The bound ``softmax_rows_sum_to_one`` holds a row sum to: how far from 1 a correct softmax's
rows can sum, from the exact rounding of softmax(logits) where the logits are given, else from each
output's own rounding (``properties``' docstring has what it was measured on)."""
from __future__ import annotations


import torch

from .numerics.budgets import sum_chain
from .numerics.formats import format_of, ulp

__all__ = ["row_sum_budget"]


def _unit_roundoff(dtype: torch.dtype) -> float:
    return format_of(dtype).eps / 2


def _nearest(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 ``t`` rounded to the nearest value of ``dtype`` (ties to even), as float64.

    torch converts float64 to 16 bits through float32, rounding twice (1 + 2^-8 + 2^-30 becomes
    1.0 in bf16, not 1 + 2^-7); here the spacing at |t| is a power of two, so t / spacing is
    exact and one round() is the correct rounding.
    """
    step = ulp(t, dtype)
    return torch.where(torch.isfinite(t), torch.round(t / step) * step, t)


def _finer(a: torch.dtype, b: torch.dtype) -> bool:
    return format_of(a).mantissa_bits > format_of(b).mantissa_bits


def row_sum_budget(probs: torch.Tensor, logits: torch.Tensor | None, dtype: torch.dtype,
                work: torch.dtype) -> tuple[torch.Tensor, str]:
    """Per row, how far from 1 a correct softmax's row sum can be (float64, absolute)."""
    n = probs.shape[-1]
    u_w = _unit_roundoff(work)
    normalizer = (sum_chain(n) + 4) * u_w
    measuring = n * 2.0 ** -53  # the float64 sum taken here
    if logits is not None and _finer(work, dtype):
        # Each output is the working value q_i = p_i (1 + d_i) rounded once to probs' dtype, with
        # p the exact softmax of these logits. d_i: the normalizer's error plus exp's (its argument
        # x - max, or x * log2(e) - max * log2(e) as exp2 kernels take it, rounded in the working
        # dtype). Rounding is monotone, so the row sum lies between the sums of the lowest and the
        # highest values q_i can round to: known exactly, hence tight in every dtype.
        x = logits.to(torch.float64)
        m = x.amax(-1, keepdim=True)
        p = torch.softmax(x, -1)
        spread = (x - m).abs() + x.abs() + m.abs()
        rho = normalizer + (4 + 2 * spread) * u_w
        tiny = 2 * format_of(work).smallest_subnormal  # below the working dtype's normals
        lo = torch.where(p > 0, _nearest((p * (1 - rho) - tiny).clamp_min(0), dtype), torch.zeros_like(p))
        hi = torch.where(p > 0, _nearest(p * (1 + rho) + tiny, dtype), torch.zeros_like(p))
        budget = torch.maximum((lo.sum(-1) - 1).abs(), (hi.sum(-1) - 1).abs())
        return budget + measuring, f"exact rounding of softmax(logits) to {format_of(dtype).name}, computed in " \
                                   f"{format_of(work).name}"
    # Without the logits, each output's final rounding is bounded by half its own ULP (an output
    # that underflowed to 0 or is subnormal: half the subnormal spacing), all in one direction
    # at worst: between a quarter and half an ULP at 1.0, plus the subnormal terms.
    coarse = work if _finer(dtype, work) else dtype
    final = (ulp(probs.to(torch.float64), coarse) / 2).sum(-1)
    return final + normalizer + measuring, f"worst-case rounding to {format_of(coarse).name} (no logits)"
