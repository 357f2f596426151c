"""A target is untrusted code: every run ends, and says how. A target that swallows the case's
time limit ends the process after a grace period, naming the case and where it is; ``os._exit``,
``os.abort`` and ``SystemExit`` fail the case that called them with one line (the run goes on and
never ends green); an ini module that exits at import is a usage error naming it; a nonsensical
time limit is a usage error; and the threads a target leaves running are named."""
import threading
import time

import pytest

pytest_plugins = ["pytester"]

ARGS = ("--precision-suite", "--precision-configs=fp32", "--precision-no-speed", "-p", "no:cacheprovider",
        "--precision-update-baselines", "-k", "softmax and mine-fp32-unit")

TARGET = """
import time
import torch
import pytest_precision

@pytest_precision.register("mine", kind="softmax")
def mine(x):
    {body}
    return torch.softmax(x.float(), -1).to(x.dtype)
"""


def _target(body: str) -> str:
    return TARGET.format(body="\n    ".join(body.strip().splitlines()))


def _line_of(text: str, pytester) -> int:
    """The line of the conftest that reads ``text``."""
    return 1 + (pytester.path / "conftest.py").read_text().splitlines().index(text)


# ---- the time limit cannot be swallowed --------------------------------------------------------

SWALLOWS_FOREVER = """
while True:
    try:
        time.sleep(3600)
    except:
        pass
"""


def test_a_target_that_swallows_every_timeout_ends_the_process_naming_the_case(pytester):
    pytester.makeconftest(_target(SWALLOWS_FOREVER))
    pytester.makeini("[pytest]\nprecision_timeout = 1\n")
    start = time.monotonic()
    result = pytester.runpytest_subprocess(*ARGS, timeout=120)
    assert time.monotonic() - start < 60
    assert result.ret == 1
    line = _line_of("            time.sleep(3600)", pytester)
    result.stderr.fnmatch_lines([
        "pytest-precision: precision-suite::softmax[[]mine-fp32-unit[]] ran past its time limit (1 s, ini "
        "precision_timeout) and the code under test swallowed the timeout raised in it * times over 5 s (a bare "
        "'except:' or 'except BaseException:'): the run cannot go on, ending the process with status 1. Where the "
        "main thread is:",
        f"*conftest.py*line {line}*in mine*",
        "*time.sleep(3600)*",
    ])


def test_a_target_that_swallows_the_timeout_and_returns_fails_as_timed_out(pytester):
    pytester.makeconftest(_target("try:\n    time.sleep(3600)\nexcept BaseException:\n    pass"))
    pytester.makeini("[pytest]\nprecision_timeout = 1\n")
    result = pytester.runpytest(*ARGS)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*softmax[[]mine-fp32-unit[]]: timed out after 1 s (ini precision_timeout); the code under test swallowed "
        "the timeout (* time*) and went on; where it was:",  # the second call and batch probes swallow it too
        "*time.sleep(3600)*",
    ])


def test_the_watchdog_off_the_main_thread_gives_up_on_a_swallowed_timeout(monkeypatch):
    """Off the main thread the watchdog raises again and, past the grace period, ends the process
    (here the end is recorded instead)."""
    from pytest_precision.runner import timelimit

    monkeypatch.setattr(timelimit, "RETRY_INTERVAL", 0.05)
    monkeypatch.setattr(timelimit, "MIN_GRACE", 0.5)
    words = []

    def recorded_end(text, status=1):  # the watchdog goes on, and the body stops swallowing
        words.append((text, status))

    monkeypatch.setattr(timelimit, "end_process", recorded_end)
    caught = {}

    def swallowing():
        try:
            with timelimit.time_limit(0.2, "the test's limit", case="the swallowing case"):
                while not words:
                    try:
                        time.sleep(0.01)
                    except BaseException:
                        pass
        except timelimit.CaseTimeout as e:
            caught["e"] = e

    thread = threading.Thread(target=swallowing)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    (text, status), = words
    assert status == 1
    assert text.startswith("pytest-precision: the swallowing case ran past its time limit (0.2 s, the test's limit) "
                           "and the code under test swallowed the timeout")
    assert "in swallowing" in text
    assert caught["e"].seconds == 0.2


@pytest.mark.parametrize("value", ["nan", "-1"])
def test_a_nan_or_negative_time_limit_is_a_usage_error(pytester, value):
    pytester.makeini(f"[pytest]\nprecision_timeout = {value}\n")
    result = pytester.runpytest("--precision-suite", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*precision_timeout = {value}: give seconds (0: no limit)*"])


def test_an_infinite_time_limit_is_no_limit(pytester):
    """(setitimer refused it: every case crashed.) In a subprocess: in this one, a pytest-timeout
    timer around this test would be the case's limit."""
    pytester.makeconftest(_target("time.sleep(0.01)"))
    pytester.makeini("[pytest]\nprecision_timeout = inf\n")
    result = pytester.runpytest_subprocess(*ARGS, timeout=120)
    result.assert_outcomes(passed=1)


# ---- a target cannot end the run ------------------------------------------------------------

EXITS = """
import os
import posix
import sys
import torch
import pytest_precision

def softmax(x):
    return torch.softmax(x.float(), -1).to(x.dtype)

@pytest_precision.register("fine", kind="softmax")
def fine(x):
    return softmax(x)

@pytest_precision.register("exits", kind="softmax")
def exits(x):
    os._exit(0)

@pytest_precision.register("posix_exits", kind="softmax")
def posix_exits(x):
    posix._exit(3)

@pytest_precision.register("aborts", kind="softmax")
def aborts(x):
    os.abort()

@pytest_precision.register("hides_its_exit", kind="softmax")
def hides_its_exit(x):
    try:
        os._exit(0)
    except BaseException:
        pass
    return softmax(x)

@pytest_precision.register("sys_exits", kind="softmax")
def sys_exits(x):
    sys.exit(0)

@pytest_precision.register("raises_system_exit", kind="softmax")
def raises_system_exit(x):
    raise SystemExit("bye")
"""


def test_exits_from_targets_fail_their_cases_and_the_run_goes_on(pytester):
    """os._exit(0) ended the run with status 0 after one dot; SystemExit printed a thousand lines
    of pytest's frames. In a subprocess: a regression would end this test's process."""
    pytester.makeconftest(EXITS)
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest_subprocess("--precision-suite", "--precision-configs=fp32", "--precision-no-speed",
                                           "-p", "no:cacheprovider", "--precision-update-baselines", "-k", "unit",
                                           timeout=120)
    result.assert_outcomes(passed=1, failed=6)
    assert result.ret == pytest.ExitCode.TESTS_FAILED

    def at(text: str, name: str) -> str:
        return f"at conftest.py:{_line_of(text, pytester)} in {name}: a target must return, not end the process"

    said = {
        "exits": f"target 'exits' called os._exit(0) {at('    os._exit(0)', 'exits')}",
        "posix_exits": f"target 'posix_exits' called os._exit(3) {at('    posix._exit(3)', 'posix_exits')}",
        "aborts": f"target 'aborts' called os.abort() {at('    os.abort()', 'aborts')}",
        "hides_its_exit": f"target 'hides_its_exit' called os._exit(0) {at('        os._exit(0)', 'hides_its_exit')} "
                          "(it caught the error raised in its place and went on)",
        "sys_exits": f"target 'sys_exits' raised SystemExit(0) (sys.exit) {at('    sys.exit(0)', 'sys_exits')}",
        "raises_system_exit": "target 'raises_system_exit' raised SystemExit('bye') (sys.exit) "
                              + at('    raise SystemExit("bye")', "raises_system_exit"),
    }
    for name, sentence in said.items():
        result.stdout.fnmatch_lines([f"precision-suite::softmax[[]{name}-fp32-unit[]]: {sentence}",
                                     f"crashed: precision-suite::softmax[[]{name}-fp32-unit[]]: {sentence}"])
    out = result.stdout.str()
    assert "Traceback" not in out and "_pytest" not in out
    assert len(result.stdout.lines) < 100  # no frames of pytest's


def test_an_exit_at_the_probe_call_ends_nothing(pytester):
    """The attention kind's probe call at collection: os._exit there ended the collection."""
    pytester.makeconftest(EXITS.split("@pytest_precision.register(\"exits\"")[0] + """
import torch.nn.functional as F

CALLS = []

@pytest_precision.register("rude", kind="attention")
def rude(q, k, v, causal=False):
    CALLS.append(1)
    if len(CALLS) == 1:  # only the probe call
        os._exit(0)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
""")
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest_subprocess("--precision-suite", "--precision-configs=fp32", "--precision-no-speed",
                                           "-p", "no:cacheprovider", "--precision-device=cpu", "-k", "unit",
                                           timeout=120)
    result.assert_outcomes(failed=3)  # fine's and rude's two backends, judged (no goldens)
    result.stdout.fnmatch_lines(["target 'rude': its variants were not decided at collection (the probe call: target "
                                 "'rude' called os._exit(0) at conftest.py:* in rude: a target must return, not end "
                                 "the process): *"])


def test_a_keyboard_interrupt_from_a_target_still_interrupts_the_run(pytester):
    pytester.makeconftest(_target("raise KeyboardInterrupt"))
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest_subprocess(*ARGS, timeout=120)  # in-process, it would interrupt this session too
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*KeyboardInterrupt*"])


@pytest.mark.parametrize("exit_call, said", [("sys.exit(0)", "raised SystemExit(0) (sys.exit)"),
                                             ("os._exit(0)", "called os._exit(0)")])
def test_an_ini_kind_module_that_exits_on_import_is_a_usage_error(pytester, exit_call, said):
    pytester.makepyfile(mykinds=f"import os\nimport sys\n{exit_call}\n")
    pytester.syspathinsert()
    pytester.makeini("[pytest]\nprecision_kinds = mykinds:KIND\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=120)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*precision_kinds: 'mykinds:KIND': importing mykinds {said} at mykinds.py:3 in "
                                 "<module>: a module must not end the process when imported*"])


def test_an_ini_target_module_that_exits_on_import_is_a_usage_error(pytester):
    pytester.makepyfile(mykernels="import sys\nsys.exit(0)\n")
    pytester.syspathinsert()
    pytester.makeini("[pytest]\nprecision_targets =\n    mykernels:softmax softmax\n")
    result = pytester.runpytest("--precision-suite", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*precision_targets: 'mykernels:softmax softmax': importing mykernels raised "
                                 "SystemExit(0) (sys.exit) at mykernels.py:2 in <module>: a module must not end the "
                                 "process when imported*"])


# ---- threads a target leaves running ---------------------------------------------------------

LINGERS = """
import os
import threading
import time
import torch
import pytest_precision

STARTED = []

def linger(stop_file):
    deadline = time.monotonic() + 30
    while not os.path.exists(stop_file) and time.monotonic() < deadline:
        time.sleep(0.02)

@pytest_precision.register("mine", kind="softmax")
def mine(x):
    if not STARTED:
        STARTED.append(threading.Thread(target=linger, args=[{stop!r}], name="linger"))
        STARTED[0].start()
    return torch.softmax(x.float(), -1).to(x.dtype)
"""


def test_a_thread_a_target_leaves_running_is_named(pytester):
    """Named by the case (a warning) and, still running at the end, below the summary."""
    stop = pytester.path / "stop"  # the thread runs until the session is over
    pytester.makeconftest(LINGERS.format(stop=str(stop)))
    pytester.makeini("[pytest]\n")
    try:
        result = pytester.runpytest(*ARGS, "-W", "default")
    finally:
        stop.touch()
    for thread in threading.enumerate():
        if thread.name == "linger":
            thread.join(30)
    result.assert_outcomes(passed=1)  # the case's numbers were judged: the warning does not fail it
    result.stdout.fnmatch_lines([
        "*ThreadLeftRunningWarning: precision-suite::softmax[[]mine-fp32-unit[]]: target 'mine' left thread 'linger' "
        "(running conftest.linger) running; a thread that is not a daemon keeps the process alive after the run: "
        "join it before returning, or make it a daemon",
        "*= threads left running by the code under test; the process will wait for them =*",
        "thread 'linger' (running conftest.linger), left by precision-suite::softmax[[]mine-fp32-unit[]]",
    ])


TIDY_THREADS = """
import threading
import time
import torch
import pytest_precision

@pytest_precision.register("mine", kind="softmax")
def mine(x):
    worker = threading.Thread(target=time.sleep, args=[0.05], name="joined")
    worker.start()
    worker.join()  # joined before returning
    threading.Thread(target=time.sleep, args=[30], name="background", daemon=True).start()  # a daemon
    return torch.softmax(x.float(), -1).to(x.dtype)
"""


def test_a_joined_thread_or_a_daemon_is_not_named(pytester):
    pytester.makeconftest(TIDY_THREADS)
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest(*ARGS, "-W", "default")
    result.assert_outcomes(passed=1)
    assert "ThreadLeftRunningWarning" not in result.stdout.str()
    assert "threads left running" not in result.stdout.str()


def test_a_thread_that_ran_before_the_case_keeps_the_real_exit():
    """execnet's last resort in an xdist worker is an os._exit from its own thread: refusing it
    would keep a dead worker alive. Only the case's thread and the threads it starts are refused."""
    import subprocess
    import sys

    code = """
import os, threading, time
from pytest_precision.runner.exits import refuse_process_exits
go = threading.Event()
def earlier():
    go.wait()
    os._exit(7)
threading.Thread(target=earlier, daemon=True).start()
with refuse_process_exits("mine"):
    go.set()
    time.sleep(30)
"""
    done = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert done.returncode == 7


def test_a_limit_too_large_for_the_timer_is_no_limit():
    from pytest_precision.runner.options import parse_timeout
    from pytest_precision.runner.timelimit import time_limit

    assert parse_timeout("1e12") == 0.0
    with time_limit(1e12, "ini precision_timeout"):  # setitimer raised OverflowError here
        pass


def test_what_a_target_prints_is_kept_from_its_first_call_only(pytester):
    """Before, a target printing 50 MB a call cost 500 MiB of captured output: every re-call's (the
    contract's second call, Hypothesis's examples, the first-fault re-run) was held too."""
    pytester.makeconftest(_target("print('MARK ' + 'x' * 100000)\nreturn torch.softmax(x.float(), -1).to(x.dtype) * 1.05"))
    result = pytester.runpytest(*ARGS[:-3], "-k", "softmax and mine-fp32-unit")
    result.assert_outcomes(failed=1)  # 5 % high: its captured output is shown
    assert result.stdout.str().count("MARK ") == 1
