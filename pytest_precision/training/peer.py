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
from .configs import TRAIN_CONFIGS, TrainConfig
from .limits import db_to_error, error_to_db
from .run import GlobalStateError, TrainingError, run_casting_buffers
from .spec import TrainSpec, single_step
from .trajectory import Trajectory

__all__ = ["LoopPeer", "careful_loop", "run_peer", "fp32_first_step", "peer_budget", "loop_rounding", "PEER_STEPS"]

# the careful loop's run stops once its first step applied: a GradScaler that starts too high skips
# a step or two on a model that overflows; past this many, it has no first step to compare
PEER_STEPS = 3


@dataclass
class LoopPeer:
    """The careful loop's first applied gradient against its fp32 step, per parameter group (relative
    error, the vector norm of the difference over fp32's), and what ran: ``loop`` names it."""

    group_error: dict[str, float] = field(default_factory=dict)
    step: int = 0
    loop: str = "standard_step"

    def sqnr_db(self, group: str) -> float:
        return error_to_db(self.group_error[group])


def careful_loop(spec, accumulate: int):
    """``spec`` with the harness's loop in place of its ``step_fn``, at ``accumulate`` micro-batches,
    at most ``PEER_STEPS`` steps, one seed."""
    return dataclasses.replace(spec, step_fn=None, accumulate=accumulate, seeds=1, steps=min(spec.steps, PEER_STEPS))


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


def run_peer(spec: TrainSpec, config: TrainConfig, device: str, where: str, accumulate: int,
             fp32_step=fp32_first_step) -> LoopPeer | str:
    """The careful loop's first applied step under ``config`` against its fp32 step (``fp32_step``,
    which a session memoises), or why it could not run. A change of torch's state is the target's
    error and raised (GlobalStateError)."""
    careful = careful_loop(spec, accumulate)
    loop = "standard_step" + (f"(accumulate={accumulate})" if accumulate != 1 else "")
    try:
        run = run_casting_buffers(careful, config, device, f"{where}: the careful loop ({loop})")
        if run.first_step is None:
            return f"the careful loop ({loop}) applied no step in {careful.steps}"
        ref = fp32_step(careful, run.first_step, run.rng_states[run.first_step], device,
                        f"{where}: the careful loop ({loop}) in fp32")
    except GlobalStateError:
        raise
    except TrainingError as e:
        text = str(e)
        for said in (f"{where}: the careful loop ({loop}) in fp32: ", f"{where}: the careful loop ({loop}): "):
            text = text[len(said):] if text.startswith(said) else text
        return f"the careful loop ({loop}) could not run: {text}"
    groups = group_labels(ref.groups or [list(ref.initial)])
    errors = {g: db_to_error(tensors_sqnr_db(run.grads0, ref.grads0, names)) for g, names in groups.items()}
    return LoopPeer(errors, run.first_step, loop)
