"""What a correct training step keeps, by format, and how far a correct run's metrics move between
machines: the numbers the training verdicts are drawn from.

**Floors from the format.** Rounding to p mantissa bits costs about 6.02 dB of SQNR per bit
(20 log10 2), so a gradient computed in a format with p bits keeps about 6.02 p dB against the
fp32 one, less what the computation's conditioning costs: a weight gradient is a sum over the
batch of terms of both signs, and when the sum is much smaller than its terms their rounding
errors weigh more. The margins below are measured (torch 2.13, CPU; the built-in GPT, nanoGPT
with bias under AdamW, Adam and SGD, a 2-layer MLP under SGD, Adam and AdamW, a tiny Llama; every
config; AVX512, AVX2 and the default ISA, 1 and 2 threads):

- at the first step the optimizer ran (same weights, same batch), the lowest gradient SQNR was
  8.2 dB below 6.02 p (the MLP under amp-bf16: 33.95 dB against 42.1): margin 12 dB;
- at later steps the two trajectories have diverged and the gradient shrinks as the loss nears
  its minimum while its terms do not: the lowest was 26.1 dB below 6.02 p (the MLP under amp-fp16,
  AdamW, 34.1 dB against 60.2): margin 30 dB, also for the final parameters (lowest 11.8 dB below);
- a gradient norm differs from fp32's by at most the gradient's error (|‖a‖ - ‖b‖| <= ‖a - b‖):
  the band around 1 is the later-step floor's error, and never wider than 1/2 to 2.

Clipping before ``scaler.unscale_`` leaves gradients 1/loss-scale of fp32's: about 0 dB at every
step, far below every floor. fp8's gradients (e5m2, 2 bits) keep 23.6 dB measured; their floors
are 0 and the golden judges them.

**Spread of a correct run.** A golden's budget is ``REGRESSION_SLACK`` x the accepted value plus a
floor that covers how far a correct run's value moves between machines: ``SPREAD`` holds, per
metric, the measured ratio of the largest to the smallest value over the machines above (the
floor is that ratio less one, times the accepted value: a machine judged by another's budget
stays inside it) and an absolute part for values at the noise of the fp32 run itself. Every
relative part is below 1.5, so a metric three times its accepted value fails once that value is
clear of the absolute part.

**The fp32 reference.** One machine repeats its fp32 run to 2.4e-7 relative (losses, gradient
norms per parameter; 1 against 2 threads), machines of other ISAs to 1.7e-6: a run is held to
``SAME_KEY_RTOL`` against the fp32 run recorded for its own numerics key and ``CROSS_KEY_RTOL``
against another key's. A change of the model (an attention scale), the data or the optimizer
moves a parameter's first gradient by far more.
"""
from __future__ import annotations

import math

import torch

from ..numerics.formats import format_of

__all__ = ["DB_PER_BIT", "FIRST_STEP_MARGIN_DB", "LATER_STEP_MARGIN_DB", "DDP_MARGIN_DB", "sqnr_floor_db",
           "first_step_floor_db", "later_step_floor_db", "grad_norm_band", "SPREAD", "spread_floor",
           "SAME_KEY_RTOL", "CROSS_KEY_RTOL", "UNDERFLOW_LIMIT", "UPDATE_LOST_LIMIT", "UPDATE_RATIO_BAND",
           "db_to_error", "error_to_db"]

DB_PER_BIT = 20 * math.log10(2)  # 6.02
FIRST_STEP_MARGIN_DB = 12.0
LATER_STEP_MARGIN_DB = 30.0
# DDP's hooks round each rank's gradient once and all-reduce in 16 bits: one rounding and a sum of
# two, no conditioning of their own (the built-in GPT keeps 70.3 dB under fp16, 52.5 under bf16)
DDP_MARGIN_DB = 6.0

UNDERFLOW_LIMIT = 0.05  # of a parameter's significant gradients lost to 0
UPDATE_LOST_LIMIT = 0.05  # of a parameter's significant first updates never made
UPDATE_RATIO_BAND = (0.5, 2.0)  # median |update| / |fp32 update|

SAME_KEY_RTOL = 1e-5
CROSS_KEY_RTOL = 1e-4

# metric -> (largest / smallest value of a correct run across the machines measured, absolute
# floor). Errors: the loss deviation, 10^(-SQNR/20), |log ratio|, a rate. Measured maxima: loss
# deviation 2.34 (the Llama under bf16-sr, 1.5e-5 on AVX2, 3.4e-5 on the default ISA); gradient
# SQNR at the first step 1.06, at the worst step 1.51, final parameters 1.20; gradient-norm ratio
# 1.88 (fp8); update ratio 1.11; rates 1.34 (the GPT's amp-fp16-noscale underflow, 12 or 16 of
# 12288 elements). The ratio metrics also sit at fp32's noise (|log| of 1e-5 to 5e-4), where a
# ratio of two values means nothing: their absolute floor is twice the largest difference a
# ratio does not cover (4.2e-5 for the gradient-norm ratio, 3.8e-4 for the update). A rate's
# absolute floor is two elements of its parameter (training.baseline). The same machine and
# thread count repeats every metric bit for bit.
SPREAD = {
    "loss_deviation": (2.4, 0.0),
    "grad_sqnr": (1.1, 0.0),
    "worst_grad_sqnr": (1.6, 0.0),
    "param_sqnr": (1.25, 0.0),
    "grad_norm_ratio": (2.0, 1e-4),
    "update_ratio": (1.5, 8e-4),
    "rate": (1.4, 0.0),
}


def db_to_error(db: float) -> float:
    """The relative error 10^(-dB/20) an SQNR stands for (0 for inf)."""
    return 0.0 if db == math.inf else (math.inf if not db > -math.inf else 10 ** (-db / 20))


def error_to_db(error: float) -> float:
    return math.inf if error == 0 else (-math.inf if math.isinf(error) else -20 * math.log10(error))


def spread_floor(metric: str, accepted: float) -> float:
    """The floor of a golden budget on ``metric`` (an error) accepted at ``accepted``."""
    ratio, absolute = SPREAD[metric]
    return accepted if math.isinf(accepted) else (ratio - 1.0) * accepted + absolute


def _bits(precision: torch.dtype | int) -> int:
    return precision if isinstance(precision, int) else format_of(precision).mantissa_bits


def sqnr_floor_db(precision: torch.dtype | int, margin_db: float) -> float:
    """6.02 dB per mantissa bit (of a dtype, or a count: TF32 has 10) less ``margin_db``, never
    below 0."""
    return max(0.0, DB_PER_BIT * _bits(precision) - margin_db)


def first_step_floor_db(precision: torch.dtype | int) -> float:
    return sqnr_floor_db(precision, FIRST_STEP_MARGIN_DB)


def later_step_floor_db(precision: torch.dtype | int) -> float:
    return sqnr_floor_db(precision, LATER_STEP_MARGIN_DB)


def grad_norm_band(precision: torch.dtype | int) -> tuple[float, float]:
    """The gradient-norm ratio a correct step stays within: 1 -/+ the later-step floor's error."""
    eps = min(1.0, db_to_error(later_step_floor_db(precision)))
    return (max(0.5, 1 / (1 + eps)), min(2.0, 1 + eps))
