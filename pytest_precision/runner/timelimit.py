"""A time limit on one suite case, so that a run always ends: a case still running at its limit
is stopped with :class:`CaseTimeout`, which carries the stack where it was, and the run goes on.

In the main thread of a POSIX process the limit is a ``SIGALRM`` timer (as pytest-timeout's
signal method): its handler raises in whatever Python code is running, ``time.sleep`` and lock
waits included. A timer already running there (pytest-timeout's, set around the whole test) is
saved and restored, and when it would end sooner the case ends at that moment in the same way.
Elsewhere (another thread, Windows) a watchdog thread raises the exception in the case's thread
between two bytecodes; a sleep there ends first. A call stuck inside native code that never
returns to Python cannot be interrupted by either.

The limit of a case: pytest-timeout's ``timeout`` marker when the item has one (0: none), else
the ini option ``precision_timeout`` (seconds; 0 turns it off).
"""
from __future__ import annotations

import contextlib
import ctypes
import re
import signal
import sys
import threading
import time
import traceback
from typing import Iterator

__all__ = ["CaseTimeout", "time_limit", "case_limit", "DEFAULT_TIMEOUT"]

# generous: the slowest cases of the main job on the shared 2-core CPU machine took 12.4 s (a DDP
# case: two processes importing torch), 10.6 s (the fp8 training emulation) and 5.7 s (an
# interpreted Triton kernel on rows of 32768)
DEFAULT_TIMEOUT = 600.0
MARKER = "the timeout marker"
_RUNNER = re.compile(r"runner[/\\]collection\.py")  # the suite's runner: the stack shown starts below it


class CaseTimeout(BaseException):
    """A case ran past its limit. A BaseException, as KeyboardInterrupt: the harness's and the
    target's ``except Exception`` handlers (a target error, a Hypothesis example) let it through."""

    def __init__(self, seconds: float = 0.0, source: str = "", stack: list[str] | None = None):
        super().__init__(seconds, source, stack)
        self.seconds, self.source, self.stack = seconds, source, stack or []

    @property
    def reason(self) -> str:
        return f"timed out after {self.seconds:g} s ({self.source})"

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


@contextlib.contextmanager
def time_limit(seconds: float, source: str) -> Iterator[None]:
    """Raise CaseTimeout in the body once it has run ``seconds`` (none when 0 or less)."""
    main = threading.current_thread() is threading.main_thread()
    if hasattr(signal, "setitimer") and main:
        with _alarm(seconds, source):
            yield
    elif seconds and seconds > 0:
        with _watchdog(seconds, source):
            yield
    else:
        yield


@contextlib.contextmanager
def _alarm(seconds: float, source: str) -> Iterator[None]:
    outer_delay, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    if outer_delay > 0 and (not seconds or seconds <= 0 or outer_delay < seconds):
        # pytest-timeout's timer, set before the test's setup: from the same marker, else its own
        # option (--timeout, ini timeout)
        if source != MARKER:
            source = "pytest-timeout's limit" if "pytest_timeout" in sys.modules else "an outer SIGALRM timer"
        seconds = outer_delay
    if not seconds or seconds <= 0:
        yield
        return
    limit, label = seconds, source

    def on_alarm(signum, frame):
        raise CaseTimeout(round(limit, 1) if limit >= 1 else limit, label, _stack(frame))

    start = time.monotonic()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_delay > 0:  # the outer timer goes on where it was
            left = outer_delay - (time.monotonic() - start)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), outer_interval)


@contextlib.contextmanager
def _watchdog(seconds: float, source: str) -> Iterator[None]:
    target = threading.get_ident()
    state = {"done": False, "stack": None}
    lock = threading.Lock()
    stop = threading.Event()

    def watch():
        if stop.wait(seconds):
            return
        with lock:  # never once the body is over
            if state["done"]:
                return
            frame = sys._current_frames().get(target)
            state["stack"] = _stack(frame) if frame is not None else []
            _async_raise(target, CaseTimeout)

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
            if state["stack"] is not None:
                # fired as the body ended: the exception is pending and lands on the next bytecodes.
                # (It is never withdrawn: PyThreadState_SetAsyncExc(id, NULL) leaves the
                # interpreter's async-exception flag set for good, which hung a later SIGALRM
                # handler on CPython 3.11.)
                for _ in range(100_000):
                    pass
    except CaseTimeout as e:
        raise CaseTimeout(seconds, source, state["stack"] or e.stack) from None


def _async_raise(thread_id: int, exception: type) -> None:
    """Raise ``exception`` (a class) in another thread, between two of its bytecodes."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exception))
