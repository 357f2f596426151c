"""The ``train_step`` contract: what a user registers (``TrainSpec``) and the standard AMP step.

Contract (kind ``train_step``)::

    spec = pytest_precision.TrainSpec(model_fn, optimizer_fn, batch_fn, steps, step_fn=None, loss_fn=None, seeds=1,
                                      fp8=None)
    pytest_precision.register("my_model", spec, kind="train_step")

``model_fn()`` builds a fresh model (the harness seeds torch before calling it).
``optimizer_fn(params)`` builds the optimizer from the model's parameters; a function whose first
parameter is named ``model`` (or annotated ``nn.Module``) gets the model itself, so a model's own
``configure_optimizers`` needs no shim. ``batch_fn(i)`` returns batch ``i``, the same on every
call (``training.MarkovText`` is one). ``loss_fn(model, batch)`` returns the scalar loss; without
it the loss is ``model(*batch)`` for a tuple or list (a pair given to a Hugging Face model goes in
as its ``labels``: ``compute_loss``), ``model(**batch)`` for a dict, and a result's ``.loss``
(Hugging Face) when it has one. ``step_fn(model, optimizer, scaler, batch, autocast)``
runs one step and returns the loss; ``autocast()`` enters the config's autocast region (wrap
forward and loss in it) and ``scaler`` is a ``torch.amp.GradScaler``, enabled only where the config
scales the loss. ``keep_fp32`` names the modules (fnmatch patterns) the model means in float32
under 16-bit configs: ``training.module_dtypes`` judges that they ran there. Without a ``step_fn`` the standard loop runs (``standard_step``). The DDP cases
run only forward and loss, through ``loss_fn`` (or the default above), never the ``step_fn``.
``accumulate=N``: the step accumulates N micro-batches (``standard_step(..., accumulate=N)``; a
``step_fn`` with an ``accumulate`` parameter is given N), judged by ``training.accumulation``.
``checkpoint``: how activation checkpointing is turned on in a built model, judged by
``training.checkpointing`` against the same step without it.
``fp8=convert``: the repository's own fp8 conversion (torchao's ``convert_to_float8_training``, or
a function that swaps in its own modules), applied to the built float32 model before the optimizer
is built, in place or returning the model; the ``fp8-own`` config runs it, judged like the built-in
recipes (``training.fp8_observed``).
``ships``: the config the repository trains in (``lightning_spec`` reads it from ``precision=``); the
training summary marks its row.
``seeds=N`` (N > 1) adds a success-rate case per config: N runs from seeds ``seed + k``, each with
its own initialisation and data order, judged on their failure rate against fp32's
(``training.success_rate``).
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .batches import split_batch

__all__ = ["TrainSpec", "compute_loss", "hf_labels", "standard_step", "takes_model", "single_step", "LossContractError"]


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
    keep_fp32: tuple[str, ...] = ()  # modules meant in float32 under 16-bit configs (training.module_dtypes)
    # the step accumulates this many micro-batches (``training.accumulation``); what turns on
    # activation checkpointing in a built model (``training.checkpointing``)
    accumulate: int = 1
    checkpoint: bool | str | Callable[[nn.Module], Any] | None = None
    seeds: int = 1  # > 1: each config also runs from this many seeds, its failure rate judged (success_rate.py)
    # the repository's own fp8 conversion, applied to the built model (in place, or returning the model):
    # the fp8-own config runs it and judges its casts (training.fp8_observed)
    fp8: Callable[[nn.Module], Any] | None = None
    ships: str | None = None  # the config the repository trains in (a Trainer's precision): its summary row is marked

    def __post_init__(self):
        keep = (self.keep_fp32,) if isinstance(self.keep_fp32, str) else self.keep_fp32
        if not (isinstance(keep, (tuple, list)) and all(isinstance(k, str) and k for k in keep)):
            raise TypeError(f"TrainSpec.keep_fp32 must be module names or fnmatch patterns (strings), got "
                            f"{self.keep_fp32!r}")
        object.__setattr__(self, "keep_fp32", tuple(keep))
        for name in ("model_fn", "optimizer_fn", "batch_fn"):
            if not callable(getattr(self, name)):
                raise TypeError(f"TrainSpec.{name} must be callable, got {getattr(self, name)!r}")
        for name in ("step_fn", "loss_fn", "fp8"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise TypeError(f"TrainSpec.{name} must be callable or None, got {getattr(self, name)!r}")
        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise ValueError(f"TrainSpec.steps must be a positive int, got {self.steps!r}")
        if not (isinstance(self.accumulate, int) and not isinstance(self.accumulate, bool) and self.accumulate >= 1):
            raise ValueError(f"TrainSpec.accumulate must be a positive int (micro-batches per step), got "
                             f"{self.accumulate!r}")
        own = _accumulate_default(self.step_fn) if self.step_fn is not None else _NO_PARAMETER
        if self.accumulate == 1 and own is not _NO_PARAMETER and own is not inspect.Parameter.empty and own != 1:
            raise ValueError(f"TrainSpec: step_fn accumulates accumulate={own!r} micro-batches by default and the spec "
                             f"declares 1: declare TrainSpec(accumulate={own!r}) so that its accumulated gradient is "
                             "judged (the spec's number is then given to the step_fn)")
        if self.checkpoint is False:  # no checkpointing, as None
            object.__setattr__(self, "checkpoint", None)
        if not (self.checkpoint is None or isinstance(self.checkpoint, (bool, str)) or callable(self.checkpoint)):
            raise TypeError(f"TrainSpec.checkpoint must be True, the name of the model's block list, a callable(model) "
                            f"or None, got {self.checkpoint!r}")
        if self.ships is not None and not isinstance(self.ships, str):
            raise TypeError(f"TrainSpec.ships must be a training config's name or None, got {self.ships!r}")
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
            # told to the step that does it, 1 included (train.py's loop has no default; a default
            # other than the spec's 1 was refused above)
            if _accumulate_default(self.step_fn) is not _NO_PARAMETER:
                return lambda *a: self.step_fn(*a, accumulate=self.accumulate)
            return self.step_fn
        return lambda model, optimizer, scaler, batch, autocast: standard_step(
            model, optimizer, scaler, batch, autocast, loss_fn=self.loss_fn, accumulate=self.accumulate)


def single_step(spec: TrainSpec, step: int, **changes) -> TrainSpec:
    """``spec`` as one step on batch ``step``'s data, from the initial weights (a re-run of that step:
    the float64 step, its careful loop's fp32 step, a traced fault); ``changes`` replace other fields."""
    return dataclasses.replace(spec, steps=1, batch_fn=lambda _i: spec.batch_fn(step), **changes)


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


def _accumulate_default(step_fn: Callable) -> Any:
    """The default of ``step_fn``'s ``accumulate`` parameter (``inspect.Parameter.empty``: it has none),
    or ``_NO_PARAMETER`` where it takes no such parameter."""
    try:
        param = inspect.signature(step_fn).parameters.get("accumulate")
    except (TypeError, ValueError):
        return _NO_PARAMETER
    return _NO_PARAMETER if param is None else param.default


_NO_PARAMETER = object()


def _scalar(loss: Any, what: str) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise LossContractError(f"{what} returned {type(loss).__name__}, expected the scalar loss tensor")
    return loss.reshape(())


def compute_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss of ``batch`` without a ``loss_fn``: ``model(**batch)`` for a dict, ``model(*batch)``
    for a tuple or list, else ``model(batch)``; an output's ``.loss`` is taken when it has one. A pair
    (inputs, targets) given to a model whose forward takes ``labels`` (Hugging Face) goes in as
    ``model(inputs, labels=targets)``: its second positional parameter is ``attention_mask``, not the
    targets (``hf_labels``)."""
    if isinstance(batch, dict):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        labelled = hf_labels(model, batch)
        out = model(*batch) if labelled is None else model(batch[0], **labelled)
    else:
        out = model(batch)
    loss = getattr(out, "loss", out)
    if loss is None and hasattr(out, "loss"):
        raise LossContractError(f"the model returned {type(out).__name__} whose .loss is None: a Hugging Face model "
                                "computes its loss only when given labels; put them in the batch (a dict with "
                                "\"labels\": for a causal LM the input_ids, which it shifts itself) or give the "
                                "TrainSpec a loss_fn(model, batch) that returns the loss")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = (f" of {len(out)} ({', '.join(type(o).__name__ for o in out)})"
                 if isinstance(out, (tuple, list)) else "")
        raise LossContractError(f"the model returned {type(out).__name__}{shape}, not a scalar loss tensor (or an "
                                "output with .loss); give the TrainSpec a loss_fn(model, batch) that returns the loss: "
                                "for a model returning (logits, loss) (nanoGPT): def loss_fn(model, batch): return "
                                "model(*batch)[1]; for a Hugging Face model, pass the targets as labels and take "
                                ".loss: def loss_fn(model, batch): return model(input_ids=batch[0], "
                                "labels=batch[1]).loss (a causal LM shifts labels itself: give it the input_ids, or "
                                "the next tokens as shift_labels)")
    return loss.reshape(())


def hf_labels(model: nn.Module, batch: tuple | list) -> dict | None:
    """The keyword arguments that give a pair (inputs, targets) to a model whose forward takes
    ``labels`` (a Hugging Face model), or None for any other model or batch. A causal LM shifts its
    labels by one itself, so a pair of (tokens, next tokens), as ``MarkovText`` gives, goes in as
    ``shift_labels`` (the targets as they are; transformers 4.50 and later) with ``labels`` beside it;
    a pair whose targets equal the inputs is Hugging Face's own convention and goes in as ``labels``."""
    if len(batch) != 2:
        return None
    # the model itself, not a wrapper whose forward takes *inputs (DDP's, in the DDP cases' ranks)
    model = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    if "labels" not in params:
        return None
    targets = batch[1]
    causal = (getattr(model, "loss_type", None) == "ForCausalLM"
              or type(model).__name__.endswith(("ForCausalLM", "LMHeadModel")))
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if causal and isinstance(targets, torch.Tensor) and getattr(batch[0], "shape", None) == targets.shape:
        if torch.equal(batch[0], targets):  # Hugging Face's own convention: labels are the input_ids
            return {"labels": targets}
        if not takes_kwargs:
            raise LossContractError(f"{type(model).__name__}.forward takes no shift_labels (transformers before 4.50): "
                                    "a pair (tokens, next tokens) given as labels would be shifted once more; give the "
                                    "batch as a dict {\"input_ids\": tokens, \"labels\": tokens} or a loss_fn")
        return {"labels": targets, "shift_labels": targets}
    return {"labels": targets}


def standard_step(model, optimizer, scaler, batch, autocast, loss_fn=None, accumulate: int = 1,
                  max_norm: float | None = None) -> torch.Tensor:
    """The loop from torch's AMP recipe: zero_grad, forward and loss under autocast, scaled
    backward, unscale, step, update. ``loss_fn(model, batch)`` gives the loss (default
    :func:`compute_loss`). ``accumulate=N`` splits the batch into N micro-batches along dim 0 and
    backpropagates each one's loss divided by N before the one unscale and step (returns the whole
    batch's loss); ``max_norm`` clips the gradients' norm after ``unscale_``."""
    optimizer.zero_grad(set_to_none=True)
    total = None
    for micro in (split_batch(batch, accumulate) if accumulate != 1 else [batch]):
        with autocast():
            loss = (compute_loss(model, micro) if loss_fn is None
                    else _scalar(loss_fn(model, micro), "loss_fn(model, batch)"))
            if accumulate != 1:
                loss = loss / accumulate
        scaler.scale(loss).backward()
        total = loss if total is None else total + loss.detach()
    scaler.unscale_(optimizer)
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    return total
