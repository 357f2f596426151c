"""The train_step kind: the training package's own front to the runner (the registry imports it
through ``suites/training.py``, where the built-in suites list their kinds).

- ``train_step``: :class:`TrainStepKind` and ``TRAIN_STEP``, a ``TrainSpec`` under each training
  config against the fp32 run, the float64 step and the careful loop;
- ``report``: what its cases show (evidence, the summary table); ``faults``: the first op that lost a
  value in a failing step; ``seeds_case``: the success-rate cases (``TrainSpec(seeds=N)``);
- ``distributed_case``: the one-step cases on spawned ranks, written once; ``ddp_case``: DDP's
  compression hooks; ``fsdp_case``: FSDP2 mixed precision.
"""
from .train_step import TRAIN_STEP, TrainStepKind

__all__ = ["TRAIN_STEP", "TrainStepKind"]
