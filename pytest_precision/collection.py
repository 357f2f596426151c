"""The suite's pytest items: one per suite x target x config x regime, with stable ids."""
from __future__ import annotations

from pathlib import Path

import pytest

from .case_details import case_details
from .checking import PrecisionFailure
from .alignment import tensor_core_misalignments, warn_misalignments
from .audit import audit
from .tracing import render_trace, trace
from .golden import Golden
from .session import SESSION_KEY, PrecisionSession
from .speed import check_speed
from .targets import Target, TargetError, registered

__all__ = ["SuiteCollector", "SuiteItem", "suite_targets"]


def suite_targets(suite, session: PrecisionSession) -> list[Target]:
    """Registered (and ini) targets of the suite's kinds; the suite's defaults when there are none."""
    mine = [t for t in registered() + session.ini_targets if t.kind in suite.KINDS]
    return mine or suite.default_targets()


class SuiteCollector(pytest.Collector):
    """Parent of the suite items (node id prefix ``precision-suite``)."""

    def collect(self):
        from pytest_precision.suites import SUITES

        session: PrecisionSession = self.config.stash[SESSION_KEY]
        items = []
        for suite in SUITES.values():
            for target in suite_targets(suite, session):
                for config in (suite.configs(session) if hasattr(suite, "configs") else session.configs):
                    for variant in suite.variants(session.device):
                        for regime in getattr(suite, "REGIME_NAMES", suite.REGIMES):
                            name = f"{target.kind}[{target.name}-{config.id}{variant}-{regime}]"
                            items.append(SuiteItem.from_parent(self, name=name, suite=suite, target=target,
                                                               config_=config, regime=regime, variant=variant))
        return items


class SuiteItem(pytest.Item):
    def __init__(self, *, suite, target: Target, config_, regime: str, variant: str = "", **kw):
        super().__init__(**kw)
        self.suite, self.target, self.precision_config, self.regime = suite, target, config_, regime
        self.variant = variant
        self.add_marker("precision")
        self.add_marker("precision_suite")
        self.outcome = None

    def runtest(self) -> None:
        session: PrecisionSession = self.config.stash[SESSION_KEY]
        reason = self.precision_config.skip_reason(session.device)
        if reason:  # recorded, so the summary shows the config as skipped rather than dropping it
            session.records.append({"target": self.target.name, "config": self.precision_config.id + self.variant,
                                    "regime": self.regime, "skipped": reason, "suite": self.suite.NAME,
                                    "nodeid": self.nodeid})
            pytest.skip(reason)
        key = f"{self.target.kind}/{self.target.name}/{self.regime}"
        golden = Golden(session.store, key, self.precision_config.id + self.variant, session.device, session.update,
                        session.update_command(suite_item=self.name,
                                               config_id=getattr(self.precision_config, "base", self.precision_config.id)))
        outcome = self.suite.run_case(self.target, self.precision_config, self.regime, session.device, golden,
                                      self.variant)
        record = outcome.record()
        if session.speed and hasattr(self.suite, "bench_call"):
            self._time(session, golden, outcome, record)
        if session.trace or (session.audit and self.regime == getattr(self.suite, "AUDIT_REGIME", None)):
            self._trace(session, outcome, record)
        details = outcome.report_details() if hasattr(outcome, "report_details") else case_details(outcome, self._logits())
        record.update(details, nodeid=self.nodeid)
        self.outcome = outcome
        session.records.append(record)
        if not outcome.passed:
            raise PrecisionFailure(outcome.message(self.nodeid, golden.update_command))

    def _time(self, session: PrecisionSession, golden: Golden, outcome, record: dict) -> None:
        """The speed gate and the tensor-core lint for this case (DESIGN 5); adds to the outcome."""
        def make_bench():
            return self.suite.bench_call(self.target, self.precision_config, self.regime, session.device,
                                         self.variant)
        bench = make_bench()
        if bench is None:  # drawn inputs: nothing of fixed size to time
            return
        if self.precision_config.tensor_core_dtypes:
            warn_misalignments(tensor_core_misalignments(bench), self.name)
        speed = check_speed(make_bench, session.device, golden, session.speed_threshold, session.fingerprint, bench)
        del bench
        outcome.problems += [(cat, cat, s) for cat, s in speed.problems()]
        if speed.verdict.status == "noisy":  # a slower verdict is in the headline already
            outcome.details.append(speed.verdict.describe())
        record.update(speed.record(), passed=outcome.passed, categories=outcome.categories)

    def _trace(self, session: PrecisionSession, outcome, record: dict) -> None:
        """--precision-trace: the case's ops; --precision-audit: the dtypes they ran in (once per
        target and config, on the suite's audit regime). Kept in the record, so xdist merges it."""
        call = self.suite.trace_call(self.target, self.precision_config, self.regime, session.device, self.variant)
        if call is None:
            return
        record["case"] = self.name
        if session.trace:
            record["trace"] = render_trace(trace(call))
            if not outcome.passed:
                outcome.details.append("op trace:\n" + record["trace"])
        if session.audit and self.regime == self.suite.AUDIT_REGIME:
            record["audit"] = audit(call, autocast=self.precision_config.autocast_dtype is not None)

    def _logits(self):
        """The case's logits for the error-by-magnitude profile: softmax kinds on fixed inputs only."""
        regimes = getattr(self.suite, "REGIMES", {})
        if self.target.kind in ("softmax", "log_softmax") and self.regime in regimes:
            return regimes[self.regime].inputs()
        return None

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, PrecisionFailure):
            return str(excinfo.value)
        if isinstance(excinfo.value, TargetError):
            cause = excinfo.value.__cause__
            tb = "" if cause is None else "\n" + str(super().repr_failure(pytest.ExceptionInfo.from_exception(cause)))
            return f"{self.nodeid}: {excinfo.value}{tb}"
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return Path(self.suite.__file__), 0, self.nodeid
