"""The attention kind's masks, its oracle and peer, and the convention of a fully masked query row.

A query row is fully masked when every key is masked for it: causal attention over a left-padded
batch (the mask every decoder-only model builds for a padded batch) masks all keys of a padded
query position. Its softmax has no defined value (0 / 0), so what a target returns there is a
convention it declares at registration (``fully_masked=``), and the oracle and the peer follow it:

- ``"zero"`` (default): output 0, and the row passes no gradient (dq 0 there, nothing to dk or dv).
  torch 2.13's SDPA does this on the CPU, every backend, fp32, fp16 and bf16 (measured), as
  FlashAttention's kernels do.
- ``"nan"``: output NaN (a softmax over scores that are all -inf); the gradients are what autograd
  gives through it: NaN in the row's dq and in dk and dv of its batch and key/value head.
- ``"mean"``: the mean of v over every key: an additive mask at the dtype's finite minimum makes
  every score of the row equal (Hugging Face's eager attention). Gradients as autograd gives
  through such a mask: dv gets 1/S_k of the row's upstream gradient at every key, and the
  softmax's score gradient (g.v_j - g.out) / S_k flows into dq and dk as for any row.
"""
from __future__ import annotations

import math

import torch

__all__ = ["FULLY_MASKED", "attention_scores", "allowed_keys", "reference_attention", "fully_masked_rows",
           "fully_masked_hint", "fully_masked_returned", "fully_masked_sentence", "expand_kv"]

FULLY_MASKED = {
    "zero": "zeros (torch's SDPA)",
    "nan": "NaN (a softmax over scores that are all -inf)",
    "mean": "the mean of v (an additive mask at the dtype's minimum makes every score equal, as Hugging Face's "
            "eager attention)",
}


def expand_kv(q, t):
    """Grouped-query attention: repeat each key/value head for the query heads that share it."""
    return t if t.shape[1] == q.shape[1] else t.repeat_interleave(q.shape[1] // t.shape[1], dim=1)


def allowed_keys(sq: int, sk: int, causal: bool, key_padding_mask=None, lower_right: bool = False,
                 device="cpu") -> torch.Tensor:
    """(B or 1, 1, S_q, S_k) bool, True where query i may attend key j (causal: top-left aligned,
    or bottom-right with ``lower_right``; ``key_padding_mask`` True where a key is padding)."""
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        allowed = allowed.tril(diagonal=sk - sq if lower_right else 0)
    allowed = allowed[None, None]
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :].to(device)
    return allowed


def fully_masked_rows(sq: int, sk: int, causal: bool, key_padding_mask=None, lower_right: bool = False) -> torch.Tensor:
    """(B or 1, 1, S_q) bool: the query rows whose keys are all masked."""
    return ~allowed_keys(sq, sk, causal, key_padding_mask, lower_right).any(-1)


def _raw_scores(q, k):
    return (q @ expand_kv(q, k).transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))


def attention_scores(q, k, causal: bool = False, key_padding_mask=None, lower_right: bool = False):
    """q k^T / sqrt(D), -inf where a key is masked for a query."""
    s = _raw_scores(q, k)
    return s.masked_fill(~allowed_keys(*s.shape[-2:], causal, key_padding_mask, lower_right, s.device), float("-inf"))


def reference_attention(q, k, v, causal: bool = False, key_padding_mask=None, lower_right: bool = False,
                        fully_masked: str = "zero"):
    """Attention as a careful implementation computes it: the scores in q's dtype (the config's
    arithmetic; float64 for the oracle), the softmax in float32 (float64 for the oracle), as Hugging
    Face's eager attention (``softmax(dtype=float32)``) and torch's SDPA kernels do, its
    probabilities rounded to q's dtype before p @ v, as those do. Fully masked query rows follow
    ``fully_masked`` (module docstring)."""
    s = _raw_scores(q, k)
    allowed = allowed_keys(*s.shape[-2:], causal, key_padding_mask, lower_right, s.device)
    dead = ~allowed.any(-1, keepdim=True)
    masked = s.masked_fill(~allowed, float("-inf"))
    if fully_masked == "zero":
        masked = masked.masked_fill(dead, 0.0)  # a finite row, dropped below: no gradient reaches it
    elif fully_masked == "mean":
        # equal scores whose gradient is the scores' own, as through an additive finite minimum
        masked = torch.where(dead, s - s.detach(), masked)
    p = torch.softmax(masked, -1, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32).to(q.dtype)
    if fully_masked == "zero":
        p = p * ~dead
    return p @ expand_kv(q, v)


def _what(rows: torch.Tensor, mean: torch.Tensor, tolerance: float) -> str:
    """What the target returned in its fully masked rows, in a convention's words where one fits."""
    if bool(rows.isnan().all()):
        return "nan"
    if not bool(rows.isfinite().all()):
        return "non-finite values"
    # the nearer of the two where both are within tolerance (fp8's is wide)
    to_zero, to_mean = float(rows.abs().max()), float((rows - mean).abs().max())
    if min(to_zero, to_mean) <= tolerance:
        return "zero" if to_zero <= to_mean else "mean"
    return f"values that are none of the conventions (largest magnitude {float(rows.abs().max()):.3g})"


def fully_masked_returned(out: torch.Tensor, exact: dict, causal: bool, key_padding_mask, lower_right: bool,
                          tolerance: float) -> tuple[int, str | None]:
    """How many query rows are fully masked, and what the target returned there (a convention's
    name where one fits, else a description; None where there are none)."""
    sq, sk = out.shape[-2], exact["k"].shape[-2]
    dead = fully_masked_rows(sq, sk, causal, key_padding_mask, lower_right).expand(out.shape[:-1])
    if not bool(dead.any()):
        return 0, None
    out = out.detach().to("cpu", torch.float64)
    mean = expand_kv(exact["q"], exact["v"]).mean(-2, keepdim=True).expand(out.shape)
    return int(dead.sum()), _what(out[dead], mean[dead], tolerance)


def fully_masked_sentence(rows: int, returned: str, declared: str) -> str:
    """What the target returned on its fully masked rows, against its declared convention."""
    default = " (the default)" if declared == "zero" else ""
    return (f"{rows} fully masked query rows (every key masked): the target returned {FULLY_MASKED.get(returned, returned)} "
            f"there, where its convention fully_masked={declared!r}{default} expects {FULLY_MASKED[declared]}")


def fully_masked_hint(out: torch.Tensor, exact: dict, causal: bool, key_padding_mask, lower_right: bool,
                      declared: str, tolerance: float) -> str | None:
    """For a failing case with fully masked query rows where the target's output is not its
    declared convention: what it returned there, what was expected, and how to declare another."""
    rows, returned = fully_masked_returned(out, exact, causal, key_padding_mask, lower_right, tolerance)
    if returned is None or returned == declared:
        return None
    others = [f"fully_masked={c!r}" for c in FULLY_MASKED if c != declared]
    advice = (f"if that is the target's convention, declare it at registration (fully_masked={returned!r})"
              if returned in FULLY_MASKED else f"the conventions a target may declare: {', '.join(others)}")
    return f"{fully_masked_sentence(rows, returned, declared)}; {advice}"
