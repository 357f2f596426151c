"""The argument checks of the property helpers: a call that looks swapped (the logits where the
softmax output goes, inputs where the function goes) or passes log-probabilities for
probabilities raises a ValueError or TypeError naming the helper and the argument, before any
property is measured."""
from __future__ import annotations

import torch

__all__ = ["check_probs", "check_callable"]


def _looks_like_probs(t: torch.Tensor) -> bool:
    """Every row in [0, 1] summing to 1 within 0.1 (fp8's rounding stays inside that); rows that
    are all NaN are left out, since a fully masked row's softmax is NaN."""
    if not t.is_floating_point() or t.numel() == 0 or t.dim() == 0:
        return False
    t64 = t.detach().to(torch.float64).reshape(-1, t.shape[-1])
    t64 = t64[~torch.isnan(t64).all(-1)]
    if t64.numel() == 0 or torch.isnan(t64).any():
        return False
    return bool(((t64 >= 0) & (t64 <= 1)).all() and ((t64.sum(-1) - 1).abs() <= 0.1).all())


def _impossible_probs(t: torch.Tensor) -> tuple[bool, str]:
    """Values no softmax can output at any rounding: negatives (exp and the division keep the
    sign) and infinities. Values just above 1 can come from multiplying by a rounded 1/sum."""
    t64 = t.detach().to(torch.float64)
    bad = (t64 < 0) | torch.isinf(t64) | (t64 > 1.01)
    if not bool(bad.any()):
        return False, ""
    fin = t64[~torch.isnan(t64)]
    return True, f"values outside [0, 1] (min {float(fin.min()):.4g}, max {float(fin.max()):.4g})"


def _looks_like_log_probs(t: torch.Tensor) -> bool:
    """A log_softmax output: every value <= 0, some below 0, each row's logsumexp 0."""
    if not t.is_floating_point() or t.numel() == 0 or t.shape[-1] < 2:
        return False
    t64 = t.detach().to(torch.float64).reshape(-1, t.shape[-1])
    t64 = t64[~torch.isnan(t64).any(-1)]
    if t64.numel() == 0 or not bool((t64 <= 0).all()) or not bool((t64 < 0).any()):
        return False
    return bool((torch.logsumexp(t64, -1).abs() <= 1e-2).all())


def check_probs(helper: str, probs: torch.Tensor, logits: torch.Tensor | None) -> None:
    """Raise when ``probs`` and ``logits`` look swapped, or when ``probs`` is a log_softmax output.

    A swap is called only when both hold: ``logits`` looks like softmax output *and* ``probs``
    holds values no softmax can produce. A softmax that goes out of range on ordinary logits is
    therefore still reported by the property as a violation, not hidden behind this error.
    """
    if not isinstance(probs, torch.Tensor) or (logits is not None and not isinstance(logits, torch.Tensor)):
        raise TypeError(f"{helper}: `probs` and `logits` must be tensors (the softmax output first, then the "
                        f"logits), got {type(probs).__name__} and {type(logits).__name__}")
    if logits is not None and probs.shape != logits.shape:
        raise ValueError(f"{helper}: `probs` has shape {tuple(probs.shape)} and `logits` {tuple(logits.shape)}: "
                         "pass the softmax output and the logits it was computed from")
    if _looks_like_log_probs(probs):
        raise ValueError(f"{helper}: `probs` looks like log-probabilities (every value <= 0, each row's logsumexp "
                         "is 0): pass the softmax output, not log_softmax's")
    if logits is not None:
        impossible, what = _impossible_probs(probs)
        if impossible and _looks_like_probs(logits):
            raise ValueError(f"{helper}: `probs` has {what} while `logits` looks like softmax output (rows in "
                             "[0, 1] summing to 1): the arguments look swapped; pass the softmax output first, "
                             "then the logits")


def check_callable(helper: str, name: str, fn, first_input) -> None:
    if not callable(fn):
        hint = " (the arguments look swapped)" if callable(first_input) else ""
        raise TypeError(f"{helper}: `{name}` must be the function under test, got a {type(fn).__name__}{hint}: "
                        "pass the function first, then its inputs")
