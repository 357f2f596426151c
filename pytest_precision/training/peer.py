"""The careful-loop peer of a step the user wrote: what the harness's own loop (``standard_step``,
with the spec's ``accumulate``, ``checkpoint`` and ``keep_fp32``) keeps of the first step's
gradients on the same model, loss, batch and config, the way the tensor kinds judge a target
against a careful implementation in the same precision.

A training step's gradient error has two sources: the model and its loss in the config's formats,
which the careful loop shares, and the loop around them (where it scales, unscales, clips, casts
and accumulates), which it does not. The format floors (``limits``, ``compare.group_floors``) judge
the first; the peer judges the second. A ``step_fn``'s first applied gradient, per optimizer
parameter group, may differ from its fp32 run's by ``GRAD_PEER_FACTOR`` x the careful loop's error
(its first applied gradient against the same loop's fp32 step, from the same weights, batch and
random state) plus one rounding of the compute format (``2^-(p+1)``: a loop that rounds the gradient
once more, as a cast to the compute format and back does, stays inside it). Measured (torch 2.13,
CPU; a 2-layer MLP under SGD): the careful loop keeps 66.7 dB under amp-fp16, a correct ``step_fn``
accumulating two micro-batches and clipping after ``unscale_`` 67.4 dB; one that casts its gradients
to bfloat16 before the step keeps 51.8 dB, inside float16's floor (48.2 dB, which must hold every
model) and past the peer's budget (54.5 dB).

**Later steps.** The careful loop runs the spec's steps and is compared with its own fp32 run step
by step, as the target is with its fp32 run: how far it has drifted by each step (``drift.Drift``,
the largest distance so far in the loss, the gradient norm, each group's gradient and the final
parameters) is what the model's own dynamics make of one config's rounding. A later step's limit
grows by ``GRAD_PEER_FACTOR`` x that drift where it is more than fp32's own drift from the float64
run allows (``verdicts``), where the careful loop skipped the steps the target skipped (else its
steps are not the target's: a skipped step leaves it an update behind, and the case says so). Measured on Lightning's demo transformer (its loss upcast, 2
micro-batches, clipping, dropout): under amp-fp16 the careful loop keeps 26.9 dB of the first step's
gradients, 12.7 dB by step 1 and -2.0 dB by step 3; Lightning's loop 29.4, 16.4 and 2.0 dB, where
the format's later-step floor asked 30.2 dB.

The peer runs where the target's step is a ``step_fn`` (without one, the target *is* the careful
loop) in a single-process config other than fp32. A step that ran N backward passes with no
``accumulate=`` declared is compared with the careful loop at ``accumulate=N``. Where the careful
loop cannot run (a batch that only the ``step_fn`` knows how to feed the model, say) the case says so
in its details and the format floors judge alone.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..numerics.budgets import GRAD_PEER_FACTOR
from ..numerics.rng import RngState
from .compare import group_labels, tensors_sqnr_db
from .drift import Drift, drift_between
from .configs import TRAIN_CONFIGS, TrainConfig
from .limits import db_to_error, error_to_db
from .run import GlobalStateError, TrainingError, run_casting_buffers
from .spec import TrainSpec, single_step
from .trajectory import Trajectory

__all__ = ["LoopPeer", "careful_loop", "run_peer", "fp32_first_step", "fp32_whole_run", "peer_budget", "loop_rounding"]


@dataclass
class LoopPeer:
    """The careful loop's first applied gradient against its fp32 step, per parameter group (relative
    error, the vector norm of the difference over fp32's), and what ran: ``loop`` names it."""

    group_error: dict[str, float] = field(default_factory=dict)
    step: int = 0
    loop: str = "standard_step"
    drift: Drift | None = None  # its distance from its fp32 run by each step (the module docstring)
    skipped: list[int] = field(default_factory=list)  # the steps its GradScaler skipped

    def sqnr_db(self, group: str) -> float:
        return error_to_db(self.group_error[group])


def careful_loop(spec, accumulate: int):
    """``spec`` with the harness's loop in place of its ``step_fn``, at ``accumulate`` micro-batches,
    one seed."""
    return dataclasses.replace(spec, step_fn=None, accumulate=accumulate, seeds=1)


def loop_rounding(config: TrainConfig) -> float:
    """One rounding of the config's compute format, relative: ``2^-(p+1)``."""
    return 2.0 ** -(config.mantissa_bits + 1)


def peer_budget(peer: LoopPeer, group: str, config: TrainConfig) -> float:
    """The relative gradient error a ``step_fn`` may have in ``group`` at its first step (the module
    docstring); inf where the peer did not measure the group."""
    error = peer.group_error.get(group)
    if error is None or math.isnan(error):
        return math.inf
    return GRAD_PEER_FACTOR * error + loop_rounding(config)


def fp32_first_step(careful: TrainSpec, step: int, rng: RngState, device: str, where: str) -> Trajectory:
    """The careful loop's step ``step`` in fp32 from the initial weights, drawing from ``rng``."""
    one = single_step(careful, step)
    return run_casting_buffers(one, TRAIN_CONFIGS["fp32"], device, where, rng)


def fp32_whole_run(careful: TrainSpec, device: str, where: str) -> Trajectory:
    """The careful loop's whole run in fp32."""
    return run_casting_buffers(careful, TRAIN_CONFIGS["fp32"], device, where)


def run_peer(spec: TrainSpec, config: TrainConfig, device: str, where: str, accumulate: int,
             fp32_step=fp32_first_step, fp32_run=fp32_whole_run) -> LoopPeer | str:
    """The careful loop's run under ``config`` against its fp32 run (``fp32_run``; its first applied
    step against ``fp32_step`` from the same weights where the config skipped steps before it; a
    session memoises both), or why it could not run. A change of torch's state is the target's error
    and raised (GlobalStateError)."""
    careful = careful_loop(spec, accumulate)
    loop = "standard_step" + (f"(accumulate={accumulate})" if accumulate != 1 else "")
    try:
        run = run_casting_buffers(careful, config, device, f"{where}: the careful loop ({loop})")
        if run.first_step is None:
            return f"the careful loop ({loop}) applied no step in {careful.steps}"
        whole = fp32_run(careful, device, f"{where}: the careful loop ({loop}) in fp32")
        # from the initial weights, the whole run's step is the one from the same start
        ref = whole if run.first_step == 0 else fp32_step(
            careful, run.first_step, run.rng_states[run.first_step], device, f"{where}: the careful loop ({loop}) in fp32")
    except GlobalStateError:
        raise
    except TrainingError as e:
        text = str(e)
        for said in (f"{where}: the careful loop ({loop}) in fp32: ", f"{where}: the careful loop ({loop}): "):
            text = text[len(said):] if text.startswith(said) else text
        return f"the careful loop ({loop}) could not run: {text}"
    groups = group_labels(ref.groups or [list(ref.initial)])
    errors = {g: db_to_error(tensors_sqnr_db(run.grads0, ref.grads0, names)) for g, names in groups.items()}
    return LoopPeer(errors, run.first_step, loop, drift_between(run, whole, groups, tensors_sqnr_db, GRAD_PEER_FACTOR),
                    list(run.skipped))
