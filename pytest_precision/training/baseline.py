"""What the golden of a training case holds and how its budgets are judged: two baseline entries
for the one golden lifecycle (``baselines.lifecycle``).

A trajectory golden (``<baselines>/train_step/<target>/trajectory/<config>.npz`` and ``.json``)
holds the fp32 run's loss and gradient-norm trajectories and this config's own loss trajectory
(float32), and, per numerics key, the metrics accepted with it and the budgets derived from them:

- the fp32 run of this session must repeat the fp32 trajectory stored for this machine's numerics
  key (a model, data, optimizer or torch change shows here as a moved trajectory, not as a
  precision regression); stored per key because a user's ``nn.init`` draws different float32
  values on different CPU ISAs, so the fp32 run itself differs between machines;
- the largest relative loss deviation from fp32 may grow to ``REGRESSION_SLACK`` x the accepted
  one plus a floor (a tenth of the config's absolute limit);
- the worst per-parameter gradient-underflow and update-lost rates may grow by ``RATE_SLACK``;
- no more steps skipped by the GradScaler than accepted plus one, and no non-finite step where the
  accepted run had none.

A DDP golden holds the uncompressed gradient norm and, per numerics key, the accepted gradient
SQNR (which may fall by ``SQNR_SLACK_DB``), underflow rate (which may grow by ``RATE_SLACK``) and
overflow count.
"""
from __future__ import annotations

import math

import torch

from ..baselines.lifecycle import BaselineEntry, BaselineResult
from ..baselines.store import Baseline, checksum
from ..numerics.budgets import REGRESSION_SLACK
from .compare import TrainMetrics
from .configs import TrainConfig
from .distributed import HookComparison
from .run import Trajectory

__all__ = ["TrajectoryEntry", "DDPEntry", "FP32_TRAJECTORY_RTOL", "RATE_SLACK", "SQNR_SLACK_DB", "OUTPUT", "rates_line"]

# fp32 loss trajectories of the built-in GPT agree across CPU ISAs (AVX512, AVX2, default) to
# about 1e-6 relative over 8 AdamW steps; a change of model, data or optimizer moves them by 1e-3
# and more
FP32_TRAJECTORY_RTOL = 1e-4
RATE_SLACK = 0.02  # two percentage points of a parameter's elements
SQNR_SLACK_DB = 6.0
OUTPUT = "trajectory"  # the one output name under which budgets are filed (baseline tools read it)


def rates_line(word: str, rates: dict[str, float]) -> str:
    """The five highest nonzero per-parameter rates, as a message line."""
    top = sorted(((r, n) for n, r in rates.items() if r > 0), reverse=True)[:5]
    return f"    {word}: " + (", ".join(f"{n} {100 * r:.1f} %" for r, n in top) if top else "none")


def _dtype_name(config: TrainConfig) -> str:
    return str(config.compute_dtype).replace("torch.", "")


class TrajectoryEntry(BaselineEntry):
    """A training run against the fp32 run: the accepted metrics and the fp32 trajectory."""

    names = (OUTPUT,)

    def borrowed_clause(self) -> str:
        return ", its fp32 trajectory not compared"

    def __init__(self, config: TrainConfig, run: Trajectory, ref: Trajectory, metrics: TrainMetrics, batch0,
                 seed: int):
        self.config, self.run, self.ref, self.metrics, self.seed = config, run, ref, metrics, seed
        self.input_checksum = _inputs_checksum(ref, batch0)

    def arrays(self) -> dict[str, torch.Tensor]:
        return {"fp32_loss": torch.tensor(self.ref.losses), "loss": torch.tensor(self.run.losses),
                "fp32_grad_norm": torch.tensor([math.nan if g is None else g for g in self.ref.grad_norms])}

    def accepted_outputs(self, result: BaselineResult) -> dict[str, dict]:
        acc = _accepted(self.metrics)
        return {OUTPUT: {"budget": _budget(acc, self.config), "accepted": acc}}

    def meta_fields(self) -> dict:
        return {"dtypes": {OUTPUT: _dtype_name(self.config)}, "seed": self.seed,
                "input_spec": {"steps": len(self.ref.losses)}, "input_checksum": self.input_checksum}

    def key_record(self) -> dict:
        return {"fp32_loss": list(self.ref.losses), "input_checksum": self.input_checksum}

    def inconsistency(self, base: Baseline, key: str, command: str) -> str | None:
        mine = base.meta.get("budgets", {}).get(key)
        if not isinstance(mine, dict):
            return None
        if mine.get("input_checksum") not in (None, self.input_checksum):
            return (f"{base.json_path}: the initial parameters or the first batch changed since the golden was "
                    f"accepted on {key} (a seed, model or data change, not a precision regression); re-accept with: "
                    f"{command}")
        stored = mine.get("fp32_loss")
        if not isinstance(stored, list) or len(stored) != len(self.ref.losses):
            return (f"{base.json_path}: holds {len(stored) if isinstance(stored, list) else 0} fp32 steps for {key}, "
                    f"this run has {len(self.ref.losses)}; re-accept with: {command}")
        return None

    def own_key_problems(self, record: dict) -> list[tuple[str, str]]:
        problem = _fp32_moved(self.ref.losses, record.get("fp32_loss") or [])
        return [("regression", problem)] if problem else []

    def budget_from(self, name: str, records: list[dict], borrowed: bool) -> dict:
        budgets = [r["budget"] for r in records]
        out = {k: max(b[k] for b in budgets) for k in ("max_loss_deviation", "max_underflow_rate",
                                                       "max_update_lost_rate", "skipped_steps")}
        firsts = [b.get("first_nonfinite_step") for b in budgets if b.get("first_nonfinite_step") is not None]
        out["first_nonfinite_step"] = min(firsts) if firsts else None
        return out

    def judge(self, base: Baseline, budgets: dict, result: BaselineResult) -> None:
        result.problems += _violations(self.metrics, budgets[OUTPUT])
        result.budgets[OUTPUT] = budgets[OUTPUT]  # a dict: training budgets have their own fields

    def describe(self, outputs: dict[str, dict]) -> str:
        b = outputs[OUTPUT]["budget"]
        return (f"max loss deviation {b['max_loss_deviation']:.3g}, underflow rate {100 * b['max_underflow_rate']:.1f} %, "
                f"update-lost rate {100 * b['max_update_lost_rate']:.1f} %, skipped steps {b['skipped_steps']}")


class DDPEntry(BaselineEntry):
    """A DDP compression hook against uncompressed DDP: accepted metrics, no tensors but the
    uncompressed gradient norm (so the baseline tools see one file pair per case, as elsewhere)."""

    names = (OUTPUT,)

    def __init__(self, config: TrainConfig, result: HookComparison):
        self.config, self.result = config, result

    def accepted(self) -> dict:
        r = self.result
        return {"grad_sqnr_db": r.grad_sqnr_db, "max_underflow_rate": max(r.underflow_rate.values(), default=0.0),
                "overflow": r.overflow}

    def arrays(self) -> dict[str, torch.Tensor]:
        return {"ref_grad_norm": torch.tensor([self.result.ref_grad_norm])}

    def accepted_outputs(self, result: BaselineResult) -> dict[str, dict]:
        acc = self.accepted()
        budget = {"min_grad_sqnr_db": acc["grad_sqnr_db"] - SQNR_SLACK_DB,
                  "max_underflow_rate": min(1.0, acc["max_underflow_rate"] + RATE_SLACK), "overflow": acc["overflow"]}
        return {OUTPUT: {"budget": budget, "accepted": acc}}

    def meta_fields(self) -> dict:
        return {"dtypes": {OUTPUT: _dtype_name(self.config)}}

    def budget_from(self, name: str, records: list[dict], borrowed: bool) -> dict:
        budgets = [r["budget"] for r in records]
        return {"min_grad_sqnr_db": min(b["min_grad_sqnr_db"] for b in budgets),
                "max_underflow_rate": max(b["max_underflow_rate"] for b in budgets),
                "overflow": max(b["overflow"] for b in budgets)}

    def judge(self, base: Baseline, budgets: dict, result: BaselineResult) -> None:
        acc, budget = self.accepted(), budgets[OUTPUT]
        if not acc["grad_sqnr_db"] >= budget["min_grad_sqnr_db"]:
            result.problems.append(("accuracy", f"gradient SQNR {acc['grad_sqnr_db']:.4g} dB < budget "
                                                f"{budget['min_grad_sqnr_db']:.4g} dB"))
        if acc["max_underflow_rate"] > budget["max_underflow_rate"]:
            result.problems.append(("underflow", f"gradient-underflow rate {100 * acc['max_underflow_rate']:.1f} % > "
                                                 f"budget {100 * budget['max_underflow_rate']:.1f} %"))
        if acc["overflow"] > budget["overflow"]:
            result.problems.append(("overflow", f"overflow {acc['overflow']} > {budget['overflow']} allowed"))

    def describe(self, outputs: dict[str, dict]) -> str:
        b = outputs[OUTPUT]["budget"]
        return (f"SQNR >= {b['min_grad_sqnr_db']:.4g} dB, underflow rate <= {100 * b['max_underflow_rate']:.1f} %, "
                f"overflow <= {b['overflow']}")


def _accepted(m: TrainMetrics) -> dict:
    uname, urate = m.worst(m.underflow_rate)
    lname, lrate = m.worst(m.update_lost_rate)
    return {"max_loss_deviation": m.max_loss_deviation, "max_underflow_rate": urate, "underflow_param": uname,
            "max_update_lost_rate": lrate, "update_lost_param": lname, "skipped_steps": len(m.skipped),
            "first_nonfinite_step": m.first_nonfinite[0] if m.first_nonfinite else None,
            "grad_sqnr_db": m.grad_sqnr_db, "param_sqnr_db": m.param_sqnr_db}


def _budget(acc: dict, config: TrainConfig) -> dict:
    return {"max_loss_deviation": REGRESSION_SLACK * acc["max_loss_deviation"] + 0.1 * config.loss_rtol,
            "max_underflow_rate": min(1.0, acc["max_underflow_rate"] + RATE_SLACK),
            "max_update_lost_rate": min(1.0, acc["max_update_lost_rate"] + RATE_SLACK),
            "skipped_steps": acc["skipped_steps"] + 1,
            "first_nonfinite_step": acc["first_nonfinite_step"]}


def _inputs_checksum(ref: Trajectory, batch0) -> str:
    """The initial parameters and the first batch: what the seed and the data give."""
    parts = [ref.initial[n].flatten() for n in sorted(ref.initial)]
    leaves = batch0 if isinstance(batch0, (tuple, list)) else (list(batch0.values()) if isinstance(batch0, dict) else [batch0])
    parts += [t.detach().flatten().to(torch.float64).cpu() for t in leaves if isinstance(t, torch.Tensor)]
    return checksum(torch.cat([p.to(torch.float64) for p in parts]))


def _violations(m: TrainMetrics, budget: dict) -> list[tuple[str, str]]:
    acc = _accepted(m)
    out = []
    if not acc["max_loss_deviation"] <= budget["max_loss_deviation"]:
        out.append(("accuracy", f"max loss deviation from fp32 {acc['max_loss_deviation']:.3g} > budget "
                                f"{budget['max_loss_deviation']:.3g}"))
    for key, word, param in (("max_underflow_rate", "gradient-underflow rate", "underflow_param"),
                             ("max_update_lost_rate", "update-lost rate", "update_lost_param")):
        if acc[key] > budget[key]:
            cat = "underflow" if key == "max_underflow_rate" else "accuracy"
            out.append((cat, f"{word} {100 * acc[key]:.1f} % in {acc[param]} > budget {100 * budget[key]:.1f} %"))
    if acc["skipped_steps"] > budget["skipped_steps"]:
        out.append(("overflow", f"{acc['skipped_steps']} steps skipped by the GradScaler > budget {budget['skipped_steps']}"))
    first, allowed = acc["first_nonfinite_step"], budget.get("first_nonfinite_step")
    if first is not None and (allowed is None or first < allowed):
        out.append(("nan", f"non-finite at step {first}, accepted {'none' if allowed is None else f'from step {allowed}'}"))
    return out


def _fp32_moved(now: list[float], stored: list[float]) -> str | None:
    """A sentence when this session's fp32 losses left the stored ones by more than the tolerance."""
    for i, (a, b) in enumerate(zip(now, stored)):
        if not (a == b or abs(a - b) <= FP32_TRAJECTORY_RTOL * abs(b)):  # NaN moved too
            rel = abs(a - b) / abs(b) if b else math.inf
            return (f"the fp32 trajectory moved: step {i} loss {a:.6g} vs golden {b:.6g} (relative {rel:.2g} > "
                    f"{FP32_TRAJECTORY_RTOL:g}): the model, data, optimizer or torch changed the fp32 run itself")
    return None
