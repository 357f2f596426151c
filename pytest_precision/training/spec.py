"""The ``train_step`` contract: what a user registers (``TrainSpec``) and the standard AMP step.

Contract (kind ``train_step``)::

    spec = pytest_precision.TrainSpec(model_fn, optimizer_fn, batch_fn, steps, step_fn=None)
    pytest_precision.register("my_model", spec, kind="train_step")

``model_fn()`` and ``optimizer_fn(params)`` build fresh objects (the harness seeds torch before
``model_fn``); ``batch_fn(i)`` returns batch ``i`` deterministically. ``step_fn(model, optimizer,
scaler, batch, autocast)`` runs one step and returns the loss; ``autocast()`` enters the config's
autocast region (wrap forward and loss in it) and ``scaler`` is a ``torch.amp.GradScaler``, enabled
only where the config scales the loss. Without a ``step_fn`` the standard loop runs
(``standard_step``). The loss of a batch is ``model(*batch)`` for a tuple or list and
``model(**batch)`` for a dict; a result with a ``.loss`` (Hugging Face models) gives that.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["TrainSpec", "compute_loss", "standard_step"]


@dataclass(frozen=True)
class TrainSpec:
    """A user's training step, as the suite runs it (see the module docstring)."""

    model_fn: Callable[[], nn.Module]
    optimizer_fn: Callable[[Any], torch.optim.Optimizer]
    batch_fn: Callable[[int], Any]
    steps: int = 8
    step_fn: Callable | None = None
    seed: int = 0

    def __post_init__(self):
        for name in ("model_fn", "optimizer_fn", "batch_fn"):
            if not callable(getattr(self, name)):
                raise TypeError(f"TrainSpec.{name} must be callable, got {getattr(self, name)!r}")
        if self.step_fn is not None and not callable(self.step_fn):
            raise TypeError(f"TrainSpec.step_fn must be callable or None, got {self.step_fn!r}")
        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise ValueError(f"TrainSpec.steps must be a positive int, got {self.steps!r}")


def compute_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss of ``batch``: ``model(*batch)``, ``model(**batch)`` or ``model(batch)``; a
    ``.loss`` attribute (Hugging Face outputs) is taken when present."""
    if isinstance(batch, dict):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    loss = getattr(out, "loss", out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"the model returned {type(out).__name__}; the standard step needs a scalar loss tensor "
                        "(or an output with .loss); give the TrainSpec a step_fn otherwise")
    return loss.reshape(())


def standard_step(model, optimizer, scaler, batch, autocast) -> torch.Tensor:
    """The loop from torch's AMP recipe: zero_grad, forward and loss under autocast, scaled
    backward, unscale, step, update."""
    optimizer.zero_grad(set_to_none=True)
    with autocast():
        loss = compute_loss(model, batch)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    return loss
