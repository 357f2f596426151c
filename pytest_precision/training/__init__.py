"""Training steps under precision configs: the ``train_step`` contract (``spec``), the training
configs (``configs``), pure-bf16 stochastic rounding and fp8 Linear emulation (``recipes``), a run
of a few steps (``run``), its comparison with the fp32 run (``compare``), DDP gradient compression
on the real engine (``distributed``) and what a training golden holds (``baseline``)."""
from .compare import TrainMetrics, compare_trajectories, mantissa_eps, tensors_sqnr_db, underflow_rates
from .configs import TRAIN_CONFIGS, TrainConfig
from .recipes import fp8_linears, stochastic_round
from .run import TrainingError, Trajectory, prepare_training, run_training
from .spec import TrainSpec, compute_loss, standard_step

__all__ = ["TrainSpec", "TrainConfig", "TRAIN_CONFIGS", "Trajectory", "TrainMetrics", "TrainingError", "standard_step",
           "compute_loss", "run_training", "prepare_training", "compare_trajectories", "tensors_sqnr_db",
           "underflow_rates", "mantissa_eps", "stochastic_round", "fp8_linears"]
