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

**Rates are counts.** A gradient-underflow or update-lost rate is a count of elements of one
parameter, and the elements it counts sit at an edge: a gradient that a 16-bit sum cancels to 0,
or rounds to 0 at the bottom of fp16's subnormals, is one whose computed value is within a
rounding of 0, and another summation order (another CPU ISA, BLAS kernel or GPU) redraws which of
those land on 0. Measured (torch 2.13, CPU; the built-in GPT, nanoGPT with bias, without, with
dropout 0.1, seeds 0 to 2; the suite's attention model under SGD, Adam and AdamW; a 2-layer MLP;
AVX512, AVX2 with OpenBLAS's Haswell kernel and numpy without AVX512, the default ISA; every
single-process config): 984 ordered pairs of machines where a count was nonzero somewhere; counts
moved 0 -> 2 of 4096 (the GPT's position embedding under pure bf16), 13 -> 21 and 8 -> 23 of
12288 (nanoGPT's attention weight under fp16 without a scaler: gradients of 1e-7 to 9e-7 that
the fp16 backward cancels to 0; the default ISA also draws nanoGPT's ``nn.init.normal_`` weights
one float32 ULP apart). So a count is judged as a count: two machines' counts of a correct run are
two draws of the elements at the edge, each as likely to land on either side, and of the a + b
elements lost on one machine or the other, b alone is a binomial draw of a + b at one half (the
sign test). ``count_bound(a)`` is the largest b whose chance, given a, is at least ``RATE_ALPHA``
(1e-4): 13 elements where none was accepted, 31 where 8 were, 1174 where 1000 were. The pair
least likely under that model (7 -> 23, chance 2.6e-3) is 26 times above it. A golden's rate
budget is ``REGRESSION_SLACK`` x the accepted count plus what ``count_bound`` adds to it (8
accepted: 12 + 23 = 35 elements). The 5 % limits are a rate a correct run stays below, not a
count it gave: a count is past one where a Poisson count of mean 5 % of the parameter's elements
reaches it with a chance below ``RATE_ALPHA`` (``limit_count``: 12288 elements, 614.4 expected:
709; 64 elements, 3.2 expected: 12; 32 elements: 8). A lost loss scale or a learning rate that
rounds every update away moves hundreds to all of a parameter's elements.

**The fp32 reference.** One machine repeats its fp32 run to 2.4e-7 relative (losses, gradient
norms per parameter; 1 against 2 threads), machines of other ISAs to 1.7e-6: a run is held to
``SAME_KEY_RTOL`` against the fp32 run recorded for its own numerics key and ``CROSS_KEY_RTOL``
against another key's. A change of the model (an attention scale), the data or the optimizer
moves a parameter's first gradient by far more.
"""
from __future__ import annotations

import functools
import math

import torch

from ..numerics.formats import format_of
from ..numerics.problem import Problem

__all__ = ["limit_problem", "DB_PER_BIT", "FIRST_STEP_MARGIN_DB", "LATER_STEP_MARGIN_DB", "DDP_MARGIN_DB", "sqnr_floor_db",
           "first_step_floor_db", "later_step_floor_db", "grad_norm_band", "SPREAD", "spread_floor",
           "SAME_KEY_RTOL", "CROSS_KEY_RTOL", "UNDERFLOW_LIMIT", "UPDATE_LOST_LIMIT", "UPDATE_RATIO_BAND",
           "db_to_error", "error_to_db", "RATE_ALPHA", "count_bound", "count_chance", "rate_budget_count",
           "limit_count", "count_text", "percent", "limit_sentence"]

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
# 1.88 (fp8); update ratio 1.11. The ratio metrics also sit at fp32's noise (|log| of 1e-5 to
# 5e-4), where a ratio of two values means nothing: their absolute floor is twice the largest
# difference a ratio does not cover (4.2e-5 for the gradient-norm ratio, 3.8e-4 for the update).
# Rates are counts, budgeted by ``count_bound`` (the module docstring), not by a ratio. The same
# machine and thread count repeats every metric bit for bit.
SPREAD = {
    "loss_deviation": (2.4, 0.0),
    "grad_sqnr": (1.1, 0.0),
    "worst_grad_sqnr": (1.6, 0.0),
    "param_sqnr": (1.25, 0.0),
    "grad_norm_ratio": (2.0, 1e-4),
    "update_ratio": (1.5, 8e-4),
}

RATE_ALPHA = 1e-4  # the least chance of a correct count given the accepted one (module docstring)


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


def grad_norm_band(precision: torch.dtype | int, floor_db: float | None = None) -> tuple[float, float]:
    """The gradient-norm ratio a correct step stays within: 1 -/+ the later-step floor's error, or
    the error of ``floor_db`` (the model's least first-step floor) where that is lower: a norm is
    off by at most the gradient's relative error."""
    least = later_step_floor_db(precision) if floor_db is None else min(floor_db, later_step_floor_db(precision))
    eps = min(1.0, db_to_error(least))
    return (max(0.5, 1 / (1 + eps)), min(2.0, 1 + eps))


def count_chance(accepted: int, count: int) -> float:
    """The chance that of the ``accepted + count`` elements at the edge, ``accepted`` or fewer land
    on the accepted machine's side: P(X <= accepted), X ~ Binomial(accepted + count, 1/2)."""
    total = accepted + count
    if count <= accepted:
        return 1.0
    # the lower tail from its largest term (k = accepted) down: each term is k / (total - k + 1)
    # times the one above, so the sum ends once the terms no longer count
    top = math.lgamma(total + 1) - math.lgamma(accepted + 1) - math.lgamma(count + 1) + total * math.log(0.5)
    term, tail = 1.0, 1.0
    for k in range(accepted, 0, -1):
        term *= k / (total - k + 1)
        tail += term
        if term < 1e-17 * tail:
            break
    return min(1.0, math.exp(top) * tail)


@functools.lru_cache(maxsize=4096)
def count_bound(accepted: int) -> int:
    """The largest count a correct run on another machine gives where one gave ``accepted``: the
    largest b with ``count_chance(accepted, b) >= RATE_ALPHA``."""
    low, high = accepted, accepted + 16
    while count_chance(accepted, high) >= RATE_ALPHA:
        low, high = high, 2 * high
    while high - low > 1:  # count_chance falls as b grows: bisect
        mid = (low + high) // 2
        low, high = (mid, high) if count_chance(accepted, mid) >= RATE_ALPHA else (low, mid)
    return low


def rate_budget_count(accepted: int, slack: float) -> float:
    """A golden's allowed count: ``slack`` x the accepted count plus the elements another
    summation order adds to it (``count_bound``)."""
    return slack * accepted + (count_bound(accepted) - accepted)


def poisson_tail(mean: float, count: int) -> float:
    """P(X >= count) for X ~ Poisson(mean)."""
    if count <= 0:
        return 1.0
    if mean <= 0:
        return 0.0
    # from the term at ``count`` up: past the mean each term is mean / k times the one before
    log_first = -mean + count * math.log(mean) - math.lgamma(count + 1)
    if count <= mean:  # the tail holds at least half: sum the head instead
        head, term = 0.0, 1.0
        for k in range(count - 1, -1, -1):  # terms below count, relative to the one at count
            term *= (k + 1) / mean
            head += term
            if term < 1e-17 * head:
                break
        return max(0.0, 1.0 - math.exp(log_first) * head)
    tail, term, k = 1.0, 1.0, count
    while True:
        k += 1
        term *= mean / k
        tail += term
        if term < 1e-17 * tail:
            break
    return min(1.0, math.exp(log_first) * tail)


@functools.lru_cache(maxsize=4096)
def limit_count(limit: float, elements: int) -> int:
    """How many of a parameter's ``elements`` may be lost before the absolute ``limit`` (a rate) is
    crossed: the largest count a correct run whose rate is ``limit`` gives on some machine, the
    largest b with P(X >= b) >= ``RATE_ALPHA`` for X ~ Poisson(limit x elements)."""
    mean = limit * elements
    b = math.floor(mean + 1e-9)
    while b < elements and poisson_tail(mean, b + 1) >= RATE_ALPHA:
        b += 1
    return min(elements, b)


def count_text(count: int, elements: int) -> str:
    """``"3 of 12288 elements (0.0244 %)"``: the count that decides, and its rate."""
    return f"{count} of {elements} elements ({percent(count / elements if elements else 0.0)})"


def percent(rate: float) -> str:
    """A rate as a percentage with the digits that tell it from its neighbours (3 significant)."""
    return "0 %" if rate == 0 else f"{100 * rate:.3g} %"


def limit_sentence(word: str, rates: dict[str, float], elements: dict[str, int], limit: float) -> str | None:
    """The parameter furthest past the absolute ``limit`` (a rate), counted in its elements: past
    when its count exceeds what another summation order gives around the limit's own count
    (``limit_count``), or None."""
    worst = None
    for name, rate in rates.items():
        total = elements.get(name, 0)
        count = round(rate * total)
        if total and rate > limit and count > limit_count(limit, total):
            if worst is None or rate > worst[0]:
                worst = (rate, name, count, total)
    if worst is None:
        return None
    rate, name, count, total = worst
    return (f"{word} {count_text(count, total)} in {name} > {100 * limit:g} % allowed (up to {limit_count(limit, total)} "
            "elements: the limit and a count's spread between machines)")


def limit_problem(word: str, rates: dict[str, float], elements: dict[str, int], limit: float,
                  category: str) -> Problem | None:
    """``limit_sentence``'s verdict as a problem of ``category``, or None."""
    sentence = limit_sentence(word, rates, elements, limit)
    return Problem("oracle", category, sentence) if sentence else None
