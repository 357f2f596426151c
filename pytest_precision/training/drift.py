"""How far the fp32 run itself has left the float64 run of the same spec by each step: what a later
step of another config may differ from fp32 besides its own error.

A config is compared with the fp32 run step by step. At the first step both start from the same
weights and batch, and the difference is the config's own error. Later, each run follows its own
trajectory, and where training amplifies a small difference (a high learning rate, AdamW with a
tiny eps turning the rounding noise of a zero gradient into full-size updates) fp32 itself leaves
the exact trajectory: on a small GPT with Muon-like learning rates (0.02 to 0.5) and residual
scalars, fp32's loss was 1.2e-2 from the float64 run's at step 1 and 2.4e-2 at step 5, and
amp-bf16's was 2.2e-2 from float64's where it was 2.5e-2 from fp32's. fp32 is then no better a
reference than the config, and the distance between the two holds both their drifts.

So each later-step limit grows by ``DRIFT_MULTIPLE`` x the largest distance of fp32 from float64 so
far (a trajectory that has left the exact one does not come back to it): the loss deviation, the
gradient norm's log ratio, each parameter group's gradient error, the final parameters' error. A
well-conditioned run keeps fp32 within 1e-6 of float64 over its steps, so its limits stay as they
are; a loop defect (clipping before ``unscale_``: 1/65536; a lost loss scale) is far past either.
Where the float64 run cannot run, no limit grows.

**A trajectory driven by rounding noise.** Where fp32's own first update is no better than the
config's against the float64 step's (``NOISE_DRIVEN_MARGIN_DB``), every run's later steps follow
its rounding noise, not the model's: AdamW with eps 1e-10 turns the noise of a gradient that is 0
exactly (a residual scalar beside zero-initialised blocks) into steps of the full learning rate, of
random sign. On that GPT fp32's first update was 18.7 dB from float64's and pure bf16's 17.3 dB; on
the built-in GPT 86.6 dB against 19.8. Then the later steps (loss, gradient norm and SQNR, final
parameters) are not judged against fp32, said in the case's details; the first step, the rates
and the golden still judge the run.

That small GPT (``tests/modern_gpt.py``: zero-initialised projections, residual scalars at lr 0.5, a
compute dtype fixed at import, its own loop of 2 micro-batches) is green on its first run in fp32,
amp-bf16, amp-fp16, bf16 and the FSDP2 configs; clipping before ``unscale_`` in its loop still fails
at step 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from .limits import db_to_error

__all__ = ["DRIFT_MULTIPLE", "NOISE_DRIVEN_MARGIN_DB", "Drift", "drift_between", "noise_driven"]

# a config's run and fp32's each drift from the float64 one: their distance is up to the sum of two such drifts
DRIFT_MULTIPLE = 2.0
# fp32 is a reference for a config's later steps where its first update is this much closer to the
# float64 step's than the config's is (10 x in amplitude)
NOISE_DRIVEN_MARGIN_DB = 20.0


def noise_driven(first_update_db: float, fp32_first_update_db: float) -> bool:
    """Whether fp32's first update is no clear reference for the config's (the module docstring)."""
    return fp32_first_update_db < first_update_db + NOISE_DRIVEN_MARGIN_DB


@dataclass
class Drift:
    """A run's distance from its reference run, the largest up to each step (per step index): fp32's
    from the float64 run here, the careful loop's from its fp32 run in ``training.peer``."""

    loss: list[float]  # |loss - reference loss| / |reference loss|
    grad_norm: list[float]  # |log(gradient norm / the reference's)|
    grads: list[dict[str, float]] = field(default_factory=list)  # per group: the gradient error (relative)
    params: float = 0.0  # the final parameters' error against the reference's (relative)
    multiple: float = DRIFT_MULTIPLE  # what a limit grows by per unit of this drift

    def loss_allowance(self, step: int) -> float:
        return self.multiple * self.loss[step] if step < len(self.loss) else 0.0

    def norm_allowance(self, step: int) -> float:
        return self.multiple * self.grad_norm[step] if step < len(self.grad_norm) else 0.0

    def grad_allowance(self, step: int, group: str) -> float:
        return self.multiple * self.grads[step].get(group, 0.0) if step < len(self.grads) else 0.0

    @property
    def params_allowance(self) -> float:
        return self.multiple * self.params


def _log_distance(a: float | None, b: float | None) -> float:
    if a is None or b is None:
        return 0.0
    if a == b:
        return 0.0
    return abs(math.log(a / b)) if a > 0 and b > 0 and math.isfinite(a) and math.isfinite(b) else math.inf


def drift_between(run, ref, groups: dict[str, list[str]],
                  sqnr_db: Callable[[dict, dict, list[str]], float], multiple: float = DRIFT_MULTIPLE) -> Drift:
    """``run``'s distance from its reference ``ref`` (fp32's from the float64 run here, the careful
    loop's from its fp32 run in ``training.peer``; both ``run.Trajectory`` of the same spec, from the
    same start) at each step, as the largest up to it; ``sqnr_db(out, ref, names)`` is the SQNR of
    named tensors (``compare.tensors_sqnr_db``, which builds the metrics from this drift)."""
    def _error(out, against, names) -> float:
        db = sqnr_db(out, against, names)
        return 0.0 if math.isnan(db) else db_to_error(db)

    loss, norm, grads = [], [], []
    top_loss, top_norm, top_grads = 0.0, 0.0, {g: 0.0 for g in groups}
    for i in range(len(run.losses)):
        a, b = run.losses[i], ref.losses[i] if i < len(ref.losses) else math.nan
        top_loss = max(top_loss, abs(a - b) / abs(b) if b and math.isfinite(a) and math.isfinite(b) else 0.0)
        top_norm = max(top_norm, _log_distance(run.grad_norms[i], ref.grad_norms[i] if i < len(ref.grad_norms)
                                               else None))
        ga, gb = run.grads.get(i), ref.grads.get(i)
        if ga is not None and gb is not None:
            for g, names in groups.items():
                top_grads[g] = max(top_grads[g], _error(ga, gb, names))
        loss.append(top_loss)
        norm.append(top_norm)
        grads.append(dict(top_grads))
    return Drift(loss, norm, grads, _error(run.final, ref.final, list(run.final)), multiple)
