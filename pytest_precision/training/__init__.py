"""Training steps under precision configs: the ``train_step`` contract (``spec``), learnable
synthetic data (``data``), the training configs (``configs``), pure-bf16 stochastic rounding and
fp8 Linear emulation (``recipes``), fp8 Linears on ``torch._scaled_mm`` with current or delayed
scaling and what their casts saturate and lose (``fp8``), a spec's own fp8 conversion, its casts observed (``fp8_observed``), the loss scale and backward passes a step used
(``loop_watch``), where each module ran (``module_dtypes``), a run of a few steps (``run``, recording into a ``trajectory`` through a ``recorder``), the float64 step (``float64``), its comparison with
the fp32 run (``compare``), the careful loop a ``step_fn`` is judged against (``peer``), the float16 loss scale's health (``loss_scale``), the floors and
spreads the verdicts use (``limits``), DDP gradient compression on the real engine
(``distributed``), what a training golden holds (``baseline``), what moved in its fp32 reference
(``moved``), its per-parameter rates judged as counts (``rates``), gradient accumulation judged
against the whole batch's float64 gradient (``accumulation``) and activation checkpointing judged
against the same step without it (``checkpointing``), FSDP2 mixed precision (``fsdp``), the success
rate over seeds (``success_rate``), a LightningModule in Lightning's own loop with its Trainer's options (``lightning``), and the Hugging Face Trainer's own step (``hf_trainer``, imported
on its own: it needs transformers)."""
from .compare import (GradientLoss, TrainMetrics, compare_trajectories, mantissa_eps, significant, tensors_sqnr_db,
                      underflow_rates, update_lost_rates)
from .configs import FLOAT64, TRAIN_CONFIGS, TrainConfig
from .data import MarkovText
from .recipes import emulated_fp8_linears, stochastic_round
from .float64 import ExactStep, exact_first_step
from .determinism import check_determinism
from .run import TrainingError, prepare_training, run_training
from .trajectory import Trajectory
from .spec import LossContractError, TrainSpec, compute_loss, standard_step
from .batches import split_batch
from .checkpointing import checkpoint_blocks

__all__ = ["TrainSpec", "TrainConfig", "TRAIN_CONFIGS", "FLOAT64", "Trajectory", "TrainMetrics", "TrainingError",
           "LossContractError", "standard_step", "compute_loss", "run_training", "prepare_training", "check_determinism",
           "exact_first_step", "ExactStep", "compare_trajectories", "tensors_sqnr_db", "underflow_rates",
           "update_lost_rates", "significant", "GradientLoss", "mantissa_eps", "stochastic_round", "emulated_fp8_linears",
           "MarkovText", "split_batch", "checkpoint_blocks"]
