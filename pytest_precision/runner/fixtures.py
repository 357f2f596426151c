"""Fixtures for users' own tests: ``precision_config`` (parametrised over the selected matrix) and
``golden`` (the baseline store bound to the current test and config). Under the update flag the
goldens a test checked are written when the test ends, and only when it passed."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from ..baselines.entry import BaselineResult
from ..baselines.lifecycle import BaselineCheck
from ..kinds.outcome import PrecisionFailure
from ..numerics.configs import Config, Prepared
from .options import OPTIONS_KEY

__all__ = ["ActiveConfig", "GoldenFixture", "parametrize_precision_config", "precision_config", "golden", "CALL_REPORT"]

# the test's call report (plugin.py's makereport hook), read by the golden fixture at teardown
CALL_REPORT = pytest.StashKey[pytest.TestReport]()


@dataclass
class ActiveConfig:
    """A config bound to the run's device: ``with precision_config:`` enters it."""

    config: Config
    device: str

    @property
    def id(self) -> str:
        return self.config.id

    def prepare(self, x: torch.Tensor) -> Prepared:
        """Inputs as the config feeds them (``.value``) and the same values in float64 (``.exact``)."""
        return self.config.prepare(x, self.device)

    def __enter__(self):
        self._cm = self.config.active(self.device)
        self._cm.__enter__()
        return self

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


def parametrize_precision_config(metafunc: pytest.Metafunc) -> None:
    session = metafunc.config.stash[OPTIONS_KEY]
    metafunc.parametrize("precision_config", session.configs, ids=[c.id for c in session.configs], indirect=True)


@pytest.fixture
def precision_config(request) -> ActiveConfig:
    session = request.config.stash[OPTIONS_KEY]
    config: Config = request.param
    reason = config.skip_reason(session.device)
    if reason:
        pytest.skip(reason)
    return ActiveConfig(config, session.device)


class GoldenFixture:
    """``golden.check(out, reference, inputs=x)``: fails the test when ``out`` regressed against
    its accepted golden, or writes the golden under ``--precision-update-baselines``."""

    def __init__(self, baseline: BaselineCheck, nodeid: str):
        self._golden, self._nodeid = baseline, nodeid
        self.results: list[BaselineResult] = []
        self._checks: list[BaselineCheck] = [baseline]  # every golden this test checked (name= adds one)

    def check(self, out: torch.Tensor, reference: torch.Tensor, *, inputs: torch.Tensor | None = None,
              dtype: torch.dtype | None = None, log_domain: bool = False, name: str | None = None) -> BaselineResult:
        __tracebackhide__ = True  # the failure is the message, not this frame
        g = self._golden
        if name is not None:  # several goldens in one test
            g = BaselineCheck(g.store, f"{g.key}/{name}", g.config_id, g.device, g.update, g.update_command, g.strict,
                              g.add_machine)
            self._checks.append(g)
        res = g.check_output(out, reference, inputs=inputs, dtype=dtype, log_domain=log_domain)
        self.results.append(res)
        if res.error:
            raise PrecisionFailure(f"{self._nodeid}: golden baseline: {res.error}")
        if res.problems:
            head = f"{self._nodeid}: regressed against its golden ({'; '.join(s for _, s in res.problems)})"
            raise PrecisionFailure("\n".join([head, *res.message_lines(g.update_command, brief=False)]))
        return res

    def settle(self, passed: bool) -> None:
        """Write the goldens this test prepared (the update flag, or this machine's budgets added) when
        it passed; else none."""
        for g in self._checks:
            if passed:
                g.commit()
            else:
                g.refuse("the test did not pass")
        errors = [r.error for r in self.results if r.error and r.updated is None and not r.refused]
        if passed and errors:
            raise PrecisionFailure(f"{self._nodeid}: golden baseline: {errors[0]}")


def _drop_id(params: str, config_id: str) -> str:
    """The parameter id string without the config's own id ("amp-fp16-3" -> "3")."""
    parts = f"-{params}-".replace(f"-{config_id}-", "-", 1)
    return parts.strip("-")


def _test_key(request) -> tuple[str, str]:
    """(baseline key, config id) of a test: its node id with the config id taken out."""
    uses_config = "precision_config" in request.fixturenames
    config_id = request.getfixturevalue("precision_config").id if uses_config else "default"
    path, _, name = request.node.nodeid.partition("::")
    base, bracket, params = name.partition("[")
    if bracket:
        params = params[:-1]
        if uses_config:
            params = _drop_id(params, config_id)
        name = f"{base}[{params}]" if params else base
    return f"{path.removesuffix('.py')}/{name}", config_id


@pytest.fixture
def golden(request):
    session = request.config.stash[OPTIONS_KEY]
    key, config_id = _test_key(request)
    cmd = session.update_command(nodeid=request.node.nodeid)
    fixture = GoldenFixture(BaselineCheck(session.store, key, config_id, session.device, session.update, cmd,
                                          strict=session.strict_budgets, add_machine=session.add_machine),
                            request.node.nodeid)
    yield fixture
    report = request.node.stash.get(CALL_REPORT, None)
    fixture.settle(passed=report is not None and report.passed)
