"""What a run of a training step under one config recorded (``run.prepare_training`` fills it;
``compare`` judges two of them): per step the loss, the gradients the optimizer applied, the update,
the loss scale, and the state around them. Built by keyword: every field has its empty value."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..numerics.rng import RngState
from ..numerics.problem import Problem
from .fp8 import Fp8Counts
from .loss_precision import LowPrecisionLoss
from .module_dtypes import module_rows

__all__ = ["Trajectory"]


@dataclass(kw_only=True)
class Trajectory:
    """What a run of ``steps`` steps under one config recorded. Gradients and parameters are fp32
    copies on the CPU; per-step entries are None at a step the scaler skipped."""

    config: str
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float | None] = field(default_factory=list)
    update_norms: list[float | None] = field(default_factory=list)
    scales: list[float | None] = field(default_factory=list)  # GradScaler scale after each step (None without a scaler; 1 in ``unscaled``)
    skipped: list[int] = field(default_factory=list)  # steps whose optimizer.step() did not run
    first_nonfinite: tuple[int, str] | None = None  # (step, "loss"/"gradient of <param>") at a step not skipped
    first_step: int | None = None  # the first step whose optimizer.step() ran
    grads0: dict[str, torch.Tensor] = field(default_factory=dict)  # the gradients optimizer.step() saw at that step
    initial: dict[str, torch.Tensor] = field(default_factory=dict)  # parameters before the first step, as stored
    final: dict[str, torch.Tensor] = field(default_factory=dict)  # parameters after the last step, as stored
    changed: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)  # bool: element ever changed
    grads: dict[int, dict[str, torch.Tensor]] = field(repr=False, default_factory=dict)  # per step the optimizer ran
    step_times: list[float] = field(default_factory=list)  # wall seconds of each step (synchronised)
    groups: list[list[str]] = field(default_factory=list)  # parameter names of each optimizer param group
    scales_used: list[float | None] = field(default_factory=list)  # loss scale each step ran with (None: no scaler)
    backward_passes: list[int] = field(default_factory=list)  # per step: gradient accumulations (micro-batches)
    batch_digests: list[str] = field(default_factory=list)  # sha256 of each step's batch as batch_fn returned it
    rng_states: list["RngState"] = field(repr=False, default_factory=list)  # torch's generators at each step's start
    built_dtypes: dict[str, list[str]] = field(default_factory=dict)  # dtype -> parameters model_fn built not in float32
    unscaled: list[int] = field(default_factory=list)  # steps of a loss-scaling config no GradScaler scaled
    modules: dict = field(repr=False, default_factory=dict)  # name -> module_dtypes.ModuleRun, first step
    module_failures: list[Problem] = field(default_factory=list)  # module_dtypes.module_flags: what fails the case
    module_notes: list[str] = field(default_factory=list)  # and what it reports
    low_precision_loss: LowPrecisionLoss | None = None  # the first step's loss function that returned 16 bits
    # per step: optimizer.step() calls, enabled GradScaler.unscale_ calls, GradScalers that scaled a
    # loss, and the factors clip_grad_norm_ scaled the gradients by (an accumulation loop's verdict)
    optimizer_steps: list[int] = field(default_factory=list)
    unscales: list[int] = field(default_factory=list)
    scalers: list[int] = field(default_factory=list)
    clips: list[list[float]] = field(default_factory=list)
    fp8: Fp8Counts | None = None  # a float8 recipe's saturated and underflowed elements per Linear and role
    # an optimizer.step(closure) evaluated its closure more than once (LBFGS): its backward passes are
    # evaluations, not micro-batches. A step(closure)'s gradients are recorded after the step, where the
    # closure's backward had run (the last evaluation's)
    closure: bool = False
    after_first: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)  # parameters after the first applied step

    @property
    def module_table(self) -> list[list]:
        """Where each module ran in the first step (--precision-audit prints it)."""
        return module_rows(self.modules)
