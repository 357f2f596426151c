"""The exact step: a spec run in float64 from the same seeded model, the truth the gradient and
update rates, the per-group floors and the drift are judged against.

The model's own float32 is read as float64 there (``numerics.promote.read_as_float64``), so a head
kept in float32 with ``h.float()`` runs exactly; a model whose code needs its buffers in the dtype it
built them in runs with its parameters alone cast (``run.run_casting_buffers``). A step draws its
random numbers from the state the run it judges had at that step's start (``Trajectory.rng_states``).

Why the model's own float32 is read as float64: a mask made in the default dtype, as
``nn.Transformer.generate_square_subsequent_mask`` makes for ``nn.MultiheadAttention``, made the
float64 step wrong before (fp32 measured -5.6 dB from it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..numerics.rng import RngState
from .configs import FLOAT64
from .run import TrainingError, run_casting_buffers
from .spec import TrainSpec, single_step
from .trajectory import Trajectory

__all__ = ["ExactStep", "exact_first_step", "float64_step"]


@dataclass
class ExactStep:
    """The first applied step of a spec in float64: the gradients the optimizer saw and the update
    it made, per parameter (float64, CPU), and the batch it ran on."""

    step: int
    grads: dict[str, torch.Tensor]
    update: dict[str, torch.Tensor]
    initial: dict[str, torch.Tensor]

    @classmethod
    def first_of(cls, run: Trajectory) -> "ExactStep":
        """The first applied step of a float64 run of the whole spec (the step is 0: from the
        initial weights)."""
        return cls(0, run.grads0, {n: run.after_first[n] - run.initial[n] for n in run.initial}, run.initial)


def float64_step(spec: TrainSpec, device: str, where: str, rng_state: RngState | None = None) -> Trajectory:
    """``spec`` run in float64 (``FLOAT64``; ``run.run_casting_buffers``)."""
    return run_casting_buffers(spec, FLOAT64, device, where, rng_state)


def exact_first_step(spec: TrainSpec, step: int, device: str, where: str = "",
                     rng_state: RngState | None = None) -> ExactStep:
    """Step ``step``'s batch run once in float64 from the seeded initial model (a step the scaler
    skipped leaves the model as it was, so the first applied step starts from the initial
    weights), drawing its random numbers from ``rng_state``: the state the run it judges had at
    the start of that step (``Trajectory.rng_states[step]``; default: a first step's). Raises
    TrainingError when the model cannot run in float64."""
    one = single_step(spec, step)
    t = float64_step(one, device, where or f"the float64 step {step}", rng_state)
    if t.first_step is None:
        raise TrainingError(f"{where or 'the float64 step'}: optimizer.step() did not run")
    return ExactStep(step, t.grads0, {n: t.final[n] - t.initial[n] for n in t.initial}, t.initial)
