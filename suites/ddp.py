"""The training suite's DDP cases (configs ``ddp-fp16`` and ``ddp-bf16``): a target's gradients
all-reduced through DDP's fp16 or bf16 compression hook against uncompressed DDP, on the real
engine (pytest_precision.distributed: two processes, gloo on the CPU, nccl on GPUs).

A case fails when a compressed gradient is not finite where the uncompressed one is; when more
than 5 % of a parameter's gradients underflow to 0 in the hook's dtype; when the SQNR of the
gradients is below what the format's precision gives a correct all-reduce (6.02 dB per mantissa
bit, less 6 dB for the 16-bit sum and the division by the world size: 54 dB for fp16, 36 dB for
bf16); and against the golden (the accepted underflow rate plus 2 points, the accepted SQNR less
6 dB, the accepted overflow count).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from pytest_precision.devices import device_class, machine_name
from pytest_precision.distributed import DDPComparisonError, HookComparison, compare_ddp_hooks
from pytest_precision.formats import format_of
from pytest_precision.golden import Golden, GoldenResult
from pytest_precision.targets import TargetError
from pytest_precision.suites.training import Verdicts
from pytest_precision.training import TrainConfig, TrainSpec
from pytest_precision.trajectory_golden import (OUTPUT, RATE_SLACK, budget_sources, load_baseline, message_lines,
                                                rates_line)

__all__ = ["DDPOutcome", "run_ddp_case", "sqnr_floor_db"]

UNDERFLOW_LIMIT = 0.05
SQNR_SLACK_DB = 6.0

# spec -> {device: {hook: HookComparison} or the reason the spec cannot run under DDP}; one group
# of processes serves both hooks; weak, as training._REFERENCES
_RESULTS: "weakref.WeakKeyDictionary[TrainSpec, dict]" = weakref.WeakKeyDictionary()


def sqnr_floor_db(dtype: torch.dtype) -> float:
    """The least SQNR a correct compressed all-reduce keeps (the module docstring)."""
    return 6.02 * format_of(dtype).mantissa_bits - SQNR_SLACK_DB


def _comparisons(spec: TrainSpec, device: str, where: str) -> dict | str:
    runs = _RESULTS.setdefault(spec, {})
    if device not in runs:
        try:
            runs[device] = compare_ddp_hooks(spec, device=device)
        except TypeError as e:  # callables the spawned processes cannot import
            runs[device] = str(e)
        except DDPComparisonError as e:
            raise TargetError(f"{where}: {e}") from e
    return runs[device]


@dataclass
class DDPOutcome(Verdicts):
    suite: str
    target: str
    config: str
    regime: str
    train_config: TrainConfig
    result: HookComparison
    golden: GoldenResult
    problems: list[tuple[str, str, str]] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    fault: None = None

    def _worst(self) -> tuple[str, float]:
        rates = self.result.underflow_rate
        name = max(rates, key=lambda n: (rates[n], n)) if rates else None
        return (name, rates[name]) if name is not None and rates[name] > 0 else ("-", 0.0)

    def summary(self) -> dict:
        name, rate = self._worst()
        return {"steps": 1, "max_loss_deviation": None, "grad_sqnr_db": self.result.grad_sqnr_db,
                "param_sqnr_db": None, "max_underflow_rate": rate, "underflow_param": name,
                "max_update_lost_rate": 0.0, "update_lost_param": "-", "update_ratio": None, "skipped_steps": [],
                "first_nonfinite": None, "step_time_s": None, "fp32_step_time_s": None,
                "ddp": self.result.as_dict()}

    def record(self) -> dict:
        return {"suite": self.suite, "target": self.target, "config": self.config, "regime": self.regime,
                "passed": self.passed, "categories": self.categories, "baseline_update": self.golden.updated,
                "borrowed_budget": self.golden.note is not None, "training": self.summary()}

    def report_details(self) -> dict:
        return {"headline": self.headline(),
                "golden_note": self.golden.error.splitlines()[0] if self.golden.error else self.golden.note}

    def message(self, nodeid: str, update_command: str) -> str:
        r, c = self.result, self.train_config
        lines = [f"{nodeid}: {self.headline()}", f"  {c.id}: {c.description}:"]
        lines.append(f"    gradients: SQNR {r.grad_sqnr_db:.4g} dB (floor {sqnr_floor_db(c.compute_dtype):.4g} dB), max rel "
                     f"{r.max_rel:.4g}, overflow {r.overflow}, norm {r.grad_norm:.4g} vs {r.ref_grad_norm:.4g} uncompressed")
        lines.append(rates_line("gradient-underflow rate (0 with the hook, nonzero without)", r.underflow_rate))
        return "\n".join(lines + message_lines(self.golden, update_command))


def _accepted(r: HookComparison) -> dict:
    rate = max(r.underflow_rate.values(), default=0.0)
    return {"grad_sqnr_db": r.grad_sqnr_db, "max_underflow_rate": rate, "overflow": r.overflow}


def _check_golden(golden: Golden, config: TrainConfig, r: HookComparison) -> GoldenResult:
    """The DDP case's golden: accepted metrics per numerics key (no tensors: the npz holds the
    uncompressed gradient norm, so the baseline tools see one file pair per case as elsewhere)."""
    store, key, cid, nk = golden.store, golden.key, golden.config_id, golden.budget_key
    acc = _accepted(r)
    base, unusable = load_baseline(golden)
    if unusable:
        return unusable
    if golden.update:
        budget = {"min_grad_sqnr_db": acc["grad_sqnr_db"] - SQNR_SLACK_DB,
                  "max_underflow_rate": min(1.0, acc["max_underflow_rate"] + RATE_SLACK), "overflow": acc["overflow"]}
        budgets = dict(base.meta.get("budgets", {})) if base is not None else {}
        budgets[nk] = {"outputs": {OUTPUT: {"budget": budget, "accepted": acc}}, "torch": torch.__version__,
                       "machine": machine_name(golden.device)}
        store.write(key, cid, {"ref_grad_norm": torch.tensor([r.ref_grad_norm])}, {
            "key": key, "config": cid, "dtypes": {OUTPUT: str(config.compute_dtype).replace("torch.", "")},
            "written_on": nk, "torch": torch.__version__, "budgets": budgets})
        res = GoldenResult()
        res.updated = (f"{key} [{cid}] on {nk}: SQNR >= {budget['min_grad_sqnr_db']:.4g} dB, underflow rate <= "
                       f"{100 * budget['max_underflow_rate']:.1f} %, overflow <= {budget['overflow']}")
        return res
    if base is None:
        npz, _ = store.paths(key, cid)
        return GoldenResult(error=f"no golden baseline at {npz}\nwrite it with: {golden.update_command}")
    recorded = base.meta.get("budgets", {})
    sources = budget_sources(recorded, nk)
    if not sources:
        return GoldenResult(error=(f"{base.json_path}: no accepted budget for '{nk}' nor any {device_class(nk)} "
                                   f"machine; accept with: {golden.update_command}"))
    try:
        bs = [recorded[k]["outputs"][OUTPUT]["budget"] for k in sources]
        budget = {"min_grad_sqnr_db": min(b["min_grad_sqnr_db"] for b in bs),
                  "max_underflow_rate": max(b["max_underflow_rate"] for b in bs),
                  "overflow": max(b["overflow"] for b in bs)}
    except (KeyError, TypeError, ValueError) as e:
        return GoldenResult(error=f"{base.json_path}: corrupt DDP budget under {', '.join(sources)} ({e!r})")
    res = GoldenResult()
    if sources != [nk]:
        res.note = (f"no budget recorded for {nk}: judged by the widest recorded for {', '.join(sources)}; "
                    f"record this machine's with: {golden.update_command}")
    if not acc["grad_sqnr_db"] >= budget["min_grad_sqnr_db"]:
        res.problems.append(("accuracy", f"gradient SQNR {acc['grad_sqnr_db']:.4g} dB < budget {budget['min_grad_sqnr_db']:.4g} dB"))
    if acc["max_underflow_rate"] > budget["max_underflow_rate"]:
        res.problems.append(("underflow", f"gradient-underflow rate {100 * acc['max_underflow_rate']:.1f} % > budget "
                                          f"{100 * budget['max_underflow_rate']:.1f} %"))
    if acc["overflow"] > budget["overflow"]:
        res.problems.append(("overflow", f"overflow {acc['overflow']} > {budget['overflow']} allowed"))
    return res


def run_ddp_case(spec: TrainSpec, target_name: str, config: TrainConfig, regime: str, device: str,
                 golden: Golden, suite: str) -> DDPOutcome:
    import pytest

    where = f"target {target_name!r} (train_step) under config {config.id}"
    results = _comparisons(spec, device, where)
    if isinstance(results, str):
        pytest.skip(f"{target_name}: {results}")
    r = results[config.ddp_hook]
    outcome = DDPOutcome(suite, target_name, config.id, regime, config, r, _check_golden(golden, config, r))
    add = outcome.problems.append
    if r.overflow:
        add(("oracle", "overflow", f"{r.overflow} gradient elements not finite with the hook, finite without"))
    name, rate = outcome._worst()
    if rate > UNDERFLOW_LIMIT:
        add(("oracle", "underflow", f"gradient-underflow rate {100 * rate:.1f} % in {name} > {100 * UNDERFLOW_LIMIT:g} % allowed"))
    floor = sqnr_floor_db(config.compute_dtype)
    if not r.overflow and not r.grad_sqnr_db >= floor:
        add(("oracle", "accuracy", f"gradient SQNR {r.grad_sqnr_db:.4g} dB < {floor:.4g} dB, what {config.ddp_hook} "
                                   "keeps in a correct all-reduce"))
    g = outcome.golden
    if g.error:
        add(("golden", "baseline", g.error.splitlines()[0]))
    for cat, s in g.problems:
        add(("golden", "regression" if cat == "accuracy" else cat, f"golden: {s}"))
    return outcome
