"""What the code under test may not do to the run: end it, or keep its process alive after it.

A target is a user's code, run inside pytest's own process. Three ways it could take the run with it:

- ``os._exit`` (``posix._exit``) or ``os.abort`` ended the whole process at once, and an
  ``os._exit(0)`` ended it with status 0 after a single ``.``: a green run that judged nothing.
  While a suite case (or the collection's probe call, or an ini module's import) runs,
  :func:`refuse_process_exits` puts functions in their place that raise :class:`TargetEnded`
  naming who called what and where; the originals are back when it ends. The process's children
  (a fork inherits the replacement) still exit with the real ``os._exit``, and so does
  pytest-timeout's thread method when it ends a hung run.
- ``SystemExit`` (``sys.exit``) out of a target reached pytest as a test error with a thousand
  lines of pytest's own frames; out of an ini module's import it ended the run with status 0 and
  no word. Both are a :class:`TargetEnded` too: one line naming the target or module, the exit
  code and where.
- a non-daemon thread the code starts and leaves running keeps the process alive after the
  summary, and the run seems to hang. :class:`ThreadWatch` names, per case, the threads a case
  left running (a :class:`ThreadLeftRunningWarning`, the case's verdict unchanged: its numbers
  were judged), and below the summary those still running when the session ends.

``KeyboardInterrupt`` and ``pytest.exit`` are not touched: they end the run as they always did.
The case time limit's last resort (``runner.timelimit``: the limit swallowed by the code under
test) ends the process with the real ``os._exit`` through :func:`end_process`.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from typing import Callable, Iterator

import pytest

__all__ = ["TargetEnded", "refuse_process_exits", "end_process", "suspend_capture", "ThreadWatch", "watch_threads",
           "THREADS_KEY", "ThreadLeftRunningWarning", "TARGET_ADVICE", "IMPORT_ADVICE"]

TARGET_ADVICE = "a target must return, not end the process"
IMPORT_ADVICE = "a module must not end the process when imported"

# the real functions, taken before any replacement: the give-up of the time limit and the
# process's forked children use them
_REAL_EXIT = os._exit
_REAL_ABORT = os.abort


class TargetEnded(BaseException):
    """The code under test tried to end the process (``os._exit``, ``os.abort``, ``SystemExit``).
    A BaseException, as SystemExit itself: the kinds' ``except Exception`` (which makes a target's
    error a TargetError) and Hypothesis's search let it through, and the case ends with it."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


def _where(frame, line: int | None = None) -> str:
    """``file:line in function`` of ``frame``, the file relative to the working directory when under it."""
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    with contextlib.suppress(ValueError):
        rel = os.path.relpath(path)
        if not rel.startswith(".."):
            path = rel
    return f"{path}:{line or frame.f_lineno} in {frame.f_code.co_name}"


def _raised_at(error: BaseException) -> str:
    """Where ``error`` was raised: the last frame of its traceback."""
    tb = error.__traceback__
    if tb is None:
        return "?"
    while tb.tb_next is not None:
        tb = tb.tb_next
    return _where(tb.tb_frame, tb.tb_lineno)


@contextlib.contextmanager
def refuse_process_exits(who: str, advice: str = TARGET_ADVICE, system_exit: bool = True) -> Iterator[None]:
    """While the body runs, ``os._exit``/``posix._exit``/``os.abort`` called in this process raise
    :class:`TargetEnded` (``{who} called os._exit(0) at file:line in fn: {advice}``), and a
    ``SystemExit`` out of the body becomes one (unless ``system_exit`` is false: the caller
    handles it). A call the code caught and went on from still ends the body with it, once the
    body is over."""
    pid = os.getpid()
    attempts: list[str] = []
    # threads that ran before the body keep the real exits (execnet's last resort in an xdist worker;
    # pytest-timeout's thread method, which ends a hung run so): only the body's thread and the
    # threads it starts are the code under test
    earlier = {t.ident for t in threading.enumerate()} - {threading.get_ident()}

    def refused(call: str, real: Callable, *args) -> None:
        caller = sys._getframe(2)
        if os.getpid() != pid or threading.get_ident() in earlier:
            real(*args)
        attempts.append(f"{who} called {call} at {_where(caller)}: {advice}")
        raise TargetEnded(attempts[-1])

    def exit_refused(status):
        refused(f"os._exit({status!r})", _REAL_EXIT, status)

    def abort_refused():
        refused("os.abort()", _REAL_ABORT)

    posix = sys.modules.get(os.name)  # posix (or nt): os._exit is its function
    saved = [(module, name, getattr(module, name)) for module in {os, posix} if module is not None
             for name in ("_exit", "abort") if hasattr(module, name)]
    for module, name, _ in saved:
        setattr(module, name, exit_refused if name == "_exit" else abort_refused)
    try:
        yield
    except SystemExit as e:
        if not system_exit:
            raise
        raise TargetEnded(f"{who} raised SystemExit({e.code!r}) (sys.exit) at {_raised_at(e)}: {advice}") from None
    except Exception as e:  # the refusal, caught and turned into another error
        if attempts:
            raise TargetEnded(attempts[0]) from e
        raise
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
    if attempts:
        raise TargetEnded(f"{attempts[0]} (it caught the error raised in its place and went on)")


def suspend_capture(config: pytest.Config) -> None:
    """Give the terminal back from pytest's output capture, so that what is written next is seen."""
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        with contextlib.suppress(Exception):
            capman.suspend_global_capture(in_=True)


def end_process(text: str, status: int = 1) -> None:
    """Write ``text`` to stderr and end the process at once with ``status`` (the real ``os._exit``:
    no cleanup, no thread joined). Under pytest-xdist the worker's end is the test's failure."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        sys.stderr.write("\n" + text.rstrip() + "\n")
        sys.stderr.flush()
    _REAL_EXIT(status)


# ---- threads left running ------------------------------------------------------------------------

class ThreadLeftRunningWarning(pytest.PytestWarning):
    """A case left a thread running that is not a daemon: the process waits for it at its end."""


def _keeps_process_alive(thread: threading.Thread) -> bool:
    """A live non-daemon thread other than a ``concurrent.futures`` pool worker (torch.compile's
    pool among them), which ends when the interpreter does."""
    target = getattr(thread, "_target", None)
    pool_worker = getattr(target, "__module__", "") == "concurrent.futures.thread"
    return thread.is_alive() and not thread.daemon and not pool_worker


def describe_thread(thread: threading.Thread) -> str:
    """``thread 'name' (running module.function)``."""
    target = getattr(thread, "_target", None)
    if target is not None:
        running = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"
    else:
        running = f"{type(thread).__module__}.{type(thread).__qualname__}.run"
    return f"thread {thread.name!r} (running {running})"


def _warn_at_thread(message: str, thread: threading.Thread) -> None:
    """The warning, at the thread's function when it is Python code (else here)."""
    code = getattr(getattr(thread, "_target", None), "__code__", None)
    if code is None:
        warnings.warn(ThreadLeftRunningWarning(message), stacklevel=3)
    else:
        warnings.warn_explicit(ThreadLeftRunningWarning(message), ThreadLeftRunningWarning, code.co_filename,
                               code.co_firstlineno)


class ThreadWatch:
    """The threads the code under test starts and leaves running: per case (:meth:`case`) and,
    below the summary, those still running when the session ends."""

    def __init__(self):
        self.at_start = set(threading.enumerate())
        self.started_in: dict[threading.Thread, str] = {}  # thread -> the case that left it running

    @contextlib.contextmanager
    def case(self, nodeid: str, who: str) -> Iterator[None]:
        """Around one case: each thread it left running is warned about, naming ``who`` started it."""
        before = set(threading.enumerate())
        try:
            yield
        finally:
            for thread in threading.enumerate():
                if thread not in before and thread not in self.started_in and _keeps_process_alive(thread):
                    self.started_in[thread] = nodeid
                    _warn_at_thread(f"{nodeid}: {who} left {describe_thread(thread)} running; a thread that is not "
                                    "a daemon keeps the process alive after the run: join it before returning, or "
                                    "make it a daemon", thread)

    def left_running(self) -> list[str]:
        """A line per thread started during the session and still keeping the process alive."""
        return [describe_thread(t) + (f", left by {self.started_in[t]}" if t in self.started_in else "")
                for t in threading.enumerate() if t not in self.at_start and _keeps_process_alive(t)]

    @pytest.hookimpl(trylast=True)  # below the precision summary
    def pytest_terminal_summary(self, terminalreporter) -> None:
        lines = self.left_running()
        if lines:
            terminalreporter.write_sep("=", "threads left running by the code under test; the process will wait "
                                            "for them", yellow=True)
            for line in lines:
                terminalreporter.write_line(line)


THREADS_KEY = pytest.StashKey[ThreadWatch]()


def watch_threads(config: pytest.Config) -> ThreadWatch:
    """The session's :class:`ThreadWatch`, kept in the config's stash and registered for the summary."""
    watch = config.stash[THREADS_KEY] = ThreadWatch()
    config.pluginmanager.register(watch, "precision-threads")
    return watch
