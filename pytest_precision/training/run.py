"""A run of a training step under one training config: a few steps from a seeded model, recording
what the suite judges (losses, the gradients the optimizer applies, updates, loss scales, skipped
steps, the first non-finite value, step times).

The harness watches the optimizer: the gradients it records are the ones ``optimizer.step()``
sees (unscaled, clipped: what is applied), through a step pre-hook, and a step whose
``optimizer.step()`` never ran is a step the GradScaler skipped.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..numerics.configs import tf32_flags
from ..speed.timing import synchronized_perf_counter
from .configs import TrainConfig
from .recipes import fp8_linears, stochastic_rounding_updates
from .spec import TrainSpec, standard_step

__all__ = ["Trajectory", "TrainingError", "run_training", "prepare_training"]


@dataclass
class Trajectory:
    """What a run of ``steps`` steps under one config recorded. Gradients and parameters are fp32
    copies on the CPU; per-step entries are None at a step the scaler skipped."""

    config: str
    losses: list[float]
    grad_norms: list[float | None]
    update_norms: list[float | None]
    scales: list[float | None]  # GradScaler scale after each step (None without a scaler)
    skipped: list[int]  # steps whose optimizer.step() did not run
    first_nonfinite: tuple[int, str] | None  # (step, "loss"/"gradient of <param>") at a step not skipped
    first_step: int | None  # the first step whose optimizer.step() ran
    grads0: dict[str, torch.Tensor]  # the gradients optimizer.step() saw at that step
    initial: dict[str, torch.Tensor]  # parameters before the first step, as stored
    final: dict[str, torch.Tensor]  # parameters after the last step, as stored
    changed: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)  # bool: element ever changed
    grads: dict[int, dict[str, torch.Tensor]] = field(repr=False, default_factory=dict)  # per step (keep_grads)
    step_times: list[float] = field(default_factory=list)  # wall seconds of each step (synchronised)


class TrainingError(Exception):
    """A target's model_fn, optimizer_fn, batch_fn or step raised; the message names which."""


def _cast_batch(batch: Any, dtype: torch.dtype, device: str) -> Any:
    """Floating tensors in ``batch`` to ``dtype`` on ``device``; token ids and masks keep theirs."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device=device, dtype=dtype) if batch.is_floating_point() else batch.to(device)
    if isinstance(batch, dict):
        return {k: _cast_batch(v, dtype, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_cast_batch(v, dtype, device) for v in batch)
    return batch


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(device="cpu", dtype=torch.float32, copy=True) for n, p in model.named_parameters()}


def run_training(spec: TrainSpec, config: TrainConfig, device: str, where: str = "",
                 keep_grads: bool = False) -> Trajectory:
    """Run ``spec.steps`` steps of the spec under ``config``; records the trajectory. With
    ``keep_grads`` (the fp32 reference) the gradients of every step are kept, so a run whose first
    steps the scaler skipped is compared on the same batch."""
    return prepare_training(spec, config, device, where, keep_grads)()


def prepare_training(spec: TrainSpec, config: TrainConfig, device: str, where: str = "",
                     keep_grads: bool = False) -> Callable[[], Trajectory]:
    """Build the seeded model, optimizer and scaler now; the returned call runs the steps. The
    tracer and the audit trace only that call, not the model's construction."""
    where = where or f"train_step under {config.id}"
    if config.ddp_hook is not None:
        raise ValueError(f"{config.id} is a DDP comparison: distributed.compare_ddp_hooks runs it, not run_training")

    def call(what, fn, *a):
        try:
            return fn(*a)
        except torch.OutOfMemoryError as e:
            raise TrainingError(f"{where}: {what} ran out of memory ({e})") from e
        except TrainingError:
            raise
        except Exception as e:
            raise TrainingError(f"{where}: {what} raised {type(e).__name__}: {e}") from e

    torch.manual_seed(spec.seed)
    model = call("model_fn()", spec.model_fn)
    if not isinstance(model, nn.Module):
        raise TrainingError(f"{where}: model_fn() returned {type(model).__name__}, expected an nn.Module")
    model = model.to(device=device, dtype=config.param_dtype)
    model.train()
    names = {p: n for n, p in model.named_parameters()}
    optimizer = call("optimizer_fn(params)", spec.optimizer_fn, model.parameters())
    scaler = torch.amp.GradScaler(device, enabled=config.loss_scaling)
    step_fn = spec.step_fn or standard_step

    seen: dict = {}

    def watch(opt, args, kwargs):  # registered first: sees the grads before the SR hook casts them
        grads = {names[p]: p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None and p in names}
        seen["grads"] = grads
        seen["norm"] = float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.float()) for g in grads.values()]))) if grads else 0.0
        bad = next((n for n, g in grads.items() if not bool(torch.isfinite(g).all())), None)
        seen["bad"] = bad
        if "grads0" not in seen or keep_grads:
            copy = {n: g.detach().to(device="cpu", dtype=torch.float32, copy=True) for n, g in grads.items()}
            seen.setdefault("grads0", copy)
            seen.setdefault("first", seen["step"])
            if keep_grads:
                t.grads[seen["step"]] = copy

    initial = _snapshot(model)
    changed = {n: torch.zeros(p.shape, dtype=torch.bool) for n, p in initial.items()}
    t = Trajectory(config.id, [], [], [], [], [], None, None, {}, initial, {})
    def run() -> Trajectory:
        previous = t.initial
        with contextlib.ExitStack() as stack:
            hook = optimizer.register_step_pre_hook(watch)
            stack.callback(hook.remove)
            if config.stochastic_rounding:
                stack.enter_context(stochastic_rounding_updates(optimizer, spec.seed + 1))
            if config.fp8:
                if stack.enter_context(fp8_linears(model)) == 0:
                    raise TrainingError(f"{where}: the model has no nn.Linear layer for the fp8 emulation to replace")
            if device == "cuda":
                stack.enter_context(tf32_flags(config.tf32))
            autocast = config.autocast(device)
            for i in range(spec.steps):
                batch = _cast_batch(call(f"batch_fn({i})", spec.batch_fn, i), config.param_dtype, device)
                seen.pop("grads", None)
                seen.pop("bad", None)
                seen["step"] = i
                start = synchronized_perf_counter()
                loss = call(f"step {i}", step_fn, model, optimizer, scaler, batch, autocast)
                t.step_times.append(synchronized_perf_counter() - start)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise TrainingError(f"{where}: step {i} returned {type(loss).__name__}; step_fn must return the loss")
                value = float(loss.detach().float())
                t.losses.append(value)
                t.scales.append(float(scaler.get_scale()) if config.loss_scaling else None)
                ran = "grads" in seen
                if not ran:
                    t.skipped.append(i)
                if t.first_nonfinite is None:
                    if not math.isfinite(value):
                        t.first_nonfinite = (i, "loss")
                    elif ran and seen["bad"] is not None:
                        t.first_nonfinite = (i, f"gradient of {seen['bad']}")
                t.grad_norms.append(seen["norm"] if ran else None)
                now = _snapshot(model)
                t.update_norms.append(float(torch.linalg.vector_norm(torch.stack(
                    [torch.linalg.vector_norm(now[n] - previous[n]) for n in now]))) if ran else None)
                for n in now:
                    changed[n] |= now[n] != previous[n]
                previous = now
        t.grads0 = seen.get("grads0", {})
        t.first_step = seen.get("first")
        t.final = previous
        t.changed = changed
        return t

    return run
