"""The golden check: compare outputs with their accepted baseline, or write a new baseline.

Used by the suites and by the ``golden`` fixture. References are float64 oracles on the config's
rounded inputs, stored as float32 (DESIGN 2.1, 2.2); the accepted budgets are keyed by the
numerics key of the machine (``devices.numerics_key``: device type and CPU ISA or GPU compute
capability), then by output name. A machine with no budget of its own is judged by the widest
budget recorded for its device type, and the message says so. Nothing is written without the update flag; a missing baseline fails
and says the command that writes it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .baselines import UPDATE_OPTION, Baseline, BaselineError, BaselineStore, checksum
from .budgets import Budget, abs_floor, regression_budget, violations
from .devices import device_class, machine_name, numerics_key
from .formats import format_of
from .metrics import Comparison, compare

__all__ = ["Golden", "GoldenResult", "Output", "budget_sources"]

SINGLE = "reference"  # the array name when a case has one output


def budget_sources(recorded: dict, key: str) -> list[str]:
    """The numerics keys whose budgets judge this machine: its own, else every one of its device type."""
    return [key] if key in recorded else sorted(k for k in recorded if device_class(k) == device_class(key))


@dataclass
class Output:
    """One output under golden check: what the run gave and its float64 oracle."""

    out: torch.Tensor
    reference: torch.Tensor
    dtype: torch.dtype
    scale: float = 1.0
    log_domain: bool = False
    abs_budget: bool = False  # regression budget on max abs error instead of max ULP (attention)
    underflow_floor: float = 0.0  # see metrics.compare
    # the max-abs error a correct implementation can have under another summation order (the
    # problem's conditioning, given by the kind): the regression budget never sits below it
    error_floor: float | None = None

    def compare_with(self, ref: torch.Tensor) -> Comparison:
        return compare(self.out, ref, self.dtype, scale=self.scale, log_domain=self.log_domain,
                       underflow_floor=self.underflow_floor)

    def budget_for(self, accepted: Comparison, ref: torch.Tensor) -> Budget:
        if not self.abs_budget:
            return regression_budget(accepted)
        if self.error_floor is not None:
            return regression_budget(accepted, abs_floor_value=self.error_floor)
        top = float(ref[torch.isfinite(ref)].abs().max()) if bool(torch.isfinite(ref).any()) else 0.0
        return regression_budget(accepted, abs_floor_value=abs_floor(top, format_of(self.dtype).mantissa_bits))


@dataclass
class GoldenResult:
    comparisons: dict[str, Comparison] = field(default_factory=dict)
    budgets: dict[str, Budget] = field(default_factory=dict)
    problems: list[tuple[str, str]] = field(default_factory=list)  # (category, sentence)
    error: str | None = None  # the baseline cannot be used: missing, corrupt, inconsistent
    updated: str | None = None  # "old -> new" line when the baseline was (re)written
    note: str | None = None  # the budget came from other machines of the device type
    absent: str | None = None  # why this case has no golden at all (drawn inputs)

    @property
    def comparison(self) -> Comparison | None:
        return next(iter(self.comparisons.values()), None)

    @property
    def budget(self) -> Budget | None:
        return next(iter(self.budgets.values()), None)


@dataclass
class Golden:
    """The baseline store bound to one test key, config and device."""

    store: BaselineStore
    key: str
    config_id: str
    device: str
    update: bool
    update_command: str

    @property
    def budget_key(self) -> str:
        return numerics_key(self.device)

    def speed_record(self, fingerprint: str) -> dict | None:
        """The speed and memory recorded with this golden for a device fingerprint, if any."""
        try:
            meta = self.store.load_meta(self.key, self.config_id)
        except BaselineError:
            return None  # the accuracy check names the damaged file
        return None if meta is None else meta.get("speed", {}).get(fingerprint)

    def record_speed(self, fingerprint: str, entry: dict) -> bool:
        """Store ``entry`` for the fingerprint beside the golden (update flag only); False when
        there is no golden to store it with."""
        try:
            base = self.store.load(self.key, self.config_id)
        except BaselineError:
            return False
        if base is None:
            return False
        meta = dict(base.meta)
        meta["speed"] = {**meta.get("speed", {}), fingerprint: entry}
        self.store.write_meta(self.key, self.config_id, meta)
        return True

    def check(self, out: torch.Tensor, reference: torch.Tensor, *, dtype: torch.dtype | None = None,
              inputs: torch.Tensor | None = None, scale: float = 1.0, log_domain: bool = False,
              seed: int | None = None, input_spec: dict | None = None) -> GoldenResult:
        """One output: compare ``out`` with the stored reference under the regression budget, or
        (update flag) store ``reference`` and the error ``out`` has against it as the new budget."""
        one = Output(out, reference, dtype or out.dtype, scale, log_domain)
        return self.check_outputs({SINGLE: one}, inputs=inputs, seed=seed, input_spec=input_spec)

    def check_outputs(self, outputs: dict[str, Output], *, inputs: torch.Tensor | None = None,
                      seed: int | None = None, input_spec: dict | None = None) -> GoldenResult:
        input_sum = checksum(inputs) if inputs is not None else None
        try:
            base = self.store.load(self.key, self.config_id)
        except BaselineError as e:
            if not self.update:
                return GoldenResult(error=f"{e}\n(the file is left as it is; {UPDATE_OPTION} rewrites it)")
            base = None
        if self.update:
            return self._write(outputs, input_sum, base, seed, input_spec)
        npz, _ = self.store.paths(self.key, self.config_id)
        if base is None:
            return GoldenResult(error=f"no golden baseline at {npz}\nwrite it with: {self.update_command}")
        return self._compare(base, outputs, input_sum)

    def _compare(self, base: Baseline, outputs: dict[str, Output], input_sum) -> GoldenResult:
        stored_sum = base.meta.get("input_checksum")
        if input_sum is not None and stored_sum is not None and stored_sum != input_sum:
            return GoldenResult(error=(
                f"{base.json_path}: the inputs changed since the golden was accepted (checksum "
                f"{stored_sum[:12]} -> {input_sum[:12]}): a generator or input-spec change, not a precision "
                f"regression; check it and re-accept with: {self.update_command}"))
        if set(base.arrays) != set(outputs):
            return GoldenResult(error=(
                f"{base.npz_path}: holds outputs {sorted(base.arrays)}, this check has {sorted(outputs)}; "
                f"re-accept with: {self.update_command}"))
        key = self.budget_key
        recorded = base.meta.get("budgets", {})
        sources = budget_sources(recorded, key)
        if not sources:
            return GoldenResult(error=(
                f"{base.json_path}: no accepted budget for '{key}' nor any {device_class(key)} machine (has: "
                f"{', '.join(recorded) or 'none'}); accept with: {self.update_command}"))
        result = GoldenResult()
        if sources != [key]:
            result.note = (f"no budget recorded for {key}: judged by the widest recorded for "
                           f"{', '.join(sources)}; record this machine's with: {self.update_command}")
        for name, o in outputs.items():
            ref = base.arrays[name]
            if tuple(ref.shape) != tuple(o.out.shape):
                return GoldenResult(error=(
                    f"{base.npz_path}: shape mismatch for {name}, golden {tuple(ref.shape)} vs output "
                    f"{tuple(o.out.shape)}; re-accept with: {self.update_command}"))
            try:
                budget = Budget.widest([Budget.from_dict(recorded[k]["outputs"][name]["budget"]) for k in sources])
            except (KeyError, TypeError) as e:
                return GoldenResult(error=f"{base.json_path}: corrupt budget for '{name}' under {', '.join(sources)} ({e!r})")
            cmp = o.compare_with(ref)
            result.comparisons[name], result.budgets[name] = cmp, budget
            prefix = "" if name == SINGLE else f"{name}: "
            result.problems += [(cat, prefix + s) for cat, s in violations(cmp, budget)]
        return result

    def _write(self, outputs: dict[str, Output], input_sum, old: Baseline | None, seed, input_spec) -> GoldenResult:
        refs = {n: o.reference.detach().to(torch.float32).cpu() for n, o in outputs.items()}
        result = GoldenResult()
        entries = {}
        for name, o in outputs.items():
            cmp = o.compare_with(refs[name])
            budget = o.budget_for(cmp, refs[name])
            result.comparisons[name], result.budgets[name] = cmp, budget
            entries[name] = {"budget": budget.as_dict(), "accepted": cmp.summary()}
        same_outputs = old is not None and set(old.arrays) == set(refs) and all(
            old.arrays[n].shape == refs[n].shape for n in refs)
        meta = dict(old.meta) if same_outputs else {}
        meta.pop("schema_version", None)
        budgets = dict(meta.get("budgets", {}))
        key = self.budget_key
        old_entries = budgets.get(key, {}).get("outputs", {})
        budgets[key] = {"outputs": entries, "torch": torch.__version__, "machine": machine_name(self.device)}
        meta.update({
            "key": self.key, "config": self.config_id,
            "dtypes": {n: c.dtype for n, c in result.comparisons.items()},
            "written_on": key, "torch": torch.__version__, "seed": seed,
            "input_spec": input_spec, "input_checksum": input_sum, "budgets": budgets,
        })
        self.store.write(self.key, self.config_id, refs, meta)
        result.updated = self._change_line(old_entries, entries)
        return result

    def _change_line(self, old: dict, new: dict) -> str:
        head = f"{self.key} [{self.config_id}] on {self.budget_key}"
        if not old:
            return f"{head} new: " + "; ".join(_label(n) + Budget.from_dict(e["budget"]).describe() for n, e in new.items())
        moved = []
        for name, e in new.items():
            before = old.get(name, {}).get("budget", {})
            moved += [f"{_label(name)}{k} {before.get(k)!r} -> {v!r}" for k, v in e["budget"].items() if before.get(k) != v]
        return f"{head} changed: {', '.join(moved)}" if moved else f"{head} unchanged"


def _label(name: str) -> str:
    return "" if name == SINGLE else f"{name} "

