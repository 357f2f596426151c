"""Tensor outputs under golden check: the float64 oracle of each output on the config's rounded
inputs is stored as float32, and each output's error against it (in ULPs, or max abs for outputs
that cross zero) is judged by the regression budget accepted with it. A budget borrowed from
another machine is scaled by how much more this machine's same-precision peer errs, at most
``MAX_PEER_SCALE``."""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from ..numerics.budgets import MACHINE_SPREAD, Budget, abs_floor, regression_budget, violations
from ..numerics.formats import format_of
from ..numerics.metrics import Comparison, ComparisonSpec
from .commands import offer
from .entry import SINGLE, BaselineEntry, BaselineResult, output_label
from .reading import Baseline
from .schema import same_value
from .store import checksum

__all__ = ["TensorOutput", "TensorOutputs", "MAX_PEER_SCALE"]


@dataclass
class TensorOutput:
    """One output under golden check: what the run gave and its float64 oracle, compared as ``spec``
    says (the case's own comparison: on absolute error where ``spec.abs_floor`` is set, and never
    below its floors, what a correct implementation reaches under another summation order)."""

    out: torch.Tensor
    reference: torch.Tensor
    spec: ComparisonSpec
    # the same-precision peer against the oracle in this run: what the budget's typical error is
    # never held below a fraction of, and what scales a budget borrowed from another machine
    peer: Comparison | None = None
    # a second call on fresh copies of the same inputs against the first, where their bits differed
    # (kinds.tensor.contract): the regression budget never sits below it
    spread: Comparison | None = None

    def compare_with(self, ref: torch.Tensor) -> Comparison:
        return self.spec.compare(self.out, ref)

    def budget_for(self, accepted: Comparison, ref: torch.Tensor) -> Budget:
        if not self.spec.on_abs:
            return regression_budget(accepted).at_least_spread(self.spread)
        top = float(ref[torch.isfinite(ref)].abs().max()) if bool(torch.isfinite(ref).any()) else 0.0
        return regression_budget(accepted, abs_floor_value=abs_floor(top, self.spec.dtype),
                                 reorder_max=self.spec.abs_floor or 0.0,
                                 reorder_rms=self.spec.rms_floor or 0.0).at_least_spread(self.spread)


# what a golden keeps of the peer's error at acceptance (to carry a budget to another machine)
_PEER_FIELDS = ("max_ulp", "mean_ulp", "max_abs", "rms_abs")


class TensorOutputs(BaselineEntry):
    """Named tensor outputs: the float32 references are stored, each output's error against its
    reference is judged by the regression budget accepted with it."""

    def __init__(self, outputs: dict[str, TensorOutput], *, inputs: torch.Tensor | None = None,
                 seed: int | None = None, input_spec: dict | None = None):
        self.outputs = outputs
        self.names = tuple(outputs)
        self.input_checksum = checksum(inputs) if inputs is not None else None
        self.seed, self.input_spec = seed, input_spec
        self._refs = {n: o.reference.detach().to(torch.float32).cpu() for n, o in outputs.items()}
        self.peer_scale: dict[str, float] = {}  # output -> how much more this machine's peer errs (borrowed budgets)

    def arrays(self) -> dict[str, torch.Tensor]:
        return self._refs

    def accepted_outputs(self, result: BaselineResult) -> dict[str, dict]:
        return self._accepted(self._refs, result)

    def accepted_against(self, base: Baseline, result: BaselineResult) -> dict[str, dict]:
        """Each output's error against the stored reference (this run's own oracle where the inputs'
        bits moved: the stored reference is another input's, as ``judge`` takes it)."""
        refs = self._refs if self.inputs_moved(base) else {n: base.arrays[n] for n in self.outputs}
        return self._accepted(refs, result)

    def _accepted(self, refs: dict[str, torch.Tensor], result: BaselineResult) -> dict[str, dict]:
        entries = {}
        for name, o in self.outputs.items():
            cmp = o.compare_with(refs[name])
            budget = o.budget_for(cmp, refs[name])
            result.comparisons[name], result.budgets[name] = cmp, budget
            entries[name] = {"budget": budget.as_dict(), "accepted": cmp.summary()}
            if o.peer is not None:
                entries[name]["peer"] = {k: getattr(o.peer, k) for k in _PEER_FIELDS}
        return entries

    def meta_fields(self) -> dict:
        dtypes = {n: format_of(o.spec.dtype).name for n, o in self.outputs.items()}
        return {"dtypes": dtypes, "seed": self.seed, "input_spec": self.input_spec, "input_checksum": self.input_checksum}

    def carried_meta(self, old: Baseline | None) -> dict:
        """The old metadata (other machines' budgets, speed records) when it is about the same
        outputs: the same names and, where the .npz could be read, the same shapes."""
        if old is None:
            return {}
        if old.arrays is None:  # only the JSON could be read: its outputs' names
            same = set(old.meta.get("dtypes") or self._refs) == set(self._refs)
        else:
            same = set(old.arrays) == set(self._refs) and all(old.arrays[n].shape == self._refs[n].shape
                                                               for n in self._refs)
        return dict(old.meta) if same else {}

    def inputs_moved(self, base: Baseline) -> bool:
        """Whether the inputs' bits differ from those the golden was accepted on while what drew
        them (regime, seed, shapes and dtypes) is the same: another machine drew them (torch's
        float32 ``randn`` differs between vector ISAs), not another generator."""
        stored = base.meta.get("input_checksum")
        if self.input_checksum is None or stored is None or stored == self.input_checksum:
            return False
        spec = base.meta.get("input_spec")
        return spec is not None and spec == json.loads(json.dumps(self.input_spec))

    def inconsistency(self, base: Baseline, key: str, command: str) -> str | None:
        stored = base.meta.get("input_checksum")
        if self.input_checksum is not None and stored is not None and stored != self.input_checksum \
                and not self.inputs_moved(base):
            return (f"{base.json_path}: the inputs changed since the golden was accepted (checksum "
                    f"{stored[:12]} -> {self.input_checksum[:12]}): a generator or input-spec change, not a "
                    f"precision regression; {offer(command)}")
        if set(base.arrays) != set(self.outputs):
            return (f"{base.npz_path}: holds outputs {sorted(base.arrays)}, this check has {sorted(self.outputs)}; "
                    f"{offer(command)}")
        for name, o in self.outputs.items():
            ref = base.arrays[name]
            if tuple(ref.shape) != tuple(o.out.shape):
                return (f"{base.npz_path}: shape mismatch for {name}, golden {tuple(ref.shape)} vs output "
                        f"{tuple(o.out.shape)}; {offer(command)}")
        return None

    def budget_from(self, name: str, records: list[dict], borrowed: bool) -> Budget:
        """Borrowed budgets are scaled by how much more this machine's peer errs than the peer
        did where each was accepted (its summation order is this machine's too), and at least by
        the spread measured between machines (``MACHINE_SPREAD``): never down."""
        o = self.outputs[name]
        largest_key, typical_key = ("max_abs", "rms_abs") if o.spec.on_abs else ("max_ulp", "mean_ulp")
        cap = self.peer_cap
        budgets = []
        for record in records:
            budget = Budget.from_dict(record["budget"])
            if borrowed:
                stored = record.get("peer")
                largest = typical = 1.0
                if o.peer is not None and isinstance(stored, dict):
                    largest = _ratio(getattr(o.peer, largest_key), stored.get(largest_key), cap)
                    typical = _ratio(getattr(o.peer, typical_key), stored.get(typical_key), cap)
                self.peer_scale[name] = max(self.peer_scale.get(name, 1.0), largest, typical)
                budget = budget.scaled(max(largest, MACHINE_SPREAD["largest"]), max(typical, MACHINE_SPREAD["typical"]))
            budgets.append(budget)
        return Budget.widest(budgets)

    @property
    def peer_cap(self) -> float:
        return MAX_PEER_SCALE["another device type" if self.across_devices else "same device type"]

    def borrowed_clause(self) -> str:
        grown = max(self.peer_scale.values(), default=1.0)
        spread = (f"the spread between machines ({MACHINE_SPREAD['largest']:.3g} x the largest error, "
                  f"{MACHINE_SPREAD['typical']:.3g} x the typical)")
        if grown >= self.peer_cap:
            return (f", scaled by this machine's peer error, at most {self.peer_cap:g} x: the stored peer errs "
                    f"{self.peer_cap:g} or more times less than this machine's (more than machines were measured to "
                    "differ: an edited golden? see `python -m pytest_precision baselines show`)")
        if grown > max(MACHINE_SPREAD.values()):
            return f", scaled by this machine's peer error (up to {grown:.3g} x) or {spread}"
        return f", scaled by {spread}"

    def changes(self, old: dict[str, dict], new: dict[str, dict]) -> list[str]:
        """The budget fields that moved, then the peer's errors (what scales a borrowed budget)."""
        moved = super().changes(old, new)
        for name, e in new.items():
            before, after = old.get(name, {}).get("peer") or {}, e.get("peer") or {}
            label = output_label(name) if len(new) > 1 else ""
            moved += [f"{label}peer {k} {before.get(k)!r} -> {after.get(k)!r}" for k in _PEER_FIELDS
                      if not same_value(before.get(k), after.get(k))]
        return moved

    def judge(self, base: Baseline, budgets: dict, result: BaselineResult) -> None:
        moved = self.inputs_moved(base)
        if moved:
            result.moved_inputs = (
                "the inputs' bits differ from those the golden was accepted on, drawn from the same seed and spec "
                "(another machine's float32 randn, or an edit of the generator that kept its shapes and dtypes? "
                "pytest_precision.numerics.inputs.seeded_normal draws the same bits everywhere): judged by this run's error against its float64 oracle within the golden's budget, "
                "not element by element")
        for name, o in self.outputs.items():
            # with moved inputs the stored reference is another input's: the error is taken against
            # this run's oracle instead, the quantity the budget was accepted on
            cmp = o.compare_with(o.reference if moved else base.arrays[name])
            budget = (budgets[name] if o.peer is None else budgets[name].with_typical_floor(o.peer)).at_least_spread(
                o.spread)
            result.comparisons[name], result.budgets[name] = cmp, budget
            prefix = "" if name == SINGLE else f"{name}: "
            result.problems += [(cat, prefix + s) for cat, s in violations(cmp, budget)]

    def describe(self, outputs: dict[str, dict]) -> str:
        return "; ".join(output_label(n) + Budget.from_dict(e["budget"]).describe() for n, e in outputs.items())


# The most a borrowed budget grows by the peers' ratio: a stored peer error 1e300 times smaller than
# this machine's is an edited golden, and would let any regression pass. Between machines of one
# device type a correct op's largest error moved up to 3.0 x (MACHINE_SPREAD's measurement); to
# another device type (a first run on a GPU of goldens recorded on CPUs) nothing is measured yet.
MAX_PEER_SCALE = {"same device type": 3.0, "another device type": 16.0}


def _ratio(now: float, then, cap: float) -> float:
    """How many times ``then`` ``now`` is, at least 1 (1 where either is missing, zero or not
    finite), at most ``cap``."""
    try:
        r = float(now) / float(then)
    except (TypeError, ValueError, ZeroDivisionError):
        return 1.0
    return min(r, cap) if r > 1.0 and r != float("inf") else 1.0
