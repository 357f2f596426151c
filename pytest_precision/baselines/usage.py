"""Unused baselines (as syrupy's unused snapshots): at the end of a ``--precision-suite``
run, the baseline files that no suite case and no ``golden`` check looked up or wrote.

Only what the run could have used is judged, so a partial run never calls a baseline unused:

- nothing at all when the run stopped early (``-x``, ``--maxfail``, interrupted), collection
  failed, or an xdist worker went down (its usage went with it);
- never the baseline of a suite case that was collected, whatever became of it (deselected by
  ``-k`` or ``-m``, skipped inside the suite, crashed before or after its lookup): its own file;
- not the baselines of a user test that was deselected or did not pass (it may have failed
  before its lookup): every baseline under its module and test name (as syrupy, which does not
  call a deselected test's snapshots unused);
- only baselines of configs this run used at least once (``--precision-configs``, configs the
  device skips such as ``tf32`` on a CPU, SDPA backends it lacks such as ``+cudnn``), and those of
  a config no kind has (``fp99``: no machine would ever use them), named with that reason;
- suite baselines (``<kind>/...``) only when the suite ran; user tests' baselines
  (``<test path>/<test>/...``) all when the whole project was collected, else only those of
  the test modules collected.

The list is saved in pytest's cache (``pytest_precision/unused_baselines``), which
``python -m pytest_precision baselines prune`` reads; ``-p no:cacheprovider`` leaves nothing to prune.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from .store import sanitize_key
from .tools import baseline_names

__all__ = ["BaselineUsage", "USAGE_KEY", "CACHE_KEY", "PRUNE_COMMAND", "find_unused", "incomplete_reason",
           "module_prefix"]

CACHE_KEY = "pytest_precision/unused_baselines"
PRUNE_COMMAND = "python -m pytest_precision baselines prune"


def module_prefix(nodeid: str) -> str:
    """The baseline key prefix of a test module's goldens (fixtures._test_key)."""
    path = nodeid.partition("::")[0]
    return sanitize_key(path.removesuffix(".py")) + "/"


@dataclass
class BaselineUsage:
    """What decides the scope, gathered during the run (and merged from xdist workers)."""

    used: set[str] = field(default_factory=set)  # "<key>/<config>", from BaselineStore.used
    excused: set[str] = field(default_factory=set)  # collected suite cases' "<key>/<config>"
    excused_prefixes: set[str] = field(default_factory=set)  # deselected or not passed user tests' "<module>/<test>"
    module_prefixes: set[str] = field(default_factory=set)
    whole_project: bool = True  # no file or node id arguments
    workers_down: list[str] = field(default_factory=list)  # xdist workers that went down (their usage is lost)

    def as_workeroutput(self) -> dict:
        return {"used": sorted(self.used), "excused": sorted(self.excused),
                "excused_prefixes": sorted(self.excused_prefixes), "module_prefixes": sorted(self.module_prefixes)}

    def merge(self, data: dict) -> None:
        """A worker's usage (whole_project is the controller's: it saw the command line)."""
        for name in ("used", "excused", "excused_prefixes", "module_prefixes"):
            getattr(self, name).update(data.get(name, ()))

    def excuse(self, item) -> None:
        """Excuse the baselines a precision item would have used: it was deselected, or (a suite
        case) collected, or (a user test) did not pass."""
        case = getattr(item, "case", None)  # a suite item
        if case is not None:
            self.excused.add(f"{sanitize_key(case.baseline_key)}/{case.config_id}")
        else:  # its key drops the config from the parameters: excuse the test name's whole prefix
            base = item.nodeid.partition("::")[2].partition("[")[0]
            self.excused_prefixes.add(module_prefix(item.nodeid) + sanitize_key(base or "_"))


def find_unused(root: Path, usage: BaselineUsage, *, suite_ran: bool, kinds: set[str] = frozenset(),
                config_exists: Callable[[str], bool] | None = None) -> list[str]:
    """Baselines under ``root`` in this run's scope (module docstring) that it did not use;
    ``kinds``: the names of the suite's kinds (their baselines live under ``<kind>/``);
    ``config_exists``: whether some kind has a config of that id (a variant's suffix aside)."""
    used_configs = {u.rsplit("/", 1)[-1] for u in usage.used}
    unused = []
    for name in baseline_names(root):
        config = name.rsplit("/", 1)[-1]
        exists = config_exists is None or config_exists(config)
        if name in usage.used or name in usage.excused or (exists and config not in used_configs):
            continue
        if any(name.startswith(p) for p in usage.excused_prefixes):
            continue
        if name.split("/", 1)[0] in kinds:
            in_scope = suite_ran
        else:
            in_scope = usage.whole_project or any(name.startswith(p) for p in usage.module_prefixes)
        if in_scope:
            unused.append(name)
    return unused


def incomplete_reason(usage: BaselineUsage, exitstatus, failed: int, maxfail: int) -> str | None:
    """Why this run cannot tell which baselines are unused, or None when it can."""
    if exitstatus in (pytest.ExitCode.INTERRUPTED, pytest.ExitCode.INTERNAL_ERROR, pytest.ExitCode.USAGE_ERROR,
                      pytest.ExitCode.NO_TESTS_COLLECTED):
        return f"the run ended with {pytest.ExitCode(exitstatus).name}"
    if maxfail and failed >= maxfail:
        return "the run stopped at the first failures (-x, --maxfail)"
    if usage.workers_down:
        return f"a worker went down ({', '.join(usage.workers_down)})"
    return None


USAGE_KEY = pytest.StashKey[BaselineUsage]()
