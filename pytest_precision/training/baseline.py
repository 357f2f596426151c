"""What the golden of a training case holds and how its budgets are judged: two baseline entries
for the one golden lifecycle (``baselines.lifecycle``).

A trajectory golden (``<baselines>/train_step/<target>/trajectory/<config>.npz`` and ``.json``)
holds the fp32 run's loss and gradient-norm trajectories and this config's own loss trajectory
(float32), and, per numerics key, the fp32 reference of that machine and the metrics accepted
with it, with the budgets derived from them:

- the fp32 reference: its loss at every step, its gradient norm at every step and each
  parameter's gradient norm at the first step. This session's fp32 run must repeat the one
  recorded for its own key to ``SAME_KEY_RTOL``, or, on a machine with no key of its own, every
  recorded key to ``CROSS_KEY_RTOL``; otherwise "the fp32 reference moved" gives the first step's
  gradient-norm and loss ratios against the golden's and what they read as (``moved``: 2.00 x is a
  loss no longer divided by its micro-batches), and names the parameters whose first gradient
  moved most (a model, data, optimizer, loop or torch change, not a precision regression). It is
  kept per key because a user's ``nn.init`` draws different float32 values on different CPU ISAs;
- each metric's budget is ``REGRESSION_SLACK`` x its accepted error plus the floor of the measured
  spread of a correct run between machines (``limits.SPREAD``): the loss deviation, the gradient
  SQNR of each parameter group at the first step and the worst over steps and groups, the final
  parameters' SQNR (as errors, 10^(-SQNR/20)), the gradient-norm and update ratios (as |log|),
  and each parameter's gradient-underflow and update-lost rates, as counts of its elements
  (``REGRESSION_SLACK`` x the accepted count plus what another summation order adds to it,
  ``limits.count_bound``; derived from the accepted counts when judged, so a golden accepted before
  gets it too);
- no more steps skipped by the GradScaler than accepted plus one, and no non-finite step where the
  accepted run had none.

A DDP golden holds the uncompressed gradient norm and, per numerics key, the accepted gradient
SQNR, per-parameter underflow rates and overflow count, budgeted the same way.
"""
from __future__ import annotations

import math

import torch

from ..baselines.entry import BaselineEntry, BaselineResult
from ..baselines.lifecycle import budget_sources
from ..baselines.reading import Baseline
from ..baselines.store import checksum
from ..numerics.budgets import REGRESSION_SLACK
from ..platform.devices import device_class
from .compare import TrainMetrics
from .configs import TrainConfig
from .distributed import HookComparison
from .limits import CROSS_KEY_RTOL, SAME_KEY_RTOL, count_text, db_to_error, error_to_db, percent, spread_floor
from .moved import fp32_moved
from .rates import rates_budget, rates_describe, rates_problem, with_count_slack
from .trajectory import Trajectory

__all__ = ["TrajectoryEntry", "DDPEntry", "OUTPUT", "rates_line", "fp32_reference", "budget_for"]

OUTPUT = "trajectory"  # the one output name under which budgets are filed (baseline tools read it)


def rates_line(word: str, rates: dict[str, float], elements: dict[str, int]) -> str:
    """The five highest nonzero per-parameter rates, as a message line, each with its count."""
    top = sorted(((r, n) for n, r in rates.items() if r > 0), reverse=True)[:5]
    return f"    {word}: " + (", ".join(f"{n} {rate_text(r, elements.get(n, 0))}" for r, n in top) if top else "none")


def rate_text(rate: float, elements: int) -> str:
    """A rate over ``elements`` as the count that decides it: "3 of 12288 elements (0.0244 %)"."""
    return count_text(round(rate * elements), elements) if elements else percent(rate)


def _dtype_name(config: TrainConfig) -> str:
    return str(config.compute_dtype).replace("torch.", "")


def _log(ratio: float | None) -> float:
    if ratio is None:
        return 0.0
    return abs(math.log(ratio)) if ratio > 0 and math.isfinite(ratio) else math.inf


def _error_budget(metric: str, accepted: float) -> float:
    return REGRESSION_SLACK * accepted + spread_floor(metric, accepted)


def _sqnr_budget(metric: str, accepted_db: float) -> float:
    """The least SQNR allowed, from the accepted one (budgeted as an error)."""
    return error_to_db(_error_budget(metric, db_to_error(accepted_db)))


_TRAJECTORY_RATES = (("max_underflow_rate", "underflow_rate"), ("max_update_lost_rate", "update_lost_rate"))


def budget_for(acc: dict) -> dict:
    """The budget derived from a trajectory golden's accepted metrics (the module docstring)."""
    return {
        "max_loss_deviation": _error_budget("loss_deviation", acc["max_loss_deviation"]),
        "min_grad_sqnr_db": {g: _sqnr_budget("grad_sqnr", v) for g, v in acc["grad_sqnr_db"].items()},
        "min_worst_grad_sqnr_db": _sqnr_budget("worst_grad_sqnr", acc["worst_grad_sqnr_db"]),
        "min_param_sqnr_db": _sqnr_budget("param_sqnr", acc["param_sqnr_db"]),
        "max_grad_norm_log_ratio": _error_budget("grad_norm_ratio", _log(acc["grad_norm_ratio"])),
        "max_update_log_ratio": _error_budget("update_ratio", _log(acc["update_ratio"])),
        "max_underflow_rate": rates_budget(acc["underflow_rate"]),
        "max_update_lost_rate": rates_budget(acc["update_lost_rate"]),
        "skipped_steps": acc["skipped_steps"] + 1,
        "first_nonfinite_step": acc["first_nonfinite_step"],
    }


def _accepted(m: TrainMetrics) -> dict:
    return {"max_loss_deviation": m.max_loss_deviation, "grad_sqnr_db": dict(m.group_grad_sqnr_db),
            "worst_grad_sqnr_db": m.worst_grad_sqnr_db, "param_sqnr_db": m.param_sqnr_db,
            "grad_norm_ratio": m.worst_grad_norm_ratio, "update_ratio": m.update_ratio,
            "underflow_rate": {n: [r, m.underflow_elements.get(n, 0)] for n, r in m.underflow_rate.items()},
            "update_lost_rate": {n: [r, m.update_elements.get(n, 0)] for n, r in m.update_lost_rate.items()},
            "skipped_steps": len(m.skipped),
            "first_nonfinite_step": m.first_nonfinite[0] if m.first_nonfinite else None}


def _per_name(budgets: list[dict], key: str, pick) -> dict:
    """A per-parameter limit at ``pick`` across budgets (a parameter some lack: the others')."""
    names = {n for b in budgets for n in b[key]}
    return {n: pick(b[key][n] for b in budgets if n in b[key]) for n in names}


def _widest(budgets: list[dict]) -> dict:
    def least(key):
        return min(b[key] for b in budgets)

    def most(key):
        return max(b[key] for b in budgets)

    firsts = [b.get("first_nonfinite_step") for b in budgets if b.get("first_nonfinite_step") is not None]
    return {"max_loss_deviation": most("max_loss_deviation"), "min_grad_sqnr_db": _per_name(budgets, "min_grad_sqnr_db", min),
            "min_worst_grad_sqnr_db": least("min_worst_grad_sqnr_db"), "min_param_sqnr_db": least("min_param_sqnr_db"),
            "max_grad_norm_log_ratio": most("max_grad_norm_log_ratio"), "max_update_log_ratio": most("max_update_log_ratio"),
            "max_underflow_rate": _per_name(budgets, "max_underflow_rate", max),
            "max_update_lost_rate": _per_name(budgets, "max_update_lost_rate", max),
            "skipped_steps": most("skipped_steps"), "first_nonfinite_step": min(firsts) if firsts else None}


def fp32_reference(ref: Trajectory) -> dict:
    """What a numerics key records of the fp32 run: losses, gradient norms per step, and each
    parameter's gradient norm at the first step."""
    return {"fp32_loss": list(ref.losses), "fp32_grad_norm": list(ref.grad_norms),
            "fp32_first_grad_norms": {n: float(torch.linalg.vector_norm(g.double())) for n, g in ref.grads0.items()}}


class TrajectoryEntry(BaselineEntry):
    """A training run against the fp32 run: the accepted metrics and the fp32 reference."""

    names = (OUTPUT,)

    def borrowed_clause(self) -> str:
        if self.reference_compared:
            return f", its fp32 reference held to theirs within {CROSS_KEY_RTOL:g}"
        return ", its fp32 reference not compared (no machine of its device type recorded one)"

    def __init__(self, config: TrainConfig, run: Trajectory, ref: Trajectory, metrics: TrainMetrics, batch0,
                 seed: int, budget_key: str):
        self.config, self.run, self.ref, self.metrics, self.seed = config, run, ref, metrics, seed
        self.budget_key = budget_key
        self.input_checksum = _inputs_checksum(ref, batch0)
        self.reference = fp32_reference(ref)
        self.reference_compared = False  # judge: whether a machine of this device type recorded one
        self.built_in = sorted(ref.built_dtypes)  # the dtypes model_fn built parameters in, float32 aside
        first = ref.first_step if ref.first_step is not None else 0
        # the backward passes of the fp32 run's first step: a loop's micro-batches (moved.ratio_reading)
        self.micro_batches = ref.backward_passes[first] if first < len(ref.backward_passes) else 1

    def arrays(self) -> dict[str, torch.Tensor]:
        return {"fp32_loss": torch.tensor(self.ref.losses), "loss": torch.tensor(self.run.losses),
                "fp32_grad_norm": torch.tensor([math.nan if g is None else g for g in self.ref.grad_norms])}

    def accepted(self) -> dict:
        return _accepted(self.metrics)

    def accepted_outputs(self, result: BaselineResult) -> dict[str, dict]:
        acc = self.accepted()
        return {OUTPUT: {"budget": budget_for(acc), "accepted": acc}}

    def meta_fields(self) -> dict:
        return {"dtypes": {OUTPUT: _dtype_name(self.config)}, "seed": self.seed,
                "input_spec": {"steps": len(self.ref.losses)}, "input_checksum": self.input_checksum}

    def key_record(self) -> dict:
        return {**self.reference, "input_checksum": self.input_checksum, "model_built_in": self.built_in}

    def inconsistency(self, base: Baseline, key: str, command: str) -> str | None:
        old = _older_format(base, key, "min_grad_sqnr_db", command)
        if old:
            return old
        mine = base.meta.get("budgets", {}).get(key)
        if not isinstance(mine, dict):
            return None
        then = mine.get("model_built_in")
        if isinstance(then, list) and then != self.built_in:
            return (f"{base.json_path}: model_fn() now builds the model's parameters in {_built(self.built_in)}; when "
                    f"the golden was accepted on {key} it built them in {_built(then)}. Every config starts from "
                    "the built weights cast to float32, so the run starts from other weights: not a precision "
                    f"regression. Return the model as it was to keep this golden, or re-accept with: {command}")
        if mine.get("input_checksum") not in (None, self.input_checksum):
            hint = ""
            if then is None and self.built_in:  # a golden from before the build dtype was recorded
                hint = (f"; model_fn() builds parameters in {_built(self.built_in)}: if it built them in float32 then, "
                        "that is the change")
            return (f"{base.json_path}: the initial parameters or the first batch changed since the golden was "
                    f"accepted on {key} (a seed, model or data change, not a precision regression{hint}); re-accept "
                    f"with: {command}")
        stored = mine.get("fp32_loss")
        if not isinstance(stored, list) or len(stored) != len(self.ref.losses):
            return (f"{base.json_path}: holds {len(stored) if isinstance(stored, list) else 0} fp32 steps for {key}, "
                    f"this run has {len(self.ref.losses)}; re-accept with: {command}")
        return None

    def budget_from(self, name: str, records: list[dict], borrowed: bool) -> dict:
        return _widest([with_count_slack(r["budget"], r["accepted"], _TRAJECTORY_RATES) for r in records])

    def judge(self, base: Baseline, budgets: dict, result: BaselineResult) -> None:
        recorded = base.meta.get("budgets", {})
        own = recorded.get(self.budget_key)
        same_type = sorted(k for k, rec in recorded.items()
                           if isinstance(rec, dict) and device_class(k) == device_class(self.budget_key))
        self.reference_compared = bool(same_type)
        if isinstance(own, dict):
            problem = fp32_moved(self.reference, own, SAME_KEY_RTOL, self.budget_key, self.micro_batches)
        else:  # no key of its own: within the wider tolerance of every machine of its kind
            problem = next(filter(None, (fp32_moved(self.reference, recorded[k], CROSS_KEY_RTOL, k, self.micro_batches)
                                         for k in same_type)),
                           None)
        if problem:
            result.problems.append(("regression", problem))
        result.problems += _violations(self.accepted(), budgets[OUTPUT])
        result.budgets[OUTPUT] = budgets[OUTPUT]  # a dict: training budgets have their own fields

    def describe(self, outputs: dict[str, dict]) -> str:
        b, acc = outputs[OUTPUT]["budget"], outputs[OUTPUT]["accepted"]
        return (f"max loss deviation {b['max_loss_deviation']:.3g}, gradient SQNR >= "
                f"{min(b['min_grad_sqnr_db'].values(), default=math.inf):.4g} dB (first step), "
                f"{b['min_worst_grad_sqnr_db']:.4g} dB (worst step), parameter SQNR >= {b['min_param_sqnr_db']:.4g} dB, "
                f"{rates_describe('gradient underflow', acc['underflow_rate'], b['max_underflow_rate'])}, "
                f"{rates_describe('update lost', acc['update_lost_rate'], b['max_update_lost_rate'])}, "
                f"skipped steps {b['skipped_steps']}")

    def changes(self, old: dict[str, dict], new: dict[str, dict]) -> list[str]:
        before = old.get(OUTPUT, {}).get("budget", {}) or {}
        moved = []
        for k, v in new[OUTPUT]["budget"].items():
            if before.get(k) != v:
                moved.append(f"{k} {_short(before.get(k))} -> {_short(v)}")
        return moved


def _built(dtypes: list[str]) -> str:
    return "float32" if not dtypes else " and ".join(dtypes) + " (not float32)"


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_short(x)}" for k, x in sorted(v.items())[:3]) + (", ..." if len(v) > 3 else "") + "}"
    return repr(v)


class DDPEntry(BaselineEntry):
    """A DDP compression hook against uncompressed DDP: accepted metrics, no tensors but the
    uncompressed gradient norm (so the baseline tools see one file pair per case, as elsewhere)."""

    names = (OUTPUT,)

    def __init__(self, config: TrainConfig, result: HookComparison):
        self.config, self.result = config, result

    def accepted(self) -> dict:
        r = self.result
        return {"grad_sqnr_db": r.grad_sqnr_db,
                "underflow_rate": {n: [v, r.underflow_elements.get(n, 0)] for n, v in r.underflow_rate.items()},
                "overflow": r.overflow}

    def arrays(self) -> dict[str, torch.Tensor]:
        return {"ref_grad_norm": torch.tensor([self.result.ref_grad_norm])}

    def accepted_outputs(self, result: BaselineResult) -> dict[str, dict]:
        acc = self.accepted()
        budget = {"min_grad_sqnr_db": _sqnr_budget("grad_sqnr", acc["grad_sqnr_db"]),
                  "max_underflow_rate": rates_budget(acc["underflow_rate"]), "overflow": acc["overflow"]}
        return {OUTPUT: {"budget": budget, "accepted": acc}}

    def meta_fields(self) -> dict:
        return {"dtypes": {OUTPUT: _dtype_name(self.config)}}

    def inconsistency(self, base: Baseline, key: str, command: str) -> str | None:
        return _older_format(base, key, "max_underflow_rate", command, dict)

    def budget_from(self, name: str, records: list[dict], borrowed: bool) -> dict:
        budgets = [with_count_slack(r["budget"], r["accepted"], (("max_underflow_rate", "underflow_rate"),))
                   for r in records]
        return {"min_grad_sqnr_db": min(b["min_grad_sqnr_db"] for b in budgets),
                "max_underflow_rate": _per_name(budgets, "max_underflow_rate", max),
                "overflow": max(b["overflow"] for b in budgets)}

    def judge(self, base: Baseline, budgets: dict, result: BaselineResult) -> None:
        acc, budget = self.accepted(), budgets[OUTPUT]
        if not acc["grad_sqnr_db"] >= budget["min_grad_sqnr_db"]:
            result.problems.append(("accuracy", f"gradient SQNR {acc['grad_sqnr_db']:.4g} dB < budget "
                                                f"{budget['min_grad_sqnr_db']:.4g} dB"))
        problem = rates_problem("gradient-underflow rate", acc["underflow_rate"], budget["max_underflow_rate"])
        if problem:
            result.problems.append(("underflow", problem))
        if acc["overflow"] > budget["overflow"]:
            result.problems.append(("overflow", f"overflow {acc['overflow']} > {budget['overflow']} allowed"))

    def describe(self, outputs: dict[str, dict]) -> str:
        b, acc = outputs[OUTPUT]["budget"], outputs[OUTPUT]["accepted"]
        return (f"SQNR >= {b['min_grad_sqnr_db']:.4g} dB, "
                f"{rates_describe('gradient underflow', acc['underflow_rate'], b['max_underflow_rate'])}, "
                f"overflow <= {b['overflow']}")


def _older_format(base: Baseline, this_key: str, field: str, command: str, kind: type | None = None) -> str | None:
    """A sentence when the budget of a key that judges ``this_key`` lacks ``field`` (or holds it as
    another type): a golden accepted before the training budgets took their present form. Other
    machines' old records are theirs to re-accept: they do not stop this one."""
    recorded = base.meta.get("budgets", {})
    for key in budget_sources(recorded, this_key):
        record = recorded[key]
        budget = ((record or {}).get("outputs", {}).get(OUTPUT) or {}).get("budget") if isinstance(record, dict) else None
        if isinstance(budget, dict) and (field not in budget or (kind is not None and not isinstance(budget[field], kind))):
            return (f"{base.json_path}: the budget recorded for {key} is of an earlier format (no {field} per "
                    f"parameter{' group' if field == 'min_grad_sqnr_db' else ''}): re-accept it with: {command}")
    return None


def _inputs_checksum(ref: Trajectory, batch0) -> str:
    """The initial parameters and the first batch: what the seed and the data give."""
    parts = [ref.initial[n].flatten() for n in sorted(ref.initial)]
    leaves = batch0 if isinstance(batch0, (tuple, list)) else (list(batch0.values()) if isinstance(batch0, dict) else [batch0])
    parts += [t.detach().flatten().to(torch.float64).cpu() for t in leaves if isinstance(t, torch.Tensor)]
    return checksum(torch.cat([p.to(torch.float64) for p in parts]))


def _violations(acc: dict, budget: dict) -> list[tuple[str, str]]:
    out = []
    if not acc["max_loss_deviation"] <= budget["max_loss_deviation"]:
        out.append(("accuracy", f"max loss deviation from fp32 {acc['max_loss_deviation']:.3g} > budget "
                                f"{budget['max_loss_deviation']:.3g}"))
    floors, low = budget["min_grad_sqnr_db"], []
    for group, db in sorted(acc["grad_sqnr_db"].items()):
        floor = floors.get(group, max(floors.values(), default=-math.inf))
        if not db >= floor:
            low.append(f"{db:.4g} dB in {group} at the first step < budget {floor:.4g} dB")
    if not acc["worst_grad_sqnr_db"] >= budget["min_worst_grad_sqnr_db"] and not math.isnan(acc["worst_grad_sqnr_db"]):
        low.append(f"{acc['worst_grad_sqnr_db']:.4g} dB at the worst step < budget {budget['min_worst_grad_sqnr_db']:.4g} dB")
    if low:
        out.append(("accuracy", "gradient SQNR " + ", ".join(low)))
    if not acc["param_sqnr_db"] >= budget["min_param_sqnr_db"] and not math.isnan(acc["param_sqnr_db"]):
        out.append(("accuracy", f"final-parameter SQNR {acc['param_sqnr_db']:.4g} dB < budget "
                                f"{budget['min_param_sqnr_db']:.4g} dB"))
    for key, bkey, word in (("grad_norm_ratio", "max_grad_norm_log_ratio", "gradient-norm ratio"),
                            ("update_ratio", "max_update_log_ratio", "update ratio")):
        if not _log(acc[key]) <= budget[bkey]:
            out.append(("accuracy", f"{word} {acc[key]:.4g} x fp32's, outside the budget {math.exp(-budget[bkey]):.6g} "
                                    f"to {math.exp(budget[bkey]):.6g}"))
    for key, word, cat in (("underflow_rate", "gradient-underflow rate", "underflow"),
                           ("update_lost_rate", "update-lost rate", "accuracy")):
        problem = rates_problem(word, acc[key], budget[f"max_{key}"])
        if problem:
            out.append((cat, problem))
    if acc["skipped_steps"] > budget["skipped_steps"]:
        out.append(("overflow", f"{acc['skipped_steps']} steps skipped by the GradScaler > budget {budget['skipped_steps']}"))
    first, allowed = acc["first_nonfinite_step"], budget.get("first_nonfinite_step")
    if first is not None and (allowed is None or first < allowed):
        out.append(("nan", f"non-finite at step {first}, accepted {'none' if allowed is None else f'from step {allowed}'}"))
    return out
