"""A time limit on one suite case, so that a run always ends: a case still running at its limit
is stopped with :class:`CaseTimeout`, which carries the stack where it was, and the run goes on.

In the main thread of a POSIX process the limit is a ``SIGALRM`` timer (as pytest-timeout's
signal method): its handler raises in whatever Python code is running, ``time.sleep`` and lock
waits included. A timer already running there (pytest-timeout's, set around the whole test) is
saved and restored, and when it would end sooner the case ends at that moment in the same way.
Elsewhere (another thread, Windows) a watchdog thread raises the exception in the case's thread
between two bytecodes; a sleep there ends first. A call stuck inside native code that never
returns to Python cannot be interrupted by either.

The code under test can catch the timeout (a bare ``except:`` in a retry loop), so it is raised
again every second (``RETRY_INTERVAL``) while the case goes on; a case whose code swallowed it and
then returned fails as timed out all the same, saying so. One still running after a grace period
of max(5 s, 10 % of its limit) would never end: the process is ended (status 1), after writing to
stderr the case, its limit and the stack where it is (``exits.end_process``; pytest-xdist reports
the worker's end as that test's failure and starts another worker).

``seconds`` that are not finite: infinite is no limit (``RunOptions`` refuses a NaN limit).

The limit of a case: pytest-timeout's ``timeout`` marker when the item has one (0: none), else
the ini option ``precision_timeout`` (seconds; 0 or ``inf`` turns it off).
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import re
import signal
import sys
import threading
import time
import traceback
from typing import Callable, Iterator

from .exits import end_process

__all__ = ["CaseTimeout", "time_limit", "case_limit", "grace_seconds", "DEFAULT_TIMEOUT"]

# generous: the slowest cases of the main job on the shared 2-core CPU machine took 12.4 s (a DDP
# case: two processes importing torch), 10.6 s (the fp8 training emulation) and 5.7 s (an
# interpreted Triton kernel on rows of 32768)
DEFAULT_TIMEOUT = 600.0
MARKER = "the timeout marker"
# once the limit is reached the timeout is raised again every RETRY_INTERVAL s while the case goes on
# (its code caught it); past the grace period, max(MIN_GRACE, GRACE_FRACTION x the limit), the
# process is ended with GIVE_UP_STATUS
RETRY_INTERVAL = 1.0
# a limit past this many seconds (three years) is no limit: setitimer and the watchdog's wait
# overflow on values near 1e12
NO_LIMIT_ABOVE = 1e8
MIN_GRACE = 5.0
GRACE_FRACTION = 0.1
GIVE_UP_STATUS = 1
_RUNNER = re.compile(r"runner[/\\]collection\.py")  # the suite's runner: the stack shown starts below it


class CaseTimeout(BaseException):
    """A case ran past its limit. A BaseException, as KeyboardInterrupt: the harness's and the
    target's ``except Exception`` handlers (a target error, a Hypothesis example) let it through."""

    def __init__(self, seconds: float = 0.0, source: str = "", stack: list[str] | None = None, swallowed: int = 0):
        super().__init__(seconds, source, stack, swallowed)
        self.seconds, self.source, self.stack = seconds, source, stack or []
        self.swallowed = swallowed  # times the code under test caught it before the case ended

    @property
    def reason(self) -> str:
        caught = (f"; the code under test swallowed the timeout ({self.swallowed} time"
                  f"{'s' if self.swallowed != 1 else ''}) and went on" if self.swallowed else "")
        return f"timed out after {self.seconds:g} s ({self.source}){caught}"

    def __str__(self) -> str:
        return self.reason + ("; where it was:\n" + "".join(self.stack).rstrip() if self.stack else "")


def case_limit(item, ini_seconds: float) -> tuple[float, str]:
    """The limit of ``item`` and where it comes from: its ``timeout`` marker (pytest-timeout's),
    else the ini option."""
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout", 0)
        try:
            return float(value or 0), MARKER
        except (TypeError, ValueError):
            pass  # pytest-timeout reports its own marker's errors
    return ini_seconds, "ini precision_timeout"


def _stack(frame) -> list[str]:
    """The stack of ``frame``, outermost first, from the suite's runner down."""
    lines = traceback.format_stack(frame)
    start = max((i for i, line in enumerate(lines) if _RUNNER.search(line)), default=-1)
    return lines[start + 1:] if start + 1 < len(lines) else lines


def grace_seconds(limit: float) -> float:
    """How long a case may go on after its limit, the timeout swallowed, before its process is ended."""
    return max(MIN_GRACE, GRACE_FRACTION * limit)


class _Overrun:
    """A case past its limit: when the first timeout was raised, how often, where the case was."""

    def __init__(self, seconds: float, source: str, case: str, before_exit: Callable[[], None] | None):
        self.seconds, self.source, self.case, self.before_exit = seconds, source, case, before_exit
        self.first: float | None = None  # monotonic time of the first raise
        self.raised = 0
        self.stack: list[str] = []

    @property
    def shown(self) -> float:
        return round(self.seconds, 1) if self.seconds >= 1 else self.seconds

    def timeout(self, stack: list[str] | None = None) -> CaseTimeout:
        """The exception to raise now (the stack of the first raise when none is given)."""
        if self.first is None:
            self.first, self.stack = time.monotonic(), stack or []
        self.raised += 1
        return CaseTimeout(self.shown, self.source, stack if stack is not None else self.stack)

    def swallowed(self) -> CaseTimeout:
        """The body ended without the timeout: the code under test caught each one."""
        return CaseTimeout(self.shown, self.source, self.stack, swallowed=self.raised)

    def past_grace(self) -> bool:
        return self.first is not None and time.monotonic() - self.first >= grace_seconds(self.seconds)

    def give_up(self, frame, thread: str) -> None:
        """End the process: the case swallowed every timeout through its grace period."""
        if self.before_exit is not None:
            self.before_exit()
        stack = "".join(_stack(frame)).rstrip() if frame is not None else "(not known)"
        end_process(
            f"pytest-precision: {self.case or 'a case'} ran past its time limit ({self.shown:g} s, {self.source}) and "
            f"the code under test swallowed the timeout raised in it {self.raised} times over "
            f"{grace_seconds(self.seconds):g} s (a bare 'except:' or 'except BaseException:'): the run cannot go "
            f"on, ending the process with status {GIVE_UP_STATUS}. Where the {thread} thread is:\n{stack}",
            GIVE_UP_STATUS)


@contextlib.contextmanager
def time_limit(seconds: float, source: str, case: str = "",
               before_exit: Callable[[], None] | None = None) -> Iterator[None]:
    """Raise CaseTimeout in the body once it has run ``seconds`` (none when 0 or less, or infinite),
    and again every second while the body swallows it; past the grace period, end the process
    with the stack of ``case`` (``before_exit`` first: pytest's capture suspended)."""
    if not math.isfinite(seconds) or seconds > NO_LIMIT_ABOVE:
        seconds = 0.0
    main = threading.current_thread() is threading.main_thread()
    if hasattr(signal, "setitimer") and main:
        with _alarm(seconds, source, case, before_exit):
            yield
    elif seconds and seconds > 0:
        with _watchdog(seconds, source, case, before_exit):
            yield
    else:
        yield


def _in_this_module(frame) -> bool:
    return frame is not None and frame.f_code.co_filename == __file__


@contextlib.contextmanager
def _alarm(seconds: float, source: str, case: str, before_exit) -> Iterator[None]:
    outer_delay, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    outer_ends_case = outer_delay > 0 and (not seconds or seconds <= 0 or outer_delay < seconds)
    if outer_ends_case:
        # pytest-timeout's timer, set before the test's setup: from the same marker, else its own
        # option (--timeout, ini timeout)
        if source != MARKER:
            source = "pytest-timeout's limit" if "pytest_timeout" in sys.modules else "an outer SIGALRM timer"
        seconds = outer_delay
    if not seconds or seconds <= 0:
        yield
        return
    overrun = _Overrun(seconds, source, case, before_exit)

    def on_alarm(signum, frame):
        if _in_this_module(frame):  # the body is over: this is the timer being stopped
            return
        if overrun.past_grace():
            overrun.give_up(frame, "main")
        raise overrun.timeout(_stack(frame) if overrun.first is None else None)

    start = time.monotonic()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, RETRY_INTERVAL)  # then again every second
    try:
        yield
    except Exception as e:
        if overrun.first is None:
            raise
        raise overrun.swallowed() from e  # the timeout, caught and turned into another error
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        # the outer timer goes on where it was; when it is the limit that ended the case, firing
        # it again a moment later would fail whatever step of pytest's own runs then
        if outer_delay > 0 and not (outer_ends_case and overrun.first is not None and not outer_interval):
            left = outer_delay - (time.monotonic() - start)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), outer_interval)
    if overrun.first is not None:
        raise overrun.swallowed()


@contextlib.contextmanager
def _watchdog(seconds: float, source: str, case: str, before_exit) -> Iterator[None]:
    target = threading.get_ident()
    overrun = _Overrun(seconds, source, case, before_exit)
    state = {"done": False}
    lock = threading.Lock()
    stop = threading.Event()

    def watch():
        if stop.wait(seconds):
            return
        while True:
            with lock:  # never once the body is over
                if state["done"]:
                    return
                frame = sys._current_frames().get(target)
                if overrun.past_grace():
                    overrun.give_up(frame, "case's")
                overrun.timeout((_stack(frame) if frame is not None else []) if overrun.first is None else None)
                _async_raise(target, CaseTimeout)
            if stop.wait(RETRY_INTERVAL):  # then again every second while the body swallows it
                return

    watcher = threading.Thread(target=watch, name="precision-timeout", daemon=True)
    watcher.start()
    try:
        try:
            yield
        finally:
            with lock:
                state["done"] = True
            stop.set()
            watcher.join()
            if overrun.first is not None:
                # fired as the body ended: the exception is pending and lands on the next bytecodes.
                # (It is never withdrawn: PyThreadState_SetAsyncExc(id, NULL) leaves the
                # interpreter's async-exception flag set for good, which hung a later SIGALRM
                # handler on CPython 3.11.)
                for _ in range(100_000):
                    pass
    except CaseTimeout:
        raise overrun.timeout() from None
    except Exception as e:
        if overrun.first is None:
            raise
        raise overrun.swallowed() from e
    if overrun.first is not None:
        raise overrun.swallowed()


def _async_raise(thread_id: int, exception: type) -> None:
    """Raise ``exception`` (a class) in another thread, between two of its bytecodes."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exception))
