"""The gradients a training step applies, as the optimizer sees them.

A ``StepRecorder`` watches one optimizer through its step hooks: the gradients recorded are the ones
``optimizer.step()`` is about to apply (unscaled, clipped), through a step pre-hook registered before
any of the harness's own (the stochastic-rounding recipe's casts them), and through a post-hook for
``step(closure)``, whose backward runs inside the step. A step whose ``optimizer.step()`` never ran
records nothing: the GradScaler skipped it. A fused optimizer that a GradScaler steps without an
``unscale_`` before gets the gradients still scaled, with ``grad_scale`` and ``found_inf`` to apply
itself: the recorder takes grad / grad_scale, and nothing where ``found_inf`` (a skipped step).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from .trajectory import Trajectory

__all__ = ["StepRecorder", "wide_dtype", "wrap_closure"]


def wrap_closure(opt, args: tuple, kwargs: dict, wrap) -> tuple[tuple, dict] | None:
    """A step hook's ``(args, kwargs)`` with the ``step(closure)`` closure replaced by
    ``wrap(closure)``; None where the step has no closure."""
    given = args[1:] if args and args[0] is opt else args  # the hook's args begin with the optimizer
    if given and given[0] is not None:
        head = args[:len(args) - len(given)]
        return (*head, wrap(given[0]), *given[1:]), kwargs
    if kwargs.get("closure") is not None:
        return args, {**kwargs, "closure": wrap(kwargs["closure"])}
    return None


def wide_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a copy of ``t`` is kept in: float64 stays float64, every other floating dtype is float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class StepRecorder:
    """The applied gradients of each step into ``trajectory.grads`` (fp32 CPU copies, per step the
    optimizer ran), and of the current step: whether it ran (``applied``), how many times
    (``calls``), its gradient norm and its first non-finite parameter."""

    def __init__(self, names: dict[nn.Parameter, str], trajectory: Trajectory):
        self.names = names
        self.trajectory = trajectory
        self.step = 0
        self.calls = 0
        self.applied: dict[str, torch.Tensor] | None = None  # this step's gradients; None: no step ran
        self.norm = 0.0
        self.nonfinite: str | None = None  # the first parameter whose applied gradient is not finite
        self.first_grads: dict[str, torch.Tensor] = {}  # those of the first step the optimizer ran
        self.first_step: int | None = None
        self._closure_pending = False
        self._closure_calls = 0

    @contextlib.contextmanager
    def watching(self, optimizer: torch.optim.Optimizer):
        """The hooks on ``optimizer`` while the context is open; enter it before any other step hook."""
        pre = optimizer.register_step_pre_hook(self._before_step)
        post = optimizer.register_step_post_hook(self._after_step)
        try:
            yield self
        finally:
            pre.remove()
            post.remove()

    def start_step(self, step: int) -> None:
        self.step, self.calls, self.applied, self.nonfinite = step, 0, None, None

    def _before_step(self, opt, args, kwargs):
        def counted(closure):
            def evaluate(*a, **k):
                self._closure_calls += 1
                return closure(*a, **k)
            return evaluate
        wrapped = wrap_closure(opt, args, kwargs, counted)
        if wrapped is not None:
            # step(closure): the closure's backward runs inside the step, after this hook (a
            # Lightning loop's last micro-batch, LBFGS's evaluations)
            self._closure_pending, self._closure_calls = True, 0
            return wrapped
        self._record(opt)
        return None

    def _after_step(self, opt, args, kwargs) -> None:
        if self._closure_pending:
            self._closure_pending = False
            if self._closure_calls > 1:  # evaluated again inside the step (LBFGS): its passes are not micro-batches
                self.trajectory.closure = True
            self._record(opt)

    def _record(self, opt) -> None:
        found_inf = getattr(opt, "found_inf", None)
        if isinstance(found_inf, torch.Tensor) and bool(found_inf.any()):
            return
        scale = getattr(opt, "grad_scale", None)
        grads = {self.names[p]: p.grad if scale is None else p.grad / scale.to(p.grad.device)
                 for g in opt.param_groups for p in g["params"] if p.grad is not None and p in self.names}
        self.calls += 1
        self.applied = grads
        self.norm = float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.float()) for g in grads.values()]))) if grads else 0.0
        self.nonfinite = next((n for n, g in grads.items() if not bool(torch.isfinite(g).all())), None)
        copy = {n: g.detach().to(device="cpu", dtype=wide_dtype(g), copy=True) for n, g in grads.items()}
        if self.first_step is None:
            self.first_step, self.first_grads = self.step, copy
        self.trajectory.grads[self.step] = copy
