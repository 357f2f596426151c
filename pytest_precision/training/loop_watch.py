"""What the harness watches inside a step besides ``optimizer.step()``: the loss scale a GradScaler
applied, whichever scaler it was, and how many backward passes reached the parameters.

A step may ignore the scaler the harness hands it and use one of its own (a training loop's
``GradScaler(init_scale=..., growth_interval=...)``); the loss scale the step ran with is then that
scaler's, and the harness's own says nothing. So every ``torch.amp.GradScaler.scale`` call (the
CUDA and CPU scalers share it) is seen during a run, and the last enabled one of a step gives the
scale it ran with. Backward passes are counted on each parameter's gradient accumulation: autograd
sums a graph's contributions to a leaf before accumulating once, so a step that accumulates N
micro-batches accumulates N times, with or without a ``zero_grad`` between them. The enabled
``GradScaler.unscale_`` calls and ``torch.nn.utils.clip_grad_norm_`` calls (the coefficient it
scaled the gradients by) are recorded too: an accumulation loop's verdict names them.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

__all__ = ["LoopWatch", "watch_loop", "recomputing"]


class LoopWatch:
    """One step's observations (``start_step`` clears them)."""

    def __init__(self):
        self.scaler: torch.amp.GradScaler | None = None  # the last enabled scaler whose scale() ran
        self.scale: float | None = None  # the scale it applied
        self._accumulated: dict[int, int] = {}
        self.unscales = 0  # enabled GradScaler.unscale_ calls in this step
        self.scalers: set[int] = set()  # ids of the enabled GradScalers that scaled a loss in this step
        self.clips: list[float] = []  # per clip_grad_norm_ call: the factor it multiplied the gradients by

    def start_step(self) -> None:
        self.scaler, self.scale = None, None
        self._accumulated.clear()
        self.unscales, self.scalers, self.clips = 0, set(), []

    @property
    def backward_passes(self) -> int:
        """The most times one parameter's gradient was accumulated in this step."""
        return max(self._accumulated.values(), default=0)

    def scale_after(self) -> float | None:
        """The step's scaler's scale now (after its update), or None when none scaled a loss."""
        return float(self.scaler.get_scale()) if self.scaler is not None else None


@contextlib.contextmanager
def watch_loop(model: nn.Module) -> Iterator[LoopWatch]:
    """Inside the block: every enabled ``GradScaler.scale`` call and every gradient accumulation of
    ``model``'s parameters is recorded in the yielded ``LoopWatch``."""
    watch = LoopWatch()
    original = torch.amp.GradScaler.scale
    original_unscale = torch.amp.GradScaler.unscale_
    # clip_grad_norm_ scales through the module-level _clip_grads_with_norm_ (torch 2.6 and later), which
    # also sees a clip_grad_norm_ imported by name before the run; else the public names are patched
    clip_module = torch.nn.utils.clip_grad
    inner = hasattr(clip_module, "_clip_grads_with_norm_")
    clip_name = "_clip_grads_with_norm_" if inner else "clip_grad_norm_"
    original_clip = getattr(clip_module, clip_name)

    def scale(self, outputs):
        out = original(self, outputs)
        if self.is_enabled():  # a disabled scaler returns the loss as it is: no scale was applied
            watch.scaler, watch.scale = self, float(self.get_scale())
            watch.scalers.add(id(self))
        return out

    def unscale_(self, optimizer):
        if self.is_enabled():
            watch.unscales += 1
        return original_unscale(self, optimizer)

    def clip(parameters, max_norm, *args, **kwargs):
        out = original_clip(parameters, max_norm, *args, **kwargs)
        total = args[0] if inner else out  # _clip_grads_with_norm_(parameters, max_norm, total_norm, foreach)
        # the factor clip_grad_norm_ applies (torch: max_norm / (total + 1e-6), clamped to 1)
        watch.clips.append(min(1.0, float(max_norm) / (float(total) + 1e-6)))
        return out

    def accumulated(p):
        watch._accumulated[id(p)] = watch._accumulated.get(id(p), 0) + 1

    handles = [p.register_post_accumulate_grad_hook(accumulated) for p in model.parameters() if p.requires_grad]
    torch.amp.GradScaler.scale, torch.amp.GradScaler.unscale_ = scale, unscale_
    setattr(clip_module, clip_name, clip)
    if not inner:  # torch.nn.utils.clip_grad_norm_ is the same function as clip_grad.clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = clip
    try:
        yield watch
    finally:
        torch.amp.GradScaler.scale, torch.amp.GradScaler.unscale_ = original, original_unscale
        setattr(clip_module, clip_name, original_clip)
        if not inner:
            torch.nn.utils.clip_grad_norm_ = original_clip
        for h in handles:
            h.remove()


def recomputing() -> bool:
    """Whether a module's forward running now is a recompute: autograd's engine is running a backward
    in this thread (an activation checkpoint, reentrant or not, recomputes there)."""
    return torch._C._current_graph_task_id() != -1
