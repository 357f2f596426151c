"""Whose a golden is: the case it names and the machines it holds budgets for.

A golden copied or renamed from another config or target is not judged as this case's, and an update
rewrites it keeping nothing of the other's. ``--precision-add-machine`` adds a machine's budgets to
existing goldens (a first run on a new GPU, ``.ci/gpu``), simulated here with another numerics key:
the tensors and the other machines' budgets stay as they were, bit for bit; a failing case, a golden
that already holds the key and a case without a golden write nothing."""
import json
from pathlib import Path

import pytest

from sample_targets import CORRECT_SOFTMAX_CONFTEST as CONFTEST

pytest_plugins = ["pytester"]

ARGS = ("--precision-suite", "--precision-configs=fp32,bf16", "--precision-no-speed", "-p", "no:cacheprovider",
        "-k", "softmax and mine and unit")
SIMULATED = "cuda-sm90"


def _simulate_another_machine(monkeypatch) -> None:
    """This process's goldens keyed as another machine's (an H100's) from now on."""
    import pytest_precision.baselines.lifecycle as lifecycle

    monkeypatch.setattr(lifecycle, "numerics_key", lambda device: SIMULATED)
    monkeypatch.setattr(lifecycle, "machine_name", lambda device: "NVIDIA H100 80GB HBM3 (simulated)")


def _accepted(pytester) -> Path:
    """The correct softmax's goldens written (fp32, bf16; unit regime): their directory."""
    pytester.makeconftest(CONFTEST)
    pytester.runpytest(*ARGS, "--precision-update-baselines").assert_outcomes(passed=2)
    return pytester.path / "precision_baselines/softmax/mine/unit"


def _copy_pair(directory: Path, source: str, target: str) -> None:
    for ext in ("npz", "json"):
        (directory / f"{target}.{ext}").write_bytes((directory / f"{source}.{ext}").read_bytes())


def _files(pytester) -> dict:
    return {p.relative_to(pytester.path).as_posix(): p.read_bytes()
            for p in sorted((pytester.path / "precision_baselines").rglob("*")) if p.is_file()}


def test_a_machines_budgets_are_added_and_nothing_else_changes(pytester, monkeypatch):
    _accepted(pytester)
    before = _files(pytester)
    assert sorted(before) == [f"precision_baselines/softmax/mine/unit/{c}.{e}" for c in ("bf16", "fp32")
                              for e in ("json", "npz")]

    _simulate_another_machine(monkeypatch)
    result = pytester.runpytest(*ARGS, "--precision-add-machine")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([f"*mine* [[]fp32[]] on {SIMULATED} added: *; kept the tensors and the budgets of cpu-*"])
    after = _files(pytester)
    for name, data in before.items():
        if name.endswith(".npz"):
            assert after[name] == data, f"{name}: the tensors were rewritten"
            continue
        old, new = json.loads(data), json.loads(after[name])
        assert set(new["budgets"]) == set(old["budgets"]) | {SIMULATED}, name
        assert new["budgets"][SIMULATED]["machine"] == "NVIDIA H100 80GB HBM3 (simulated)"
        new["budgets"].pop(SIMULATED)
        assert new == old, f"{name}: a field other than the added key changed"

    # the key is there now: a second run leaves every file as it is
    pytester.runpytest(*ARGS, "--precision-add-machine").assert_outcomes(passed=2)
    assert _files(pytester) == after


def test_a_failing_case_and_a_missing_golden_gain_no_key(pytester, monkeypatch):
    _accepted(pytester)
    before = _files(pytester)
    _simulate_another_machine(monkeypatch)
    # the planted defect: every probability 5 % high, far past every budget
    pytester.makeconftest(CONFTEST.replace("return (e / e.sum(-1, keepdim=True)).to(x.dtype)",
                                           "return (e / e.sum(-1, keepdim=True) * 1.05).to(x.dtype)"))
    pytester.runpytest(*ARGS, "--precision-add-machine").assert_outcomes(failed=2)
    assert _files(pytester) == before

    # no golden: nothing to add a key to, nothing written
    (pytester.path / "precision_baselines").rename(pytester.path / "elsewhere")
    pytester.makeconftest(CONFTEST)
    result = pytester.runpytest(*ARGS, "--precision-add-machine")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*no golden baseline at *fp32.npz*"])
    assert not (pytester.path / "precision_baselines").exists()


def test_the_add_and_update_options_exclude_each_other(pytester):
    pytester.makeconftest(CONFTEST)
    result = pytester.runpytest(*ARGS, "--precision-add-machine", "--precision-update-baselines")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--precision-update-baselines rewrites the goldens, --precision-add-machine adds "
                                 "this machine's budgets to them and keeps the rest: give one*"])


def test_a_golden_of_another_config_or_target_is_not_read_as_this_cases(pytester):
    """Before, bf16's pair copied over fp32's failed as a 13,680-ULP 'regression' of correct code, and
    fp32's copied over bf16's passed on fp32's budgets. The golden names its case; the check compares."""
    d = _accepted(pytester)
    _copy_pair(d, "bf16", "fp32")
    result = pytester.runpytest(*ARGS)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*softmax[[]mine-fp32-unit[]]: FAIL baseline (*fp32.json: this golden is "
                                 "softmax/mine/unit [[]bf16[]]'s, not softmax/mine/unit [[]fp32[]]'s (copied or renamed "
                                 "from another case?)*"])
    # an update rewrites it, keeping nothing of the other case's
    result = pytester.runpytest(*ARGS, "--precision-update-baselines")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*[[]fp32[]] on * new (it replaces softmax/mine/unit [[]bf16[]]'s golden, which was "
                                 "under this name): *"])
    assert json.loads((d / "fp32.json").read_text())["config"] == "fp32"
    pytester.runpytest(*ARGS).assert_outcomes(passed=2)


def test_a_golden_of_a_config_that_does_not_exist_is_reported_unused_with_the_reason(pytester):
    """Before, a golden for a config no machine runs (fp99) was never reported, not even as unused."""
    _copy_pair(_accepted(pytester), "fp32", "fp99")
    result = pytester.runpytest(*ARGS)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*1 unused baseline(s) under *",
                                 "  softmax/mine/unit/fp99 (no kind has a config 'fp99': no run uses it)"])
