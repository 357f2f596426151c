"""The train_step kind (suite ``training``): ``TrainSpec`` targets under every training config.
Its machinery is the training package's (``pytest_precision.training.kind``); its built-in target
is ``tiny_gpt.py``."""
from pytest_precision.training import TRAIN_STEP, TrainStepKind

__all__ = ["TRAIN_STEP", "TrainStepKind"]
