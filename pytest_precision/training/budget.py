"""The budgets of a training golden, typed: what a run accepted and the limits derived from it.

Two cases: a run of several steps against the fp32 run (:class:`TrajectoryAccepted`,
:class:`TrajectoryBudget`) and one distributed step's gradients against their reference
(:class:`DistributedAccepted`, :class:`DistributedBudget`: a DDP compression hook against
uncompressed DDP, an FSDP2 policy against single-process fp32). The rules are the training
golden's (``training.baseline``'s docstring): each error budget ``REGRESSION_SLACK`` x the accepted
error plus the floor of a correct run's spread between machines (``limits.spread_floor``), each
per-parameter rate a count (``rates``).

Each type reads and writes the JSON a golden stores under ``budget`` and ``accepted``: its keys
are the fields, in their order, so a golden written before these types reads and rewrites byte
for byte. Nothing else reads those keys but ``baselines.schema``, which names the limits a golden
may hold as infinite and sits below this layer. A budget judges through ``violations``, which
returns :class:`~pytest_precision.numerics.problem.Problem` s of the ``golden`` check.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..numerics.budgets import REGRESSION_SLACK
from ..numerics.problem import Problem
from .compare import TrainMetrics
from .limits import db_to_error, error_to_db, spread_floor
from .rates import Counted, rates_budget, rates_describe, rates_problem, with_count_slack

__all__ = ["TrajectoryAccepted", "TrajectoryBudget", "DistributedAccepted", "DistributedBudget"]


def _error_budget(metric: str, accepted: float) -> float:
    return REGRESSION_SLACK * accepted + spread_floor(metric, accepted)


def _sqnr_budget(metric: str, accepted_db: float) -> float:
    """The least SQNR allowed, from the accepted one (budgeted as an error)."""
    return error_to_db(_error_budget(metric, db_to_error(accepted_db)))


def _log(ratio: float | None) -> float:
    """A ratio to fp32's as the error it stands for, |log|; a ratio not measured (None) is none."""
    if ratio is None:
        return 0.0
    return abs(math.log(ratio)) if ratio > 0 and math.isfinite(ratio) else math.inf


def _counted(stored: dict) -> Counted:
    return {n: (rate, elements) for n, (rate, elements) in stored.items()}


def _counted_json(rates: Counted) -> dict[str, list]:
    return {n: [rate, elements] for n, (rate, elements) in rates.items()}


def _per_name(limits: list[dict[str, float]], pick) -> dict[str, float]:
    """A per-parameter limit at ``pick`` across budgets (a parameter some lack: the others')."""
    names = dict.fromkeys(n for limit in limits for n in limit)
    return {n: pick(limit[n] for limit in limits if n in limit) for n in names}


def _golden(category: str, sentence: str) -> Problem:
    return Problem("golden", category, sentence)


@dataclass(frozen=True)
class TrajectoryAccepted:
    """What a training run of several steps gave against the fp32 run, as its golden accepts it."""

    max_loss_deviation: float  # relative, the largest over the steps
    grad_sqnr_db: dict[str, float]  # per parameter group, at the first step the optimizer ran
    worst_grad_sqnr_db: float  # the lowest per-group gradient SQNR over the steps
    param_sqnr_db: float  # the final parameters'
    grad_norm_ratio: float | None  # the gradient norm over fp32's, furthest from 1 over the steps
    update_ratio: float | None  # the update over fp32's (median over the steps)
    underflow_rate: Counted  # gradients 0 here that are significant in the exact first step
    update_lost_rate: Counted  # exact first updates fp32 keeps that never moved here
    skipped_steps: int  # by the GradScaler
    first_nonfinite_step: int | None

    @classmethod
    def from_metrics(cls, m: TrainMetrics) -> TrajectoryAccepted:
        return cls(max_loss_deviation=m.max_loss_deviation, grad_sqnr_db=dict(m.group_grad_sqnr_db),
                   worst_grad_sqnr_db=m.worst_grad_sqnr_db, param_sqnr_db=m.param_sqnr_db,
                   grad_norm_ratio=m.worst_grad_norm_ratio, update_ratio=m.update_ratio,
                   underflow_rate={n: (r, m.underflow_elements.get(n, 0)) for n, r in m.underflow_rate.items()},
                   update_lost_rate={n: (r, m.update_elements.get(n, 0)) for n, r in m.update_lost_rate.items()},
                   skipped_steps=len(m.skipped),
                   first_nonfinite_step=m.first_nonfinite[0] if m.first_nonfinite else None)

    def to_json(self) -> dict:
        return {"max_loss_deviation": self.max_loss_deviation, "grad_sqnr_db": dict(self.grad_sqnr_db),
                "worst_grad_sqnr_db": self.worst_grad_sqnr_db, "param_sqnr_db": self.param_sqnr_db,
                "grad_norm_ratio": self.grad_norm_ratio, "update_ratio": self.update_ratio,
                "underflow_rate": _counted_json(self.underflow_rate),
                "update_lost_rate": _counted_json(self.update_lost_rate),
                "skipped_steps": self.skipped_steps, "first_nonfinite_step": self.first_nonfinite_step}

    @classmethod
    def from_json(cls, d: dict) -> TrajectoryAccepted:
        """Raises KeyError, TypeError or ValueError on a record that is not one (a hand edit)."""
        return cls(max_loss_deviation=d["max_loss_deviation"], grad_sqnr_db=dict(d["grad_sqnr_db"]),
                   worst_grad_sqnr_db=d["worst_grad_sqnr_db"], param_sqnr_db=d["param_sqnr_db"],
                   grad_norm_ratio=d["grad_norm_ratio"], update_ratio=d["update_ratio"],
                   underflow_rate=_counted(d["underflow_rate"]), update_lost_rate=_counted(d["update_lost_rate"]),
                   skipped_steps=d["skipped_steps"], first_nonfinite_step=d.get("first_nonfinite_step"))


@dataclass(frozen=True)
class TrajectoryBudget:
    """The limits a training run of several steps is held to. SQNRs are lower limits in dB, the
    ratios upper limits on |log| of the ratio, the rates per parameter (``rates``)."""

    max_loss_deviation: float
    min_grad_sqnr_db: dict[str, float]  # per parameter group, at the first step
    min_worst_grad_sqnr_db: float
    min_param_sqnr_db: float
    max_grad_norm_log_ratio: float
    max_update_log_ratio: float
    max_underflow_rate: dict[str, float]
    max_update_lost_rate: dict[str, float]
    skipped_steps: int  # the most steps the GradScaler may skip
    first_nonfinite_step: int | None  # the earliest non-finite step allowed; None: none

    @classmethod
    def from_accepted(cls, acc: TrajectoryAccepted) -> TrajectoryBudget:
        return cls(max_loss_deviation=_error_budget("loss_deviation", acc.max_loss_deviation),
                   min_grad_sqnr_db={g: _sqnr_budget("grad_sqnr", v) for g, v in acc.grad_sqnr_db.items()},
                   min_worst_grad_sqnr_db=_sqnr_budget("worst_grad_sqnr", acc.worst_grad_sqnr_db),
                   min_param_sqnr_db=_sqnr_budget("param_sqnr", acc.param_sqnr_db),
                   max_grad_norm_log_ratio=_error_budget("grad_norm_ratio", _log(acc.grad_norm_ratio)),
                   max_update_log_ratio=_error_budget("update_ratio", _log(acc.update_ratio)),
                   max_underflow_rate=rates_budget(acc.underflow_rate),
                   max_update_lost_rate=rates_budget(acc.update_lost_rate),
                   skipped_steps=acc.skipped_steps + 1, first_nonfinite_step=acc.first_nonfinite_step)

    def to_json(self) -> dict:
        return {"max_loss_deviation": self.max_loss_deviation, "min_grad_sqnr_db": dict(self.min_grad_sqnr_db),
                "min_worst_grad_sqnr_db": self.min_worst_grad_sqnr_db, "min_param_sqnr_db": self.min_param_sqnr_db,
                "max_grad_norm_log_ratio": self.max_grad_norm_log_ratio,
                "max_update_log_ratio": self.max_update_log_ratio,
                "max_underflow_rate": dict(self.max_underflow_rate),
                "max_update_lost_rate": dict(self.max_update_lost_rate),
                "skipped_steps": self.skipped_steps, "first_nonfinite_step": self.first_nonfinite_step}

    @classmethod
    def from_json(cls, d: dict) -> TrajectoryBudget:
        """Raises KeyError, TypeError or ValueError on a record that is not one (a hand edit)."""
        return cls(max_loss_deviation=d["max_loss_deviation"], min_grad_sqnr_db=dict(d["min_grad_sqnr_db"]),
                   min_worst_grad_sqnr_db=d["min_worst_grad_sqnr_db"], min_param_sqnr_db=d["min_param_sqnr_db"],
                   max_grad_norm_log_ratio=d["max_grad_norm_log_ratio"], max_update_log_ratio=d["max_update_log_ratio"],
                   max_underflow_rate=dict(d["max_underflow_rate"]), max_update_lost_rate=dict(d["max_update_lost_rate"]),
                   skipped_steps=d["skipped_steps"], first_nonfinite_step=d.get("first_nonfinite_step"))

    @staticmethod
    def earlier_format(d: dict) -> str | None:
        """What a stored budget lacks when it is of a format before the per-group SQNRs, or None."""
        return None if "min_grad_sqnr_db" in d else "no min_grad_sqnr_db per parameter group"

    def with_count_slack(self, acc: TrajectoryAccepted) -> TrajectoryBudget:
        """Each rate limit at least what the accepted counts give today (a golden accepted under
        the earlier two-element floor gets the count slack when judged)."""
        return replace(self, max_underflow_rate=with_count_slack(self.max_underflow_rate, acc.underflow_rate),
                       max_update_lost_rate=with_count_slack(self.max_update_lost_rate, acc.update_lost_rate))

    @classmethod
    def widest(cls, budgets: list[TrajectoryBudget]) -> TrajectoryBudget:
        """Each limit at its loosest across ``budgets`` (a machine judged by the budgets of its
        device type); the earliest non-finite step any allows."""
        firsts = [b.first_nonfinite_step for b in budgets if b.first_nonfinite_step is not None]
        return cls(max_loss_deviation=max(b.max_loss_deviation for b in budgets),
                   min_grad_sqnr_db=_per_name([b.min_grad_sqnr_db for b in budgets], min),
                   min_worst_grad_sqnr_db=min(b.min_worst_grad_sqnr_db for b in budgets),
                   min_param_sqnr_db=min(b.min_param_sqnr_db for b in budgets),
                   max_grad_norm_log_ratio=max(b.max_grad_norm_log_ratio for b in budgets),
                   max_update_log_ratio=max(b.max_update_log_ratio for b in budgets),
                   max_underflow_rate=_per_name([b.max_underflow_rate for b in budgets], max),
                   max_update_lost_rate=_per_name([b.max_update_lost_rate for b in budgets], max),
                   skipped_steps=max(b.skipped_steps for b in budgets),
                   first_nonfinite_step=min(firsts) if firsts else None)

    def violations(self, acc: TrajectoryAccepted) -> list[Problem]:
        """Each way ``acc`` is past this budget; empty when within it. A NaN worst-step or
        final-parameter SQNR (nothing measured) is not judged: the non-finite step is."""
        out = []
        if not acc.max_loss_deviation <= self.max_loss_deviation:
            out.append(_golden("accuracy", f"max loss deviation from fp32 {acc.max_loss_deviation:.3g} > budget "
                                           f"{self.max_loss_deviation:.3g}"))
        floors, low = self.min_grad_sqnr_db, []
        for group, db in sorted(acc.grad_sqnr_db.items()):
            floor = floors.get(group, max(floors.values(), default=-math.inf))  # a new group: the tightest floor
            if not db >= floor:
                low.append(f"{db:.4g} dB in {group} at the first step < budget {floor:.4g} dB")
        if not acc.worst_grad_sqnr_db >= self.min_worst_grad_sqnr_db and not math.isnan(acc.worst_grad_sqnr_db):
            low.append(f"{acc.worst_grad_sqnr_db:.4g} dB at the worst step < budget {self.min_worst_grad_sqnr_db:.4g} dB")
        if low:
            out.append(_golden("accuracy", "gradient SQNR " + ", ".join(low)))
        if not acc.param_sqnr_db >= self.min_param_sqnr_db and not math.isnan(acc.param_sqnr_db):
            out.append(_golden("accuracy", f"final-parameter SQNR {acc.param_sqnr_db:.4g} dB < budget "
                                           f"{self.min_param_sqnr_db:.4g} dB"))
        for ratio, limit, word in ((acc.grad_norm_ratio, self.max_grad_norm_log_ratio, "gradient-norm ratio"),
                                   (acc.update_ratio, self.max_update_log_ratio, "update ratio")):
            if not _log(ratio) <= limit:
                out.append(_golden("accuracy", f"{word} {ratio:.4g} x fp32's, outside the budget "
                                               f"{math.exp(-limit):.6g} to {math.exp(limit):.6g}"))
        for rates, limits, word, category in (
                (acc.underflow_rate, self.max_underflow_rate, "gradient-underflow rate", "underflow"),
                (acc.update_lost_rate, self.max_update_lost_rate, "update-lost rate", "accuracy")):
            problem = rates_problem(word, rates, limits, category)
            if problem:
                out.append(problem)
        if acc.skipped_steps > self.skipped_steps:
            out.append(_golden("overflow", f"{acc.skipped_steps} steps skipped by the GradScaler > budget "
                                           f"{self.skipped_steps}"))
        first, allowed = acc.first_nonfinite_step, self.first_nonfinite_step
        if first is not None and (allowed is None or first < allowed):
            out.append(_golden("nan", f"non-finite at step {first}, accepted "
                                      f"{'none' if allowed is None else f'from step {allowed}'}"))
        return out

    def describe(self, acc: TrajectoryAccepted) -> str:
        """The budget in a line, for the line that reports a new golden."""
        return (f"max loss deviation {self.max_loss_deviation:.3g}, gradient SQNR >= "
                f"{min(self.min_grad_sqnr_db.values(), default=math.inf):.4g} dB (first step), "
                f"{self.min_worst_grad_sqnr_db:.4g} dB (worst step), parameter SQNR >= {self.min_param_sqnr_db:.4g} dB, "
                f"{rates_describe('gradient underflow', acc.underflow_rate, self.max_underflow_rate)}, "
                f"{rates_describe('update lost', acc.update_lost_rate, self.max_update_lost_rate)}, "
                f"skipped steps {self.skipped_steps}")


@dataclass(frozen=True)
class DistributedAccepted:
    """What one distributed step's gradients gave against their reference, as its golden accepts it."""

    grad_sqnr_db: float  # all gradients together
    underflow_rate: Counted  # gradients 0 here that are significant in the reference
    overflow: int  # non-finite gradient elements

    def to_json(self) -> dict:
        return {"grad_sqnr_db": self.grad_sqnr_db, "underflow_rate": _counted_json(self.underflow_rate),
                "overflow": self.overflow}

    @classmethod
    def from_json(cls, d: dict) -> DistributedAccepted:
        """Raises KeyError, TypeError or ValueError on a record that is not one (a hand edit)."""
        return cls(grad_sqnr_db=d["grad_sqnr_db"], underflow_rate=_counted(d["underflow_rate"]), overflow=d["overflow"])


@dataclass(frozen=True)
class DistributedBudget:
    """The limits one distributed step's gradients are held to."""

    min_grad_sqnr_db: float
    max_underflow_rate: dict[str, float]
    overflow: int  # the most non-finite elements allowed

    @classmethod
    def from_accepted(cls, acc: DistributedAccepted) -> DistributedBudget:
        return cls(min_grad_sqnr_db=_sqnr_budget("grad_sqnr", acc.grad_sqnr_db),
                   max_underflow_rate=rates_budget(acc.underflow_rate), overflow=acc.overflow)

    def to_json(self) -> dict:
        return {"min_grad_sqnr_db": self.min_grad_sqnr_db, "max_underflow_rate": dict(self.max_underflow_rate),
                "overflow": self.overflow}

    @classmethod
    def from_json(cls, d: dict) -> DistributedBudget:
        """Raises KeyError, TypeError or ValueError on a record that is not one (a hand edit)."""
        return cls(min_grad_sqnr_db=d["min_grad_sqnr_db"], max_underflow_rate=dict(d["max_underflow_rate"]),
                   overflow=d["overflow"])

    @staticmethod
    def earlier_format(d: dict) -> str | None:
        """What a stored budget lacks when it is of a format before the per-parameter rates, or None."""
        return None if isinstance(d.get("max_underflow_rate"), dict) else "no max_underflow_rate per parameter"

    def with_count_slack(self, acc: DistributedAccepted) -> DistributedBudget:
        """Each rate limit at least what the accepted counts give today."""
        return replace(self, max_underflow_rate=with_count_slack(self.max_underflow_rate, acc.underflow_rate))

    @classmethod
    def widest(cls, budgets: list[DistributedBudget]) -> DistributedBudget:
        """Each limit at its loosest across ``budgets``."""
        return cls(min_grad_sqnr_db=min(b.min_grad_sqnr_db for b in budgets),
                   max_underflow_rate=_per_name([b.max_underflow_rate for b in budgets], max),
                   overflow=max(b.overflow for b in budgets))

    def violations(self, acc: DistributedAccepted) -> list[Problem]:
        """Each way ``acc`` is past this budget; empty when within it."""
        out = []
        if not acc.grad_sqnr_db >= self.min_grad_sqnr_db:
            out.append(_golden("accuracy", f"gradient SQNR {acc.grad_sqnr_db:.4g} dB < budget "
                                           f"{self.min_grad_sqnr_db:.4g} dB"))
        problem = rates_problem("gradient-underflow rate", acc.underflow_rate, self.max_underflow_rate, "underflow")
        if problem:
            out.append(problem)
        if acc.overflow > self.overflow:
            out.append(_golden("overflow", f"overflow {acc.overflow} > {self.overflow} allowed"))
        return out

    def describe(self, acc: DistributedAccepted) -> str:
        """The budget in a line, for the line that reports a new golden."""
        return (f"SQNR >= {self.min_grad_sqnr_db:.4g} dB, "
                f"{rates_describe('gradient underflow', acc.underflow_rate, self.max_underflow_rate)}, "
                f"overflow <= {self.overflow}")
