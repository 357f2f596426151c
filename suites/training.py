"""The train_step kind: ``TrainSpec`` targets x training configs, each run for the spec's steps and
compared with the fp32 run from the same seed (``pytest_precision.training`` has the contract).

Configs (``training.TRAIN_CONFIGS``; ``--precision-configs`` selects them by their matrix config:
``amp-fp16`` runs both amp-fp16 recipes, ``bf16`` both pure-bf16 ones and the bf16 DDP case):
fp32, tf32 (CUDA), amp-bf16, amp-fp16 with a GradScaler, amp-fp16 without one, pure bf16, pure
bf16 with stochastic rounding, fp8 Linear emulation; and ``ddp-fp16``, ``ddp-bf16``, DDP's
gradient-compression hooks against uncompressed DDP (ddp.py has their verdicts).

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
- and against the golden (training/baseline.py): the fp32 trajectory moved, or the loss
  deviation and the rates grew past their accepted budgets.

A failing case with a non-finite value or an underflow re-runs its first step traced, beside the
same step in float64, and names the first op that lost the value (explain.faults.first_fault).
"""
from __future__ import annotations

import math
import weakref

import torch
from tabulate import tabulate

from pytest_precision.baselines.lifecycle import BaselineCheck
from pytest_precision.explain.faults import first_fault
from pytest_precision.kinds.base import Case, Kind, skip
from pytest_precision.kinds.outcome import Evidence, Outcome, baseline_problems
from pytest_precision.kinds.tables import SummaryTable, fmt
from pytest_precision.kinds.target import Target, TargetError
from pytest_precision.speed.timing import format_seconds
from pytest_precision.training import (TRAIN_CONFIGS, TrainConfig, TrainingError, TrainMetrics, TrainSpec,
                                       Trajectory, compare_trajectories, prepare_training, run_training)
from pytest_precision.training.baseline import TrajectoryEntry, rates_line
from pytest_precision.training.distributed import ddp_skip_reason

from . import ddp

__all__ = ["TRAIN_STEP", "TrainStepKind", "TrainingEvidence", "TRAINING_TABLE", "judge", "UNDERFLOW_LIMIT",
           "UPDATE_LOST_LIMIT", "UPDATE_RATIO_BAND"]

UNDERFLOW_LIMIT = 0.05
UPDATE_LOST_LIMIT = 0.05
UPDATE_RATIO_BAND = (0.5, 2.0)
_FLOAT64 = TrainConfig("float64", "fp32", "float64 reference of the first step (fault localisation)", 0.0,
                       param_dtype=torch.float64)

# spec -> {device: the fp32 run}, shared by the spec's configs; weak, so a spec's runs go when its
# conftest does (pytester sessions in one process), and never keyed by id(), which a later spec reuses
_REFERENCES: "weakref.WeakKeyDictionary[TrainSpec, dict[str, Trajectory]]" = weakref.WeakKeyDictionary()


def _g(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return f"{v:.4g}"


class TrainingEvidence(Evidence):
    """A training run against the fp32 run from the same seed."""

    def __init__(self, config: TrainConfig, metrics: TrainMetrics):
        self.config, self.metrics = config, metrics

    def summary(self) -> dict:
        m = self.metrics
        uname, urate = m.worst(m.underflow_rate)
        lname, lrate = m.worst(m.update_lost_rate)
        return {"steps": m.steps, "max_loss_deviation": m.max_loss_deviation, "grad_sqnr_db": m.grad_sqnr_db,
                "param_sqnr_db": m.param_sqnr_db, "max_underflow_rate": urate, "underflow_param": uname,
                "max_update_lost_rate": lrate, "update_lost_param": lname, "update_ratio": m.update_ratio,
                "skipped_steps": list(m.skipped), "first_nonfinite": list(m.first_nonfinite) if m.first_nonfinite else None,
                "step_time_s": m.step_time_s, "fp32_step_time_s": m.fp32_step_time_s}

    def record_fields(self, outcome) -> dict:
        return {"training": self.summary()}

    def report_fields(self, outcome) -> dict:
        """The whole trajectories (the summary record has the table's metrics)."""
        m = self.metrics
        return {"training_detail": {"losses": m.losses, "fp32_losses": m.fp32_losses, "loss_deviation": m.loss_deviation,
                                    "grad_norms": m.grad_norms, "fp32_grad_norms": m.fp32_grad_norms, "scales": m.scales,
                                    "underflow_rate": m.underflow_rate, "update_lost_rate": m.update_lost_rate,
                                    "regression_budget": outcome.baseline.budgets.get("trajectory")}}

    def message_lines(self, outcome) -> list[str]:
        m, c = self.metrics, self.config
        lines = [f"  {c.id}: {c.description}; against the fp32 run from the same seed, {m.steps} steps:"]
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
        return lines


def _opt(v) -> str:
    """A metric a row may not have (a DDP case has no loss trajectory): "-"."""
    return "-" if v is None else fmt(float(v))


def _rate(rate: float, param: str) -> str:
    return "0" if not rate else f"{100 * rate:.3g} % {param}"


class TrainingTable(SummaryTable):
    """One row per target and training config (the records carry their metrics under ``training``)."""

    name = "training"
    title = "precision training summary"
    detail = "; each config against the fp32 run from the same seed"
    markdown_heading = "Training (each config against the fp32 run from the same seed)"
    HEADERS = ("target", "config", "steps", "max loss dev.", "grad SQNR dB", "param SQNR dB", "grad underflow",
               "update lost", "skipped", "step time", "vs fp32", "verdict")

    def render(self, records: list[dict], config_order: list[str] | None = None) -> str:
        order = {c: i for i, c in enumerate(TRAIN_CONFIGS)}
        rows = []
        for r in sorted(records, key=lambda r: (r["target"], order.get(r["config"], len(order)), r["config"])):
            if "skipped" in r or "crashed" in r:  # no metrics; the summary says why below the table
                rows.append((r["target"], r["config"], *("-" * 9), f"skip: {r['skipped']}" if "skipped" in r
                             else "FAIL crash"))
                continue
            t = r["training"]
            verdict = "pass" if r["passed"] else "FAIL " + ",".join(r["categories"])
            step, fp32_step = t.get("step_time_s"), t.get("fp32_step_time_s")
            timed = step is not None and math.isfinite(step) and step > 0
            speedup = f"{fp32_step / step:.2f} x" if timed and fp32_step and r["config"] != "fp32" else "-"
            rows.append((r["target"], r["config"], t["steps"], _opt(t["max_loss_deviation"]), _opt(t["grad_sqnr_db"]),
                         _opt(t["param_sqnr_db"]), _rate(t["max_underflow_rate"], t["underflow_param"]),
                         _rate(t["max_update_lost_rate"], t["update_lost_param"]), len(t["skipped_steps"]),
                         format_seconds(step) if timed else "-", speedup, verdict))
        return tabulate(rows, headers=self.HEADERS, tablefmt="github")


TRAINING_TABLE = TrainingTable()


def judge(outcome: Outcome) -> None:
    """The absolute verdicts (the module docstring), then the golden's."""
    ev: TrainingEvidence = outcome.evidence
    m, c, add = ev.metrics, ev.config, outcome.add
    if m.first_nonfinite is not None:
        step, what = m.first_nonfinite
        value = m.losses[step]
        cat = "overflow" if math.isinf(value) or what != "loss" else "nan"
        where = "" if what == "loss" else ", a step the GradScaler did not skip"
        add("oracle", cat, f"non-finite {what} at step {step} (loss {value:g}){where}")
    worst = max(range(m.steps), key=lambda i: m.loss_deviation[i] if m.loss_deviation[i] is not None else -1.0)
    if c.id != "fp32" and not m.loss_deviation[worst] <= c.loss_rtol and m.first_nonfinite is None:
        add("oracle", "accuracy", f"loss deviates from fp32 by {m.loss_deviation[worst]:.3g} (relative) at step "
                                  f"{worst} > {c.loss_rtol:g} allowed for {c.id}")
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
            add("oracle", "accuracy", s)
    for key, rates, limit, word, cat in (("underflow", m.underflow_rate, UNDERFLOW_LIMIT, "gradient-underflow rate", "underflow"),
                                         ("update_lost", m.update_lost_rate, UPDATE_LOST_LIMIT, "update-lost rate", "accuracy")):
        name, rate = m.worst(rates)
        if rate <= limit:
            continue
        if key in c.shows:
            outcome.details.append(f"{c.id} shows this: {word} {100 * rate:.1f} % in {name} (reported, not held to the "
                                   f"{100 * limit:g} % limit; the regression budget holds it where it was accepted)")
        else:
            add("oracle", cat, f"{word} {100 * rate:.1f} % in {name} > {100 * limit:g} % allowed")
    outcome.problems += baseline_problems(outcome.baseline)


class TrainStepKind(Kind):
    name = "train_step"
    suite = "training"
    contract = "TrainSpec(model_fn, optimizer_fn, batch_fn, steps, step_fn=None) (pytest_precision.training)"
    table = TRAINING_TABLE
    audit_regime = "trajectory"
    REGIME = "trajectory"  # no input regimes: a run is the spec's own batches

    def check_target(self, name: str, fn) -> None:
        if not isinstance(fn, TrainSpec):
            raise TypeError(f"target {name!r}: kind train_step takes a pytest_precision.TrainSpec, got {fn!r}")

    def default_targets(self) -> list[Target]:
        from pytest_precision.suites import tiny_gpt

        return [Target("tiny_gpt", tiny_gpt.SPEC, "train_step", origin="built-in")]

    def configs(self, selected) -> list[TrainConfig]:
        """The training configs whose matrix config (``base``) the run selected, in table order."""
        chosen = {c.id for c in selected}
        return [c for c in TRAIN_CONFIGS.values() if c.base in chosen]

    def regime_names(self) -> tuple[str, ...]:
        return (self.REGIME,)

    def skip_reason(self, case: Case) -> str | None:
        if case.config.ddp_hook is not None:
            reason = ddp_skip_reason(case.device)
            if reason:
                return f"{case.config.id}: {reason}"
        return super().skip_reason(case)

    @staticmethod
    def _where(target: Target, config: TrainConfig) -> str:
        return f"target {target.name!r} (train_step) under config {config.id}"

    @staticmethod
    def _spec(target: Target) -> TrainSpec:
        if not isinstance(target.fn, TrainSpec):
            raise TargetError(f"target {target.name!r} (train_step) is a {type(target.fn).__name__}, expected a "
                              "pytest_precision.TrainSpec")
        return target.fn

    def _reference(self, case: Case) -> Trajectory:
        spec = self._spec(case.target)
        runs = _REFERENCES.setdefault(spec, {})
        if case.device not in runs:
            fp32 = TRAIN_CONFIGS["fp32"]
            try:
                runs[case.device] = run_training(spec, fp32, case.device, self._where(case.target, fp32),
                                                 keep_grads=True)
            except TrainingError as e:
                raise TargetError(str(e)) from e.__cause__
        return runs[case.device]

    def run(self, case: Case, baseline: BaselineCheck) -> Outcome:
        reason = self.skip_reason(case)
        if reason:
            skip(reason)
        spec, config = self._spec(case.target), case.config
        if config.ddp_hook is not None:
            return ddp.run_case(self, case, spec, baseline)
        ref = self._reference(case)
        try:
            run = ref if config.id == "fp32" else run_training(spec, config, case.device, self._where(case.target, config))
        except TrainingError as e:
            raise TargetError(str(e)) from e.__cause__
        metrics = compare_trajectories(run, ref)
        result = baseline.check(TrajectoryEntry(config, run, ref, metrics, spec.batch_fn(0), spec.seed))
        outcome = Outcome(self.suite, self.name, case.target.name, config.id, case.regime,
                          TrainingEvidence(config, metrics), result)
        judge(outcome)
        if any(p.category in ("overflow", "nan", "underflow") for p in outcome.problems):
            try:
                outcome.fault = first_fault(self._step_call(spec, config, case.device),
                                            self._step_call(spec, _FLOAT64, case.device))
            except TrainingError:  # a model that cannot run in float64 still fails; only the fault is unnamed
                outcome.fault = None
        return outcome

    @staticmethod
    def _step_call(spec: TrainSpec, config: TrainConfig, device: str):
        """The first step, traceable: a fresh seeded model and optimizer built now, outside the trace,
        and a call that runs the spec's step once on them."""
        one = TrainSpec(spec.model_fn, spec.optimizer_fn, spec.batch_fn, steps=1, step_fn=spec.step_fn, seed=spec.seed)
        return prepare_training(one, config, device)

    def bench_call(self, case: Case):
        return None  # steps are timed inside the run and shown against fp32, not gated

    def trace_call(self, case: Case):
        """--precision-trace and --precision-audit: the first step under the config."""
        if case.config.ddp_hook is not None:
            return None  # the DDP cases run in other processes
        return self._step_call(self._spec(case.target), case.config, case.device)


TRAIN_STEP = TrainStepKind()
