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

The accepted metrics and budgets are typed in ``budget``, which alone reads and writes their JSON.
"""
from __future__ import annotations

import math

import torch

from ..baselines.commands import offer
from ..baselines.entry import BaselineEntry, BaselineResult
from ..baselines.lifecycle import budget_sources
from ..baselines.reading import Baseline
from ..baselines.store import checksum
from ..platform.devices import device_class
from .budget import DistributedAccepted, DistributedBudget, TrajectoryAccepted, TrajectoryBudget
from .compare import TrainMetrics
from .configs import TrainConfig
from .distributed import HookComparison
from .limits import CROSS_KEY_RTOL, SAME_KEY_RTOL, count_text, percent
from .moved import fp32_moved
from .trajectory import Trajectory

__all__ = ["TrajectoryEntry", "DDPEntry", "OUTPUT", "rates_line", "fp32_reference"]

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

    def accepted(self) -> TrajectoryAccepted:
        return TrajectoryAccepted.from_metrics(self.metrics)

    def accepted_outputs(self, result: BaselineResult) -> dict[str, dict]:
        acc = self.accepted()
        return {OUTPUT: {"budget": TrajectoryBudget.from_accepted(acc).to_json(), "accepted": acc.to_json()}}

    def meta_fields(self) -> dict:
        return {"dtypes": {OUTPUT: _dtype_name(self.config)}, "seed": self.seed,
                "input_spec": {"steps": len(self.ref.losses)}, "input_checksum": self.input_checksum}

    def key_record(self) -> dict:
        return {**self.reference, "input_checksum": self.input_checksum, "model_built_in": self.built_in}

    def inconsistency(self, base: Baseline, key: str, command: str) -> str | None:
        old = _older_format(base, key, TrajectoryBudget, command)
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
                    f"regression. Return the model as it was to keep this golden, or {offer(command)}")
        if mine.get("input_checksum") not in (None, self.input_checksum):
            hint = ""
            if then is None and self.built_in:  # a golden from before the build dtype was recorded
                hint = (f"; model_fn() builds parameters in {_built(self.built_in)}: if it built them in float32 then, "
                        "that is the change")
            return (f"{base.json_path}: the initial parameters or the first batch changed since the golden was "
                    f"accepted on {key} (a seed, model or data change, not a precision regression{hint}); "
                    f"{offer(command)}")
        stored = mine.get("fp32_loss")
        if not isinstance(stored, list) or len(stored) != len(self.ref.losses):
            return (f"{base.json_path}: holds {len(stored) if isinstance(stored, list) else 0} fp32 steps for {key}, "
                    f"this run has {len(self.ref.losses)}; {offer(command)}")
        return None

    def budget_from(self, name: str, records: list[dict], borrowed: bool) -> TrajectoryBudget:
        return TrajectoryBudget.widest([TrajectoryBudget.from_json(r["budget"]).with_count_slack(
            TrajectoryAccepted.from_json(r["accepted"])) for r in records])

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
            result.problems.append((problem.category, problem.sentence))
        budget = budgets[OUTPUT]
        result.problems += [(p.category, p.sentence) for p in budget.violations(self.accepted())]
        result.budgets[OUTPUT] = budget

    def describe(self, outputs: dict[str, dict]) -> str:
        out = outputs[OUTPUT]
        return TrajectoryBudget.from_json(out["budget"]).describe(TrajectoryAccepted.from_json(out["accepted"]))

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

    def accepted(self) -> DistributedAccepted:
        r = self.result
        return DistributedAccepted(grad_sqnr_db=r.grad_sqnr_db, overflow=r.overflow, underflow_rate={
            n: (v, r.underflow_elements.get(n, 0)) for n, v in r.underflow_rate.items()})

    def arrays(self) -> dict[str, torch.Tensor]:
        return {"ref_grad_norm": torch.tensor([self.result.ref_grad_norm])}

    def accepted_outputs(self, result: BaselineResult) -> dict[str, dict]:
        acc = self.accepted()
        return {OUTPUT: {"budget": DistributedBudget.from_accepted(acc).to_json(), "accepted": acc.to_json()}}

    def meta_fields(self) -> dict:
        return {"dtypes": {OUTPUT: _dtype_name(self.config)}}

    def inconsistency(self, base: Baseline, key: str, command: str) -> str | None:
        return _older_format(base, key, DistributedBudget, command)

    def budget_from(self, name: str, records: list[dict], borrowed: bool) -> DistributedBudget:
        return DistributedBudget.widest([DistributedBudget.from_json(r["budget"]).with_count_slack(
            DistributedAccepted.from_json(r["accepted"])) for r in records])

    def judge(self, base: Baseline, budgets: dict, result: BaselineResult) -> None:
        result.problems += [(p.category, p.sentence) for p in budgets[OUTPUT].violations(self.accepted())]

    def describe(self, outputs: dict[str, dict]) -> str:
        out = outputs[OUTPUT]
        return DistributedBudget.from_json(out["budget"]).describe(DistributedAccepted.from_json(out["accepted"]))


def _older_format(base: Baseline, this_key: str, budget_type: type[TrajectoryBudget] | type[DistributedBudget],
                  command: str) -> str | None:
    """A sentence when the budget of a key that judges ``this_key`` is of a format before
    ``budget_type``'s present one (``earlier_format``). Other machines' old records are theirs to
    re-accept: they do not stop this one."""
    recorded = base.meta.get("budgets", {})
    for key in budget_sources(recorded, this_key):
        record = recorded[key]
        budget = ((record or {}).get("outputs", {}).get(OUTPUT) or {}).get("budget") if isinstance(record, dict) else None
        lacks = budget_type.earlier_format(budget) if isinstance(budget, dict) else None
        if lacks:
            return (f"{base.json_path}: the budget recorded for {key} is of an earlier format ({lacks}): "
                    f"{offer(command)}")
    return None


def _inputs_checksum(ref: Trajectory, batch0) -> str:
    """The initial parameters and the first batch: what the seed and the data give."""
    parts = [ref.initial[n].flatten() for n in sorted(ref.initial)]
    leaves = batch0 if isinstance(batch0, (tuple, list)) else (list(batch0.values()) if isinstance(batch0, dict) else [batch0])
    parts += [t.detach().flatten().to(torch.float64).cpu() for t in leaves if isinstance(t, torch.Tensor)]
    return checksum(torch.cat([p.to(torch.float64) for p in parts]))

