"""The golden check: compare an output with its accepted baseline, or write a new baseline.

Used by the suites and by the ``golden`` fixture. The reference is the float64 oracle on the
config's rounded inputs, stored as float32 (DESIGN 2.1, 2.2); the accepted budgets are keyed by
device type. Nothing is written without the update flag; a missing baseline fails and says the
command that writes it.
"""
from __future__ import annotations

import platform
from dataclasses import dataclass, field

import torch

from .baselines import UPDATE_OPTION, Baseline, BaselineError, BaselineStore, checksum
from .budgets import Budget, regression_budget, violations
from .metrics import Comparison, compare

__all__ = ["Golden", "GoldenResult"]


@dataclass
class GoldenResult:
    comparison: Comparison | None = None
    budget: Budget | None = None
    problems: list[tuple[str, str]] = field(default_factory=list)  # (category, sentence)
    error: str | None = None  # the baseline cannot be used: missing, corrupt, inconsistent
    updated: str | None = None  # "old -> new" line when the baseline was (re)written


@dataclass
class Golden:
    """The baseline store bound to one test key, config and device."""

    store: BaselineStore
    key: str
    config_id: str
    device: str
    update: bool
    update_command: str

    def check(
        self,
        out: torch.Tensor,
        reference: torch.Tensor,
        *,
        dtype: torch.dtype | None = None,
        inputs: torch.Tensor | None = None,
        scale: float = 1.0,
        log_domain: bool = False,
        seed: int | None = None,
        input_spec: dict | None = None,
    ) -> GoldenResult:
        """Compare ``out`` with the stored reference under the regression budget, or (update
        flag) store ``reference`` and the error ``out`` has against it as the new budget."""
        dtype = dtype or out.dtype
        input_sum = checksum(inputs) if inputs is not None else None
        try:
            base = self.store.load(self.key, self.config_id)
        except BaselineError as e:
            if not self.update:
                return GoldenResult(error=f"{e}\n(the file is left as it is; {UPDATE_OPTION} rewrites it)")
            base = None
        if self.update:
            return self._write(out, reference, dtype, scale, log_domain, input_sum, base, seed, input_spec)
        npz, _ = self.store.paths(self.key, self.config_id)
        if base is None:
            return GoldenResult(error=f"no golden baseline at {npz}\nwrite it with: {self.update_command}")
        return self._compare(base, out, dtype, scale, log_domain, input_sum)

    def _compare(self, base: Baseline, out, dtype, scale, log_domain, input_sum) -> GoldenResult:
        stored_sum = base.meta.get("input_checksum")
        if input_sum is not None and stored_sum is not None and stored_sum != input_sum:
            return GoldenResult(error=(
                f"{base.json_path}: the inputs changed since the golden was accepted (checksum "
                f"{stored_sum[:12]} -> {input_sum[:12]}): a generator or input-spec change, not a precision "
                f"regression; check it and re-accept with: {self.update_command}"))
        if tuple(base.reference.shape) != tuple(out.shape):
            return GoldenResult(error=(
                f"{base.npz_path}: shape mismatch, golden reference {tuple(base.reference.shape)} vs output "
                f"{tuple(out.shape)}; re-accept with: {self.update_command}"))
        budget_d = base.budgets_for(self.device)
        if budget_d is None:
            return GoldenResult(error=(
                f"{base.json_path}: no accepted budget for device '{self.device}' (has: "
                f"{', '.join(base.meta.get('budgets', {})) or 'none'}); accept with: {self.update_command}"))
        try:
            budget = Budget.from_dict(budget_d["budget"])
        except (KeyError, TypeError) as e:
            return GoldenResult(error=f"{base.json_path}: corrupt budget for device '{self.device}' ({e!r})")
        cmp = compare(out, base.reference, dtype, scale=scale, log_domain=log_domain)
        return GoldenResult(cmp, budget, violations(cmp, budget))

    def _write(self, out, reference, dtype, scale, log_domain, input_sum, old: Baseline | None, seed, input_spec) -> GoldenResult:
        ref32 = reference.detach().to(torch.float32).cpu()
        cmp = compare(out, ref32, dtype, scale=scale, log_domain=log_domain)
        budget = regression_budget(cmp)
        meta = dict(old.meta) if old is not None and old.reference.shape == ref32.shape else {}
        meta.pop("schema_version", None)
        budgets = dict(meta.get("budgets", {}))
        old_budget = budgets.get(self.device, {}).get("budget")
        budgets[self.device] = {
            "budget": budget.as_dict(),
            "accepted": cmp.summary(),
            "torch": torch.__version__,
            "machine": _machine(self.device),
        }
        meta.update({
            "key": self.key,
            "config": self.config_id,
            "dtype": cmp.dtype,
            "written_on": self.device,
            "torch": torch.__version__,
            "seed": seed,
            "input_spec": input_spec,
            "input_checksum": input_sum,
            "budgets": budgets,
        })
        self.store.write(self.key, self.config_id, ref32, meta)
        new = budget.as_dict()
        if old_budget is None:
            line = f"{self.key} [{self.config_id}] new: max ULP {new['max_ulp']:.4g}"
        elif old_budget == new:
            line = f"{self.key} [{self.config_id}] unchanged: max ULP {new['max_ulp']:.4g}"
        else:
            moved = ", ".join(f"{k} {old_budget.get(k)!r} -> {v!r}" for k, v in new.items() if old_budget.get(k) != v)
            line = f"{self.key} [{self.config_id}] changed: {moved}"
        return GoldenResult(cmp, budget, [], updated=line)


def _machine(device: str) -> str:
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()
