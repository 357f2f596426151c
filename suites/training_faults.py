"""The first op that lost a value in a failing training step, at whichever step it happened: the
run is replayed to that step with its ops left out of the trace (``platform.launches.as_harness``:
the same steps, state, loss scale and random draws as the run), the step is traced, and so is the
same step in float64 from the parameters the run had there and the random state it drew from
(``explain.faults.first_fault``). The train_step cases name it for a run that went non-finite at
any step, and the seeds cases for each seed that did.
"""
from __future__ import annotations

import dataclasses

from pytest_precision.explain.faults import Fault, first_fault
from pytest_precision.platform.launches import as_harness
from pytest_precision.training import FLOAT64, TrainConfig, TrainSpec, prepare_training
from pytest_precision.numerics.rng import RngState

__all__ = ["step_fault", "traced_step"]


def traced_step(spec: TrainSpec, config: TrainConfig, device: str, step: int = 0, rng: RngState | None = None):
    """A callable that runs ``spec`` under ``config`` up to ``step`` with only that step traced: a
    fresh seeded model and optimizer built now, outside the trace. At step 0, from the random state
    ``rng`` (default: the one every run starts its first step from)."""
    return prepare_training(dataclasses.replace(spec, steps=step + 1), config, device,
                            rng_state=rng if step == 0 else None, quiet_steps=step)


def step_fault(spec: TrainSpec, config: TrainConfig, device: str, step: int = 0, rng: RngState | None = None
               ) -> Fault | None:
    """The first fault of ``spec``'s step ``step`` under ``config`` against the same step in float64
    (the module docstring). Raises what the run raises (TrainingError, GlobalStateError); a float64
    step that cannot run leaves the fault without its reference value."""
    run = traced_step(spec, config, device, step, rng)

    def reference():
        with as_harness():  # its construction is no op of the step's
            if step == 0:
                exact = traced_step(spec, FLOAT64, device, 0, rng)
            else:
                one = dataclasses.replace(spec, steps=1, batch_fn=lambda _i: spec.batch_fn(step))
                exact = prepare_training(one, FLOAT64, device, rng_state=run.trajectory.rng_states[step],
                                         start_params=run.quiet_end_params)
        return exact()

    fault = first_fault(run, reference)
    return dataclasses.replace(fault, step=step) if fault is not None and step else fault
