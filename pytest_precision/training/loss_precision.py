"""The precision a step's loss was computed in: the first loss function (cross-entropy, NLL,
log-softmax, BCE with logits, KL divergence) called from the user's code in a step's first run whose
result is 16-bit.

A loss on 16-bit logits loses what the logits' softmax needs: the log-sum-exp of a wide vocabulary
in 8 or 11 bits. Careful code computes it in float32 (``logits.float()``, as Hugging Face's loss
does); autocast does so for ``cross_entropy`` on its own, but not for a loss computed outside the
autocast region on the 16-bit logits it returned, nor under pure bf16 or fp16 weights, and on the
CPU not for ``log_softmax``. The verdicts then read as SQNR and loss deviation; this names the
cause beside them (``verdicts.judge_run``). The result's dtype is what is judged: autocast's own
upcast shows in it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..platform.user_code import user_frame

__all__ = ["LowPrecisionLoss", "LossPrecisionWatch"]

_LOSS_FUNCTIONS = {F.cross_entropy: "cross_entropy", F.nll_loss: "nll_loss", F.log_softmax: "log_softmax",
                   torch.log_softmax: "log_softmax", torch.Tensor.log_softmax: "log_softmax",
                   F.binary_cross_entropy_with_logits: "binary_cross_entropy_with_logits", F.kl_div: "kl_div"}
_16_BIT = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class LowPrecisionLoss:
    op: str  # the loss function, as the user's code called it
    dtype: str  # the 16-bit dtype it returned
    where: str  # "model.py:42": the user's line

    def clause(self) -> str:
        """What a failing verdict adds: the cause and the fix."""
        return (f"; the loss's {self.op} computed in {self.dtype} at {self.where}, on {self.dtype} logits: compute it "
                "on logits.float() (float32), as careful training code does")


class LossPrecisionWatch(TorchFunctionMode):
    """While entered: ``found``, the first loss function whose result was 16-bit, or None."""

    def __init__(self):
        super().__init__()
        self.found: LowPrecisionLoss | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.found is None and func in _LOSS_FUNCTIONS and isinstance(out, torch.Tensor) and out.dtype in _16_BIT:
            self.found = LowPrecisionLoss(_LOSS_FUNCTIONS[func], _16_BIT[out.dtype], user_frame())
        return out
