"""Activation checkpointing: a checkpointed step must give the gradients the same step gives without
checkpointing, in the same config.

``TrainSpec(checkpoint=...)`` says how checkpointing is turned on in a model ``model_fn`` built:
``True`` wraps each block of the model's block list (the first ``nn.ModuleList`` of same-class
modules holding the most parameters: nanoGPT's ``transformer.h``, a Hugging Face model's
``model.layers``) in ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``; a string names
that list (``"transformer.h"``); a callable ``checkpoint(model)`` turns on the model's own (``lambda m:
m.gradient_checkpointing_enable()``, a repository's own flag or hand-written checkpoint), and may
return the model to use. ``checkpoint_blocks`` is the wrapping helper, for a model_fn of one's own.

Every config runs the spec without checkpointing (what the other verdicts judge). A spec with a
``checkpoint`` also runs its first applied step checkpointed, from the same seed, batch and random
state, and once more without, and compares the gradients ``optimizer.step()`` saw: where the step
without checkpointing repeats itself bit for bit (every config on this CPU), the checkpointed one
must give the same bits; elsewhere (a GPU kernel that sums in another order from run to run) its SQNR
against the step without checkpointing must be within ``REPEAT_MARGIN_DB`` of the SQNR the step
without checkpointing has against its own repeat. While the checkpointed step runs, every module
call records the autocast state it ran under; a call inside the backward (the recompute) under
another state than the module's forward names the cause: a recompute outside the forward's autocast
state (a ``context_fn`` that leaves autocast, a hand-written checkpoint whose backward does not
re-enter it) computes in float32 what the forward computed in 16 bits.

Measured (CPU, torch 2.13): on the built-in GPT and a 2-block model, fp32, amp-bf16, amp-fp16, bf16
and fp8-e4m3 all gave the same bits with and without torch's checkpoint. A hand-written checkpoint
whose backward does not re-enter autocast gives 49.9 dB under amp-bf16 and 68.3 dB under amp-fp16 on
the built-in GPT (bit for bit in fp32, bf16 and fp8-e4m3, which have no autocast state to leave);
torch's checkpoint with a ``context_fn`` that leaves autocast raises its ``CheckpointError`` under
both autocast configs (with ``determinism_check="none"``, a matmul of mixed dtypes).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..numerics.metrics import sqnr_db
from ..numerics.problem import Problem
from .configs import TrainConfig
from .loop_watch import recomputing

__all__ = ["checkpoint_blocks", "find_blocks", "apply_checkpoint", "RecomputeWatch", "CheckpointCheck",
           "judge_checkpoint", "REPEAT_MARGIN_DB"]

# where a step does not repeat itself bit for bit: the checkpointed step's SQNR against the step
# without checkpointing may be this far below the step's SQNR against its own repeat (2 x its error)
REPEAT_MARGIN_DB = 6.0


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's block list: of its ``nn.ModuleList``s whose entries are all of one class, the one
    holding the most parameters; ValueError naming what to pass where there is none."""
    best = None
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) and len({type(b) for b in m}) == 1:
            size = sum(p.numel() for p in m.parameters())
            if best is None or size > best[0]:
                best = (size, name, m)
    if best is None:
        raise ValueError(f"checkpoint: {type(model).__name__} has no nn.ModuleList of blocks to checkpoint; name the "
                         "list (TrainSpec(checkpoint='transformer.h')) or give a callable(model) that turns "
                         "checkpointing on")
    return best[1], best[2]


def _checkpointed_forward(forward: Callable, context_fn: Callable | None, kwargs: dict, *args, **call_kwargs):
    if not torch.is_grad_enabled():  # nothing to save for a backward: run the block as it is
        return forward(*args, **call_kwargs)
    extra = dict(kwargs)
    if context_fn is not None:
        extra["context_fn"] = context_fn
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **extra, **call_kwargs)


def checkpoint_blocks(model: nn.Module, blocks: str | None = None, context_fn: Callable | None = None,
                      **checkpoint_kwargs) -> nn.Module:
    """Wrap each block of ``model``'s block list (``blocks``: its attribute path, default
    ``find_blocks``) in ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, with
    ``context_fn`` and the other keyword arguments passed on; returns ``model``, changed in place."""
    if blocks is None:
        _, found = find_blocks(model)
    else:
        try:
            found = model.get_submodule(blocks)
        except AttributeError as e:
            raise ValueError(f"checkpoint: {type(model).__name__} has no submodule {blocks!r} ({e})") from None
        if not isinstance(found, (nn.ModuleList, nn.Sequential)):
            raise ValueError(f"checkpoint: {blocks!r} is a {type(found).__name__}, not a list of blocks "
                             "(nn.ModuleList or nn.Sequential)")
    for block in found:
        block.forward = functools.partial(_checkpointed_forward, block.forward, context_fn, checkpoint_kwargs)
    return model


def apply_checkpoint(how: Any, model: nn.Module) -> nn.Module:
    """``model`` with checkpointing turned on as ``TrainSpec.checkpoint`` says (the module docstring)."""
    if how is True:
        return checkpoint_blocks(model)
    if isinstance(how, str):
        return checkpoint_blocks(model, how)
    out = how(model)
    return out if isinstance(out, nn.Module) else model


def _state(device: str) -> str:
    if torch.is_autocast_enabled(device):
        return f"autocast {str(torch.get_autocast_dtype(device)).replace('torch.', '')}"
    return "autocast off"


class RecomputeWatch:
    """Per module of a model: the autocast states its calls ran under in the forward and inside a
    backward (a checkpoint's recompute)."""

    def __init__(self, device: str):
        self.device = device
        self.forward: dict[str, set[str]] = {}
        self.recompute: dict[str, set[str]] = {}
        self.handles: list = []

    def attach(self, model: nn.Module) -> nn.Module:
        for name, m in model.named_modules():
            seen = functools.partial(self._seen, name or type(model).__name__)
            self.handles.append(m.register_forward_pre_hook(seen))
        return model

    def _seen(self, name, module, args):
        (self.recompute if recomputing() else self.forward).setdefault(name, set()).add(_state(self.device))

    def mismatch(self) -> tuple[str, str, str] | None:
        """(module, its recompute's state, its forward's) for the first module recomputed under
        another autocast state than its forward ran under, or None."""
        for name, states in self.recompute.items():
            other = states - self.forward.get(name, set())
            if other and name in self.forward:
                return name, sorted(other)[0], ", ".join(sorted(self.forward[name]))
        return None

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


@dataclass
class CheckpointCheck:
    step: int
    sqnr_db: float  # checkpointed against the step without checkpointing
    repeat_db: float  # the step without checkpointing against its own repeat (inf: bit for bit)
    max_abs: float
    worst: str | None  # the parameter whose gradient differs most (relative)
    recomputed: int  # modules called in the recompute
    mismatch: tuple[str, str, str] | None
    problem: Problem | None = None  # category accuracy
    raised: str | None = None  # what the checkpointed step raised

    @property
    def detail(self) -> str:
        same = (f"it raised {self.raised}" if self.raised else "bit for bit" if self.sqnr_db == math.inf
                else f"SQNR {self.sqnr_db:.3g} dB, max abs {self.max_abs:.3g}")
        repeat = "repeats bit for bit" if math.isinf(self.repeat_db) else f"repeats to {self.repeat_db:.3g} dB"
        return (f"checkpointing: the checkpointed step {self.step}'s gradients against the same step without "
                f"checkpointing: {same} (the step without checkpointing {repeat}; {self.recomputed} modules "
                "recomputed in the backward)")


def _grads_at(t, step: int) -> dict[str, torch.Tensor]:
    return t.grads.get(step, {})


def _compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, float, str | None]:
    """SQNR of ``a`` against ``b``, max abs difference, the parameter differing most (relative); a
    gradient ``b`` has and ``a`` lacks (no backward reached it) counts as 0."""
    names = list(b)
    if not names:
        return math.nan, math.nan, None
    a = {n: a[n] if n in a else torch.zeros_like(b[n]) for n in names}
    if all(torch.equal(a[n], b[n]) for n in names):
        return math.inf, 0.0, None
    x = torch.cat([a[n].flatten().double() for n in names])
    y = torch.cat([b[n].flatten().double() for n in names])
    if not bool(torch.isfinite(x).all()):
        return -math.inf, math.inf, None

    def rel(n):
        d = float((a[n].double() - b[n].double()).norm())
        return d / max(float(b[n].double().norm()), 1e-300)
    worst = max(names, key=rel)
    return (sqnr_db(float(y.norm()), float((x - y).norm())), float((x - y).abs().max()), worst)


def judge_checkpoint(spec, config: TrainConfig, run, device: str, where: str = "") -> CheckpointCheck:
    """The checkpointed first applied step of ``spec`` under ``config`` against ``run`` (the run
    without checkpointing) and a repeat of it (the module docstring)."""
    from .run import TrainingError, prepare_training  # run imports spec; spec is below this module

    step = run.first_step if run.first_step is not None else 0
    rng = run.rng_states[0] if run.rng_states else None
    plain = dataclasses.replace(spec, steps=step + 1, checkpoint=None)
    repeat = prepare_training(plain, config, device, f"{where}: the step without checkpointing, repeated", rng)()
    watch = RecomputeWatch(device)
    checked = dataclasses.replace(
        plain, model_fn=lambda: watch.attach(apply_checkpoint(spec.checkpoint, spec.model_fn())))
    failed = None
    try:
        ck = prepare_training(checked, config, device, f"{where}: the checkpointed step", rng)()
    except TrainingError as e:
        # torch refuses some recomputes (a CheckpointError on other dtypes, a matmul of mixed dtypes):
        # where the watch saw the recompute leave the forward's autocast state, that is the verdict
        if watch.mismatch() is None:
            raise
        failed = str(e).partition(" raised ")[2] or str(e)
    finally:
        watch.detach()
    repeat_db, _, _ = _compare(_grads_at(repeat, step), _grads_at(run, step))
    if failed is not None:
        c = CheckpointCheck(step, -math.inf, repeat_db, math.inf, None, len(watch.recompute), watch.mismatch(),
                            raised=failed.splitlines()[0])
        module, recompute, forward = c.mismatch
        c.problem = Problem("oracle", "accuracy", f"the checkpointed step {step} under {config.id} raised "
                            f"{failed.splitlines()[0]}: the recompute of {module} ran with {recompute} where its "
                            f"forward ran under {forward}: {_CAUSE}")
        return c
    db, max_abs, worst = _compare(_grads_at(ck, step), _grads_at(run, step))
    recomputed = sum(1 for _ in watch.recompute)
    c = CheckpointCheck(step, db, repeat_db, max_abs, worst, recomputed, watch.mismatch())
    sentence = _problem(c, config)
    c.problem = Problem("oracle", "accuracy", sentence) if sentence else None
    return c


_CAUSE = ("a recompute outside the forward's autocast state computes in other dtypes than the forward did; recompute "
          "under the forward's autocast state (torch.utils.checkpoint restores it; a context_fn or a hand-written "
          "checkpoint must keep it)")


def _problem(c: CheckpointCheck, config: TrainConfig) -> str | None:
    """The sentence of how the checkpointed step differs, or None."""
    if math.isinf(c.repeat_db):
        if math.isinf(c.sqnr_db) and c.sqnr_db > 0:
            return None
        limit = "bit for bit, as the step without checkpointing repeats itself"
    else:
        if c.sqnr_db >= c.repeat_db - REPEAT_MARGIN_DB:
            return None
        limit = (f">= {c.repeat_db - REPEAT_MARGIN_DB:.3g} dB (the step without checkpointing repeats to "
                 f"{c.repeat_db:.3g} dB, less {REPEAT_MARGIN_DB:g})")
    head = (f"checkpointed step {c.step}'s gradients differ from the same step without checkpointing under "
            f"{config.id}: SQNR {c.sqnr_db:.3g} dB, max abs {c.max_abs:.3g}, most in {c.worst} (expected {limit})")
    if c.mismatch is not None:
        module, recompute, forward = c.mismatch
        return f"{head}: the recompute of {module} ran with {recompute} where its forward ran under {forward}: {_CAUSE}"
    if not c.recomputed:
        return f"{head}: nothing was recomputed in the backward"
    return (f"{head}: the recompute computed other values than the forward (other random draws, other dtypes or "
            "other inputs)")
