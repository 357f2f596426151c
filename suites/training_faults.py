"""The first op that lost a value in a failing training step, at whichever step it happened: the
run is replayed from its start (the same steps, state, loss scale and random draws) with only that
step traced, from inside the run (the steps before it run outside the tracer, so no thread autograd
uses records them), and so is the same step in float64 from the parameters the run had there and
the random state it drew from (``explain.faults.first_fault``). The float64 step starts with a fresh
optimizer and GradScaler: its forward and backward are the run's, an op inside ``optimizer.step``
is compared with a first step's. The train_step cases name the fault for a run that went
non-finite at any step, and the seeds cases for each seed that did.
"""
from __future__ import annotations

import dataclasses

from pytest_precision.kinds import Fault, OpTracer, RngState, as_harness, first_fault, tracing
from pytest_precision.training import FLOAT64, TrainConfig, TrainSpec, prepare_training
from pytest_precision.kinds.training import single_step

__all__ = ["step_fault", "traced_step"]


def traced_step(spec: TrainSpec, config: TrainConfig, device: str, rng: RngState | None = None):
    """A callable that runs ``spec``'s first step under ``config`` (for a tracer around it): a fresh
    seeded model and optimizer built now, outside the trace, drawing from the random state ``rng``
    (default: the one every run starts its first step from)."""
    return prepare_training(dataclasses.replace(spec, steps=1), config, device, rng_state=rng)


def step_fault(spec: TrainSpec, config: TrainConfig, device: str, step: int = 0, rng: RngState | None = None
               ) -> Fault | None:
    """The first fault of ``spec``'s step ``step`` under ``config`` against the same step in float64
    (the module docstring); at step 0 both draw from ``rng``. Raises what the run raises
    (TrainingError, GlobalStateError); a float64 step that cannot run leaves the fault without its
    reference value."""
    if step == 0:
        fault = first_fault(traced_step(spec, config, device, rng), traced_step(spec, FLOAT64, device, rng))
        return fault
    tracer = OpTracer(keep_outputs=True)
    run = prepare_training(dataclasses.replace(spec, steps=step + 1), config, device,
                           around_step=(step, lambda: tracing(tracer)))
    run()

    def reference():
        with as_harness():  # its construction is no op of the step's
            one = single_step(spec, step)
            exact = prepare_training(one, FLOAT64, device, rng_state=run.trajectory.rng_states[step],
                                     start_params=run.around_step_params)
        return exact()

    fault = first_fault(tracer.records, reference)
    return dataclasses.replace(fault, step=step) if fault is not None else None
