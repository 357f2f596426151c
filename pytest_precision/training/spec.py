"""The ``train_step`` contract: what a user registers (``TrainSpec``) and the standard AMP step.

Contract (kind ``train_step``)::

    spec = pytest_precision.TrainSpec(model_fn, optimizer_fn, batch_fn, steps, step_fn=None, loss_fn=None, seeds=1)
    pytest_precision.register("my_model", spec, kind="train_step")

``model_fn()`` builds a fresh model (the harness seeds torch before calling it).
``optimizer_fn(params)`` builds the optimizer from the model's parameters; a function whose first
parameter is named ``model`` (or annotated ``nn.Module``) gets the model itself, so a model's own
``configure_optimizers`` needs no shim. ``batch_fn(i)`` returns batch ``i``, the same on every
call (``training.MarkovText`` is one). ``loss_fn(model, batch)`` returns the scalar loss; without
it the loss is ``model(*batch)`` for a tuple or list, ``model(**batch)`` for a dict, and a result's
``.loss`` (Hugging Face) when it has one. ``step_fn(model, optimizer, scaler, batch, autocast)``
runs one step and returns the loss; ``autocast()`` enters the config's autocast region (wrap
forward and loss in it) and ``scaler`` is a ``torch.amp.GradScaler``, enabled only where the config
scales the loss. Without a ``step_fn`` the standard loop runs (``standard_step``). The DDP cases
run only forward and loss, through ``loss_fn`` (or the default above), never the ``step_fn``.
``seeds=N`` (N > 1) adds a success-rate case per config: N runs from seeds ``seed + k``, each with
its own initialisation and data order, judged on their failure rate against fp32's
(``training.success_rate``).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["TrainSpec", "compute_loss", "standard_step", "takes_model", "LossContractError"]


class LossContractError(TypeError):
    """The forward did not give a scalar loss; the message says what to give the TrainSpec."""


@dataclass(frozen=True)
class TrainSpec:
    """A user's training step, as the suite runs it (see the module docstring)."""

    model_fn: Callable[[], nn.Module]
    optimizer_fn: Callable[[Any], torch.optim.Optimizer]
    batch_fn: Callable[[int], Any]
    steps: int = 8
    step_fn: Callable | None = None
    seed: int = 0
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None
    seeds: int = 1  # > 1: each config also runs from this many seeds, its failure rate judged (success_rate.py)

    def __post_init__(self):
        for name in ("model_fn", "optimizer_fn", "batch_fn"):
            if not callable(getattr(self, name)):
                raise TypeError(f"TrainSpec.{name} must be callable, got {getattr(self, name)!r}")
        for name in ("step_fn", "loss_fn"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise TypeError(f"TrainSpec.{name} must be callable or None, got {getattr(self, name)!r}")
        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise ValueError(f"TrainSpec.steps must be a positive int, got {self.steps!r}")
        if not (isinstance(self.seeds, int) and not isinstance(self.seeds, bool) and self.seeds >= 1):
            raise ValueError(f"TrainSpec.seeds must be a positive int (1: one run per config), got {self.seeds!r}")

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """``optimizer_fn`` called with the model or with its parameters (the module docstring)."""
        return self.optimizer_fn(model if takes_model(self.optimizer_fn) else model.parameters())

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The loss of ``batch``: ``loss_fn`` when given, else :func:`compute_loss`."""
        if self.loss_fn is None:
            return compute_loss(model, batch)
        return _scalar(self.loss_fn(model, batch), "loss_fn(model, batch)")

    def step(self) -> Callable:
        """The step the harness runs: ``step_fn``, or the standard step with this spec's loss."""
        if self.step_fn is not None:
            return self.step_fn
        return lambda model, optimizer, scaler, batch, autocast: standard_step(
            model, optimizer, scaler, batch, autocast, loss_fn=self.loss_fn)


def takes_model(optimizer_fn: Callable) -> bool:
    """Whether ``optimizer_fn``'s first parameter is named ``model`` or annotated as a module."""
    try:
        params = list(inspect.signature(optimizer_fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: the documented default
        return False
    if not params:
        return False
    first = params[0]
    annotation = first.annotation
    is_module = isinstance(annotation, type) and issubclass(annotation, nn.Module)
    return first.name == "model" or is_module or annotation in ("nn.Module", "torch.nn.Module")


def _scalar(loss: Any, what: str) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise LossContractError(f"{what} returned {type(loss).__name__}, expected the scalar loss tensor")
    return loss.reshape(())


def compute_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss of ``batch`` without a ``loss_fn``: ``model(*batch)``, ``model(**batch)`` or
    ``model(batch)``; a ``.loss`` attribute (Hugging Face outputs) is taken when present."""
    if isinstance(batch, dict):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    loss = getattr(out, "loss", out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = (f" of {len(out)} ({', '.join(type(o).__name__ for o in out)})"
                 if isinstance(out, (tuple, list)) else "")
        raise LossContractError(f"the model returned {type(out).__name__}{shape}, not a scalar loss tensor (or an output with "
                        ".loss); give the TrainSpec a loss_fn(model, batch) that returns the loss, for a model "
                        "returning (logits, loss): def loss_fn(model, batch): return model(*batch)[1]")
    return loss.reshape(())


def standard_step(model, optimizer, scaler, batch, autocast, loss_fn=None) -> torch.Tensor:
    """The loop from torch's AMP recipe: zero_grad, forward and loss under autocast, scaled
    backward, unscale, step, update. ``loss_fn(model, batch)`` gives the loss (default
    :func:`compute_loss`)."""
    optimizer.zero_grad(set_to_none=True)
    with autocast():
        loss = compute_loss(model, batch) if loss_fn is None else _scalar(loss_fn(model, batch), "loss_fn(model, batch)")
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    return loss
