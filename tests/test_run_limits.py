"""Runs always end: a hung case fails at its time limit with the stack where it hung and the run
goes on; ini targets are imported only for --precision-suite, and anything they raise is a usage
error naming the line; a read-only baseline directory under update is one error naming it; a
configs option that names no config says so."""
import contextlib
import os
import shutil
import subprocess
import threading
import time

import pytest


pytest_plugins = ["pytester"]

HANGS = """
import time
import torch
import pytest_precision

@pytest_precision.register("mine", kind="softmax")
def mine(x):
    if x.shape[-1] == 1:  # the len1 regime
        {hang}
    return torch.softmax(x.float(), -1).to(x.dtype)
"""
# under the update flag, so the unit case passes without a golden of its own
ARGS = ("--precision-suite", "--precision-configs=fp32", "--precision-no-speed", "-p", "no:cacheprovider",
        "--precision-update-baselines", "-k", "softmax and (mine-fp32-len1] or mine-fp32-unit)")


@pytest.mark.parametrize("hang", ["time.sleep(3600)", "while True: pass"])
def test_a_hung_case_fails_at_the_limit_with_its_stack_and_the_run_goes_on(pytester, hang):
    pytester.makeconftest(HANGS.format(hang=hang))
    # 3 s: the unit case, with its second call and batch probes, must not reach it on a loaded machine
    pytester.makeini("[pytest]\nprecision_timeout = 3\n")
    start = time.monotonic()
    result = pytester.runpytest(*ARGS)
    assert time.monotonic() - start < 60
    result.assert_outcomes(passed=1, failed=1)  # the unit case ran after or before it, and passed
    line = next(i for i, text in enumerate((pytester.path / "conftest.py").read_text().splitlines(), 1) if hang in text)
    result.stdout.fnmatch_lines([
        "*softmax[[]mine-fp32-len1[]]: timed out after 3 s (ini precision_timeout); where it was:",
        f"*conftest.py*line {line}*in mine*",
        f"*{hang}*",
        "*crashed: precision-suite::softmax[[]mine-fp32-len1[]]: timed out after 3 s*",
    ])


def test_the_timeout_marker_replaces_the_ini_limit(pytester):
    pytester.makeconftest(HANGS.format(hang="time.sleep(3600)") + """

import pytest

def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.timeout(2))
""")
    pytester.makeini("[pytest]\nmarkers = timeout(seconds): per-test time limit\n")
    result = pytester.runpytest(*ARGS)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*softmax[[]mine-fp32-len1[]]: timed out after 2 s (the timeout marker)*"])


def test_pytest_timeout_ending_sooner_ends_the_case_the_same_way(pytester):
    pytest.importorskip("pytest_timeout")
    pytester.makeconftest(HANGS.format(hang="time.sleep(3600)"))
    result = pytester.runpytest(*ARGS, "--timeout=2", "--timeout-method=signal")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*softmax[[]mine-fp32-len1[]]: timed out after * s (pytest-timeout's limit)*"])


def test_the_limit_off_the_main_thread():
    """Where SIGALRM cannot be used, a watchdog raises the timeout in the running thread."""
    from pytest_precision.runner.timelimit import CaseTimeout, time_limit

    caught = {}

    def busy():
        try:
            with time_limit(0.5, "the test's limit"):
                while True:
                    pass
        except CaseTimeout as e:
            caught["e"] = e

    t = threading.Thread(target=busy)
    t.start()
    t.join(30)
    assert not t.is_alive()
    assert "timed out after 0.5 s (the test's limit)" in str(caught["e"]) and "in busy" in str(caught["e"])


RAISES_ON_IMPORT = "raise RuntimeError('the kernels need a GPU')\n"


def test_ini_targets_are_imported_only_for_the_suite(pytester):
    pytester.makepyfile(mykernels=RAISES_ON_IMPORT, test_plain="def test_plain():\n    pass\n")
    pytester.syspathinsert()
    pytester.makeini("[pytest]\nprecision_targets =\n    mykernels:softmax softmax\n")
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)  # not imported without the suite
    result = pytester.runpytest("--precision-suite", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*precision_targets: 'mykernels:softmax softmax': importing mykernels:softmax raised "
                                 "RuntimeError: the kernels need a GPU*"])
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


def test_an_ini_kind_that_raises_is_a_usage_error(pytester):
    pytester.makepyfile(mykinds=RAISES_ON_IMPORT)
    pytester.syspathinsert()
    pytester.makeini("[pytest]\nprecision_kinds = mykinds:KIND\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*precision_kinds: 'mykinds:KIND': importing it raised RuntimeError: the kernels need a GPU*"])


@contextlib.contextmanager
def _read_only(path):
    """``path`` read-only, also for root (chattr +i), or skip."""
    path.chmod(0o555)
    immutable = False
    if os.geteuid() == 0:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)]).returncode != 0:
            path.chmod(0o755)
            pytest.skip("running as root without chattr: cannot make a directory read-only")
        immutable = True
    try:
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)])
        path.chmod(0o755)


def test_a_read_only_baseline_directory_under_update_is_one_error(pytester):
    pytester.makeconftest(HANGS.format(hang="pass"))
    gold = pytester.path / "precision_baselines"
    gold.mkdir()
    with _read_only(gold):
        result = pytester.runpytest(*ARGS)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--precision-update-baselines: cannot write to the baseline directory {gold}*"])
    assert "Traceback" not in result.stdout.str() + result.stderr.str()


def test_a_golden_that_cannot_be_written_is_a_verdict(pytester):
    """A writable root with a read-only case directory: that case fails naming the directory."""
    pytester.makeconftest(HANGS.format(hang="pass"))
    case_dir = pytester.path / "precision_baselines" / "softmax" / "mine" / "len1"
    case_dir.mkdir(parents=True)
    with _read_only(case_dir):
        result = pytester.runpytest(*ARGS)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([f"*softmax[[]mine-fp32-len1[]]: FAIL baseline (softmax/mine/len1 [[]fp32[]] on cpu-*: "
                                 f"cannot write the golden baseline: {case_dir}*"])
    assert "Traceback" not in result.stdout.str()


def test_a_configs_option_naming_no_config_is_a_usage_error(pytester):
    pytester.makeini("[pytest]\n")
    for value in (",", "", " , "):
        result = pytester.runpytest("--precision-suite", f"--precision-configs={value}", "-p", "no:cacheprovider")
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines(["*--precision-configs*names no config; known: fp32, tf32, fp16*"])


def test_the_time_limit_setting_is_checked(pytester):
    pytester.makeini("[pytest]\nprecision_timeout = soon\n")
    result = pytester.runpytest("--precision-suite", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*precision_timeout = soon: give seconds (0: no limit)*"])


def test_the_limit_holds_in_the_first_fault_re_runs(pytester):
    """A target wrong in fp16 is re-run traced to locate its first fault, beside a float64 run. One
    that hangs on float64 inputs ends the case at the limit: the limit is not taken for the
    target's refusal of float64 (after which the float32 re-run would have run unlimited)."""
    pytester.makeconftest("""
import time
import torch
import pytest_precision

@pytest_precision.register("mine", kind="softmax")
def mine(x):
    if x.dtype is torch.float64:
        time.sleep(3600)
    return torch.exp(x) / torch.exp(x).sum(-1, keepdim=True)  # no max subtracted: fp16 overflows at scale20
""")
    pytester.makeini("[pytest]\nprecision_timeout = 3\n")
    start = time.monotonic()
    result = pytester.runpytest("--precision-suite", "--precision-configs=fp16", "--precision-no-speed",
                                "-p", "no:cacheprovider", "-k", "softmax and mine-fp16-scale20]")
    assert time.monotonic() - start < 60
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*softmax[[]mine-fp16-scale20[]]: timed out after 3 s (ini precision_timeout)*"])
    assert "float32 run" not in result.stdout.str()
