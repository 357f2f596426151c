"""The suite's pytest items: one per kind x target x config x variant x regime, with stable ids
(``precision-suite::softmax[torch.softmax-fp32-unit]``)."""
from __future__ import annotations

from pathlib import Path

import pytest

from ..baselines.lifecycle import BaselineCheck
from ..explain.audit import audit
from ..explain.tracing import render_trace, trace
from ..kinds.base import Case, Kind
from ..kinds.outcome import PrecisionFailure
from ..kinds.registry import kinds, registered
from ..kinds.target import Target, TargetError
from ..speed.alignment import tensor_core_misalignments, warn_misalignments
from ..speed.gate import check_speed
from .options import OPTIONS_KEY, RECORDS_KEY, RunOptions

__all__ = ["SuiteCollector", "SuiteItem", "suite_targets", "suites"]


def suites() -> dict[str, list[Kind]]:
    """The kinds grouped by suite (the report group), in the registry's order."""
    out: dict[str, list[Kind]] = {}
    for kind in kinds():
        out.setdefault(kind.suite, []).append(kind)
    return out


def suite_targets(suite_kinds: list[Kind], options: RunOptions) -> list[Target]:
    """Registered (and ini) targets of the suite's kinds, in registration order; the kinds' default
    targets when there are none (torch's ops before the project's kernels)."""
    names = {k.name for k in suite_kinds}
    mine = [t for t in registered() + options.ini_targets if t.kind in names]
    if mine:
        return mine
    defaults = [t for k in suite_kinds for t in k.default_targets()]
    return sorted(defaults, key=lambda t: t.origin != "built-in")


class SuiteCollector(pytest.Collector):
    """Parent of the suite items (node id prefix ``precision-suite``)."""

    def collect(self):
        options: RunOptions = self.config.stash[OPTIONS_KEY]
        items = []
        for suite_kinds in suites().values():
            by_name = {k.name: k for k in suite_kinds}
            for target in suite_targets(suite_kinds, options):
                kind = by_name[target.kind]
                for config in kind.configs(options.configs):
                    for variant in kind.variants(options.device):
                        for regime in kind.regime_names():
                            case = Case(kind, target, config, variant, regime, options.device)
                            items.append(SuiteItem.from_parent(self, name=case.name, case=case))
        return items


class SuiteItem(pytest.Item):
    def __init__(self, *, case: Case, **kw):
        super().__init__(**kw)
        self.case = case
        self.add_marker("precision")
        self.add_marker("precision_suite")
        self.outcome = None

    def runtest(self) -> None:
        options: RunOptions = self.config.stash[OPTIONS_KEY]
        records: list = self.config.stash[RECORDS_KEY]
        case = self.case
        reason = case.config.skip_reason(options.device)
        if reason:  # recorded, so the summary shows the config as skipped rather than dropping it
            records.append({"target": case.target.name, "config": case.config_id, "regime": case.regime,
                            "skipped": reason, "suite": case.kind.suite, "kind": case.kind.name, "nodeid": self.nodeid})
            pytest.skip(reason)
        baseline = BaselineCheck(options.store, case.baseline_key, case.config_id, options.device, options.update,
                                 options.update_command(suite_item=self.name,
                                                        config_id=getattr(case.config, "base", case.config.id)))
        outcome = case.kind.run(case, baseline)
        record = outcome.record()
        if options.speed:
            self._time(options, baseline, outcome, record)
        if options.trace or (options.audit and case.regime == case.kind.audit_regime):
            self._trace(options, outcome, record)
        record["nodeid"] = self.nodeid
        if options.details:
            record.update(outcome.report_details())
        self.outcome = outcome
        records.append(record)
        if not outcome.passed:
            raise PrecisionFailure(outcome.message(self.nodeid, baseline.update_command))

    def _time(self, options: RunOptions, baseline: BaselineCheck, outcome, record: dict) -> None:
        """The speed gate and the tensor-core lint for this case; adds to the outcome."""
        case = self.case
        bench = case.kind.bench_call(case)
        if bench is None:  # nothing of fixed size to time
            return
        if getattr(case.config, "tensor_core_dtypes", False):
            warn_misalignments(tensor_core_misalignments(bench), self.name)
        speed = check_speed(lambda: case.kind.bench_call(case), options.device, baseline, options.speed_threshold,
                            options.fingerprint, bench)
        del bench
        for category, sentence in speed.problems():
            outcome.add(category, category, sentence)
        if speed.verdict.status == "noisy":  # a slower verdict is in the headline already
            outcome.details.append(speed.verdict.describe())
        record.update(speed.record(), passed=outcome.passed, categories=outcome.categories)

    def _trace(self, options: RunOptions, outcome, record: dict) -> None:
        """--precision-trace: the case's ops; --precision-audit: the dtypes they ran in (once per
        target and config, on the kind's audit regime). Kept in the record, so xdist merges it."""
        case = self.case
        call = case.kind.trace_call(case)
        if call is None:
            return
        record["case"] = self.name
        if options.trace:
            record["trace"] = render_trace(trace(call))
            if not outcome.passed:
                outcome.details.append("op trace:\n" + record["trace"])
        if options.audit and case.regime == case.kind.audit_regime:
            record["audit"] = audit(call, autocast=getattr(case.config, "autocast_dtype", None) is not None)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, PrecisionFailure):
            return str(excinfo.value)
        if isinstance(excinfo.value, TargetError):
            cause = excinfo.value.__cause__
            tb = "" if cause is None else "\n" + str(super().repr_failure(pytest.ExceptionInfo.from_exception(cause)))
            return f"{self.nodeid}: {excinfo.value}{tb}"
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return Path(self.case.kind.source_file), 0, self.nodeid
