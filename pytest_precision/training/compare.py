"""A training run against the fp32 run from the same seed: the metrics the training suite judges."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..numerics.formats import format_of
from ..numerics.metrics import sqnr_db
from .run import Trajectory

__all__ = ["TrainMetrics", "compare_trajectories", "tensors_sqnr_db", "underflow_rates", "mantissa_eps"]


def tensors_sqnr_db(out: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """The SQNR of all the named tensors together (metrics.sqnr_db); -inf when ``out`` holds a
    non-finite value, NaN when the two share no name."""
    names = [n for n in ref if n in out]
    if not names:
        return float("nan")
    r = torch.cat([ref[n].flatten().double() for n in names])
    o = torch.cat([out[n].flatten().double() for n in names])
    if not bool(torch.isfinite(o).all()):
        return float("-inf")
    return sqnr_db(float(torch.linalg.vector_norm(r)), float(torch.linalg.vector_norm(o - r)))


def underflow_rates(out: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter of ``ref``: the fraction of its nonzero gradients that are 0 in ``out`` (1.0
    where no gradient reached it in ``out``); parameters whose reference is all zeros are left out."""
    rates = {}
    for n, g_ref in ref.items():
        nonzero = g_ref != 0
        total = int(nonzero.sum())
        if total:
            g = out.get(n)
            rates[n] = 1.0 if g is None else int(((g == 0) & nonzero).sum()) / total
    return rates


@dataclass
class TrainMetrics:
    """One config's run against the fp32 run from the same seed (all plain values)."""

    steps: int
    loss_deviation: list[float | None]  # |loss - fp32 loss| / |fp32 loss| per step
    max_loss_deviation: float
    grad_sqnr_db: float  # gradients at step 0
    param_sqnr_db: float  # final parameters
    underflow_rate: dict[str, float]  # per parameter: grads 0 here, nonzero in fp32, at step 0
    update_lost_rate: dict[str, float]  # per parameter: never changed here, changed in fp32
    update_ratio: float | None  # median over steps of |update| / |fp32 update|
    skipped: list[int]
    scales: list[float | None]
    first_nonfinite: tuple[int, str] | None
    grad_norms: list[float | None]
    fp32_grad_norms: list[float | None]
    losses: list[float]
    fp32_losses: list[float]
    step_time_s: float  # median wall time of a step, the first (warm-up) left out
    fp32_step_time_s: float

    def worst(self, rates: dict[str, float]) -> tuple[str, float]:
        name = max(rates, key=lambda n: (rates[n], n)) if rates else None
        return (name, rates[name]) if name is not None and rates[name] > 0 else ("-", 0.0)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["first_nonfinite"] = list(self.first_nonfinite) if self.first_nonfinite else None
        return d


def compare_trajectories(run: Trajectory, ref: Trajectory) -> TrainMetrics:
    dev = []
    for a, b in zip(run.losses, ref.losses):
        dev.append(abs(a - b) / abs(b) if math.isfinite(a) and b != 0 else (0.0 if a == b else math.inf))
    ref_grads = ref.grads.get(run.first_step, ref.grads0) if run.first_step is not None else {}
    underflow = underflow_rates(run.grads0, ref_grads)
    lost = {}
    for n, moved32 in ref.changed.items():
        total = int(moved32.sum())
        if total:
            lost[n] = int((~run.changed[n] & moved32).sum()) / total
    ratios = [a / b for a, b in zip(run.update_norms, ref.update_norms) if a is not None and b]
    ratio = float(torch.tensor(ratios).median()) if ratios else None
    finite = [d for d in dev if d is not None]
    return TrainMetrics(
        steps=len(run.losses), loss_deviation=dev, max_loss_deviation=max(finite) if finite else 0.0,
        grad_sqnr_db=tensors_sqnr_db(run.grads0, ref_grads), param_sqnr_db=tensors_sqnr_db(run.final, ref.final),
        underflow_rate=underflow, update_lost_rate=lost, update_ratio=ratio, skipped=run.skipped,
        scales=run.scales, first_nonfinite=run.first_nonfinite, grad_norms=run.grad_norms,
        fp32_grad_norms=ref.grad_norms, losses=run.losses, fp32_losses=ref.losses,
        step_time_s=_median_step(run), fp32_step_time_s=_median_step(ref))


def _median_step(t: Trajectory) -> float:
    times = t.step_times[1:] or t.step_times
    return float(torch.tensor(times).median()) if times else math.nan


def mantissa_eps(dtype: torch.dtype) -> float:
    return 2.0 ** -format_of(dtype).mantissa_bits
