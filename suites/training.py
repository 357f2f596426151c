"""The training suite: ``train_step`` targets x training configs, each run for the spec's steps and
compared with the fp32 run from the same seed (pytest_precision.training has the contract).

Configs (``training.TRAIN_CONFIGS``; ``--precision-configs`` selects them by their matrix config:
``amp-fp16`` runs both amp-fp16 recipes, ``bf16`` both pure-bf16 ones and the bf16 DDP case):
fp32, tf32 (CUDA), amp-bf16, amp-fp16 with a GradScaler, amp-fp16 without one, pure bf16, pure
bf16 with stochastic rounding, fp8 Linear emulation; and ``ddp-fp16``, ``ddp-bf16``, DDP's
gradient-compression hooks against uncompressed DDP (suites/ddp.py has their verdicts).

A case fails when, against the fp32 run of this session:

- a loss is not finite (the scaler scales only the backward: a non-finite loss is the forward's
  own), or a gradient is not finite at a step the GradScaler did not skip;
- a step's loss deviates by more than the config's ``loss_rtol``;
- the parameter update is far from fp32's (median over steps of |update| / |fp32 update| outside
  [1/2, 2]): gradients clipped before ``scaler.unscale_`` shrink it by about the loss scale;
- in some parameter more than 5 % of the gradients fp32 has are 0 (gradient underflow), or more
  than 5 % of the elements fp32 moved never moved (update lost), except in the configs that exist
  to show that rate (amp-fp16 without a scaler shows underflow, pure bf16 lost updates): those
  report it, and the regression budget holds it where it was accepted;
- and against the golden (trajectory_golden.py): the fp32 trajectory moved, or the loss deviation
  and the rates grew past their accepted budgets.

A failing case with a non-finite value or an underflow re-runs its first step traced, beside the
same step in float64, and names the first op that lost the value (faults.first_fault).
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
from tabulate import tabulate

from pytest_precision.faults import Fault, first_fault
from pytest_precision.golden import Golden, GoldenResult
from pytest_precision.targets import Target, TargetError
from pytest_precision.training import (TRAIN_CONFIGS, TrainConfig, TrainingError, TrainMetrics, TrainSpec,
                                       Trajectory, compare_trajectories, prepare_training, run_training,
                                       standard_step)
from pytest_precision.trajectory_golden import check_trajectory, message_lines, rates_line

NAME = "training"
KINDS = ("train_step",)
REGIME_NAMES = ("trajectory",)
REGIMES: dict = {}  # no input regimes: a run is the spec's own batches
AUDIT_REGIME = "trajectory"
UNDERFLOW_LIMIT = 0.05
UPDATE_LOST_LIMIT = 0.05
UPDATE_RATIO_BAND = (0.5, 2.0)
_FLOAT64 = TrainConfig("float64", "fp32", "float64 reference of the first step (fault localisation)", 0.0,
                       param_dtype=torch.float64)
_CATEGORY_ORDER = ("overflow", "underflow", "nan", "accuracy", "regression", "baseline")


def variants(device: str) -> list[str]:
    return [""]


def configs(session) -> list[TrainConfig]:
    """The training configs whose matrix config (``base``) the run selected, in table order."""
    chosen = {c.id for c in session.configs}
    return [c for c in TRAIN_CONFIGS.values() if c.base in chosen]


def default_targets() -> list[Target]:
    from pytest_precision.suites import tiny_gpt

    return [Target("tiny_gpt", tiny_gpt.SPEC, "train_step", origin="built-in")]


# spec -> {device: the fp32 run}, shared by the spec's configs; weak, so a spec's runs go when its
# conftest does (pytester sessions in one process), and never keyed by id(), which a later spec reuses
_REFERENCES: "weakref.WeakKeyDictionary[TrainSpec, dict[str, Trajectory]]" = weakref.WeakKeyDictionary()


def _spec(target: Target) -> TrainSpec:
    if not isinstance(target.fn, TrainSpec):
        raise TargetError(f"target {target.name!r} (train_step) is a {type(target.fn).__name__}, expected a "
                          "pytest_precision.TrainSpec")
    return target.fn


def _where(target: Target, config: TrainConfig) -> str:
    return f"target {target.name!r} (train_step) under config {config.id}"


def _reference(target: Target, device: str) -> Trajectory:
    spec = _spec(target)
    runs = _REFERENCES.setdefault(spec, {})
    if device not in runs:
        try:
            runs[device] = run_training(spec, TRAIN_CONFIGS["fp32"], device, _where(target, TRAIN_CONFIGS["fp32"]),
                                        keep_grads=True)
        except TrainingError as e:
            raise TargetError(str(e)) from e.__cause__
    return runs[device]


class Verdicts:
    """The verdict of an outcome with ``problems`` (check, category, sentence): shared by the
    trajectory cases here and the DDP cases (suites/ddp.py)."""

    problems: list[tuple[str, str, str]]

    @property
    def passed(self) -> bool:
        return not self.problems

    @property
    def categories(self) -> list[str]:
        cats = {c for _, c, _ in self.problems}
        return [c for c in _CATEGORY_ORDER if c in cats] + sorted(cats - set(_CATEGORY_ORDER))

    @property
    def verdict(self) -> str:
        return "pass" if self.passed else "FAIL " + ",".join(self.categories)

    def headline(self) -> str:
        return self.verdict + (f" ({'; '.join(s for _, _, s in self.problems)})" if self.problems else "")


@dataclass
class TrainingOutcome(Verdicts):
    suite: str
    target: str
    config: str
    regime: str
    train_config: TrainConfig
    metrics: TrainMetrics
    golden: GoldenResult
    problems: list[tuple[str, str, str]] = field(default_factory=list)  # (check, category, sentence)
    details: list[str] = field(default_factory=list)
    fault: Fault | None = None

    def summary(self) -> dict:
        m = self.metrics
        uname, urate = m.worst(m.underflow_rate)
        lname, lrate = m.worst(m.update_lost_rate)
        return {"steps": m.steps, "max_loss_deviation": m.max_loss_deviation, "grad_sqnr_db": m.grad_sqnr_db,
                "param_sqnr_db": m.param_sqnr_db, "max_underflow_rate": urate, "underflow_param": uname,
                "max_update_lost_rate": lrate, "update_lost_param": lname, "update_ratio": m.update_ratio,
                "skipped_steps": list(m.skipped), "first_nonfinite": list(m.first_nonfinite) if m.first_nonfinite else None,
                "step_time_s": m.step_time_s, "fp32_step_time_s": m.fp32_step_time_s}

    def record(self) -> dict:
        return {"suite": self.suite, "target": self.target, "config": self.config, "regime": self.regime,
                "passed": self.passed, "categories": self.categories, "baseline_update": self.golden.updated,
                "borrowed_budget": self.golden.note is not None, "training": self.summary()}

    def report_details(self) -> dict:
        """What the JSON report adds (the whole trajectories; case_details is for output tensors)."""
        m = self.metrics
        return {"headline": self.headline(),
                "training_detail": {"losses": m.losses, "fp32_losses": m.fp32_losses, "loss_deviation": m.loss_deviation,
                                    "grad_norms": m.grad_norms, "fp32_grad_norms": m.fp32_grad_norms, "scales": m.scales,
                                    "underflow_rate": m.underflow_rate, "update_lost_rate": m.update_lost_rate,
                                    "regression_budget": self.golden.budgets.get("trajectory")},
                "golden_note": self.golden.error.splitlines()[0] if self.golden.error else self.golden.note}

    def message(self, nodeid: str, update_command: str) -> str:
        m, c = self.metrics, self.train_config
        lines = [f"{nodeid}: {self.headline()}"]
        if self.fault is not None:
            lines.append(f"  {self.fault.describe(self.config)}")
        lines += ["  " + line for line in self.details]
        lines.append(f"  {c.id}: {c.description}; against the fp32 run from the same seed, {m.steps} steps:")
        rows = []
        for i in range(m.steps):
            scale = m.scales[i] if i < len(m.scales) else None
            rows.append((i, _g(m.losses[i]), _g(m.fp32_losses[i]), _g(m.loss_deviation[i]),
                         _g(m.grad_norms[i]), _g(m.fp32_grad_norms[i]),
                         "-" if scale is None else f"{scale:g}", "skipped" if i in m.skipped else ""))
        table = tabulate(rows, headers=("step", "loss", "fp32 loss", "rel. deviation", "grad norm", "fp32 grad norm",
                                        "loss scale", ""), tablefmt="plain")
        lines += ["    " + row for row in table.splitlines()]
        lines.append(f"    gradients at the first step: SQNR {_g(m.grad_sqnr_db)} dB; final parameters: SQNR "
                     f"{_g(m.param_sqnr_db)} dB; update / fp32 update (median over steps) {_g(m.update_ratio)}")
        lines.append(rates_line("gradient-underflow rate (0 here, nonzero in fp32, first step)", m.underflow_rate))
        lines.append(rates_line("update-lost rate (never moved here, moved in fp32)", m.update_lost_rate))
        return "\n".join(lines + message_lines(self.golden, update_command))


def _g(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return f"{v:.4g}"


def judge(outcome: TrainingOutcome) -> None:
    """The absolute verdicts (the module docstring), then the golden's."""
    m, c, add = outcome.metrics, outcome.train_config, outcome.problems.append
    if m.first_nonfinite is not None:
        step, what = m.first_nonfinite
        value = m.losses[step]
        cat = "overflow" if math.isinf(value) or what != "loss" else "nan"
        where = "" if what == "loss" else ", a step the GradScaler did not skip"
        add(("oracle", cat, f"non-finite {what} at step {step} (loss {value:g}){where}"))
    worst = max(range(m.steps), key=lambda i: m.loss_deviation[i] if m.loss_deviation[i] is not None else -1.0)
    if c.id != "fp32" and not m.loss_deviation[worst] <= c.loss_rtol and m.first_nonfinite is None:
        add(("oracle", "accuracy", f"loss deviates from fp32 by {m.loss_deviation[worst]:.3g} (relative) at step "
                                   f"{worst} > {c.loss_rtol:g} allowed for {c.id}"))
    low, high = UPDATE_RATIO_BAND
    if m.update_ratio is not None and not low <= m.update_ratio <= high:
        s = f"the parameter update is {m.update_ratio:.3g} x the fp32 update (median over steps)"
        scale = next((x for x in m.scales if x), None)
        if scale and 0 < m.update_ratio < low and abs(math.log2(m.update_ratio * scale)) < 3:
            s += (f", about 1 / the loss scale {scale:g}: the gradients were clipped or changed before "
                  "scaler.unscale_(optimizer)")
        if "update_size" in c.shows:
            outcome.details.append(f"{c.id} shows this: {s} (reported, not held to the band {low:g} to {high:g})")
        else:
            add(("oracle", "accuracy", s))
    for key, rates, limit, word, cat in (("underflow", m.underflow_rate, UNDERFLOW_LIMIT, "gradient-underflow rate", "underflow"),
                                         ("update_lost", m.update_lost_rate, UPDATE_LOST_LIMIT, "update-lost rate", "accuracy")):
        name, rate = m.worst(rates)
        if rate <= limit:
            continue
        if key in c.shows:
            outcome.details.append(f"{c.id} shows this: {word} {100 * rate:.1f} % in {name} (reported, not held to the "
                                   f"{100 * limit:g} % limit; the regression budget holds it where it was accepted)")
        else:
            add(("oracle", cat, f"{word} {100 * rate:.1f} % in {name} > {100 * limit:g} % allowed"))
    g = outcome.golden
    if g.error:
        add(("golden", "baseline", g.error.splitlines()[0]))
    for cat, s in g.problems:
        add(("golden", "regression" if cat == "accuracy" else cat, f"golden: {s}"))


def _step_call(spec: TrainSpec, config: TrainConfig, device: str):
    """The first step, traceable: a fresh seeded model and optimizer built now, outside the trace,
    and a call that runs the spec's step once on them."""
    one = TrainSpec(spec.model_fn, spec.optimizer_fn, spec.batch_fn, steps=1, step_fn=spec.step_fn, seed=spec.seed)
    return prepare_training(one, config, device)


def trace_call(target: Target, config: TrainConfig, regime_name: str, device: str, variant: str = ""):
    """--precision-trace and --precision-audit: the first step under the config."""
    if config.ddp_hook is not None:
        return None  # the DDP cases run in other processes
    return _step_call(_spec(target), config, device)


def run_case(target: Target, config: TrainConfig, regime_name: str, device: str, golden: Golden,
             variant: str = "") -> TrainingOutcome:
    spec = _spec(target)
    if config.ddp_hook is not None:
        from pytest_precision.suites.ddp import run_ddp_case

        return run_ddp_case(spec, target.name, config, regime_name, device, golden, NAME)
    ref = _reference(target, device)
    try:
        run = ref if config.id == "fp32" else run_training(spec, config, device, _where(target, config))
    except TrainingError as e:
        raise TargetError(str(e)) from e.__cause__
    metrics = compare_trajectories(run, ref)
    batch0 = spec.batch_fn(0)
    gold = check_trajectory(golden, config, run, ref, metrics, batch0, spec.seed)
    outcome = TrainingOutcome(NAME, target.name, config.id, regime_name, config, metrics, gold)
    judge(outcome)
    if any(cat in ("overflow", "nan", "underflow") for _, cat, _ in outcome.problems):
        try:
            outcome.fault = first_fault(_step_call(spec, config, device), _step_call(spec, _FLOAT64, device))
        except TrainingError:  # a model that cannot run in float64 still fails; only the fault is unnamed
            outcome.fault = None
    return outcome


__all__ = ["NAME", "KINDS", "configs", "default_targets", "run_case", "trace_call", "standard_step", "TrainingOutcome"]
