"""Training steps under precision configs:

- ``spec``: the ``train_step`` contract (``TrainSpec``) and the standard AMP step;
- ``data``: learnable synthetic data (``MarkovText``);
- ``configs``: the training configs;
- ``recipes``: pure-bf16 stochastic rounding and fp8 Linear emulation;
- ``fp8``: fp8 Linears on ``torch._scaled_mm`` with current or delayed scaling, and what their casts
  saturate and lose;
- ``fp8_observed``: a spec's own fp8 conversion, its casts observed;
- ``loop_watch``: the loss scale and backward passes a step used;
- ``module_dtypes``: where each module ran;
- ``loss_precision``: whether the loss was computed in 16 bits;
- ``run``: a run of a few steps; ``recorder``: the gradients its optimizer applied;
  ``trajectory``: what it recorded;
- ``determinism``: the spec repeating itself;
- ``float64``: the float64 run and first step;
- ``compare``: a run against the fp32 run and the float64 step;
- ``drift``: fp32's own drift from the float64 run, which later steps may add;
- ``peer``: the careful loop a ``step_fn`` is judged against;
- ``verdicts``: the absolute verdicts of a config's run;
- ``loss_scale``: the float16 loss scale's health;
- ``limits``: the floors and spreads the verdicts use;
- ``rates``: per-parameter rates judged as counts;
- ``distributed``: DDP gradient compression on the real engine, and the spawned ranks;
- ``fsdp``: FSDP2 mixed precision;
- ``baseline``: what a training golden holds; ``budget``: its typed budgets;
- ``moved``: what moved in its fp32 reference;
- ``success_rate``: the success rate over seeds and its test;
- ``batches``: a batch split into micro-batches;
- ``accumulation``: gradient accumulation, judged against the whole batch's float64 gradient;
- ``checkpointing``: activation checkpointing, judged against the same step without it;
- ``hf_trainer``: the Hugging Face Trainer's own step (imported on its own: it needs transformers);
- ``lightning``: a LightningModule in Lightning's own loop, with its Trainer's options."""
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
