"""What an xdist worker hands its controller when it ends, in one channel: the case records (for
the summary table and the reports) and the baseline usage (for the unused-baselines list). The
goldens a case wrote also travel with its report as it ends (``WRITTEN_PROPERTY``, taken by
``take_written``), and a golden whose report never arrived (the run interrupted while a worker
wrote it) is found on disk (``unlisted_goldens``): an interrupted run still lists every golden
it wrote.

The worker fills it at session finish (``hand_over``), into pytest-xdist's ``workeroutput``, as
plain JSON-able data (as syrupy does with its snapshot usage); the controller merges each worker's
as that worker goes down (``take_from``). Whatever else a worker must report goes here too.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..baselines.usage import USAGE_KEY
from .collection import WRITTEN_PROPERTY
from .options import RECORDS_KEY

__all__ = ["RECORDS", "USAGE", "WRITTEN_KEY", "STARTED_KEY", "hand_over", "take_from", "take_written",
           "unlisted_goldens"]

# on the controller: the golden lines the cases' reports carried, in the order they came
WRITTEN_KEY = pytest.StashKey[list]()
STARTED_KEY = pytest.StashKey[float]()  # when the run began (time.time()): what it wrote is newer

# keys under pytest-xdist's workeroutput
RECORDS = "precision_records"
USAGE = "precision_baseline_usage"


def hand_over(config: pytest.Config) -> None:
    """On a worker, at session finish (after the usage counts the store's goldens): its output."""
    config.workeroutput[RECORDS] = config.stash[RECORDS_KEY]
    config.workeroutput[USAGE] = config.stash[USAGE_KEY].as_workeroutput()


def take_from(config: pytest.Config, node, error) -> None:
    """On the controller, as worker ``node`` goes down: its output merged into the run's. A worker
    that went down with an error lost its usage, so no baseline is called unused."""
    output = getattr(node, "workeroutput", {})
    config.stash[RECORDS_KEY].extend(output.get(RECORDS, []))
    usage = config.stash[USAGE_KEY]
    usage.merge(output.get(USAGE, {}))
    if error is not None:
        usage.workers_down.append(getattr(getattr(node, "gateway", None), "id", "?"))


def take_written(config: pytest.Config, report) -> None:
    """On the controller, as a worker's case report arrives: the golden line it carries, if any."""
    for name, value in getattr(report, "user_properties", ()):
        if name == WRITTEN_PROPERTY:
            config.stash.setdefault(WRITTEN_KEY, []).append(value)


def unlisted_goldens(root: Path, since: float, lines: list[str]) -> list[str]:
    """A line for each golden under ``root`` written since ``since`` that none of ``lines`` names
    (``<key> [<config>] on ...``, as each written golden's line begins)."""
    out = []
    for path in sorted(root.rglob("*.json")) if root.is_dir() else ():
        try:
            if path.stat().st_mtime < since:
                continue
            meta = json.loads(path.read_text())
            key, config = meta["key"], meta["config"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        head = f"{key} [{config}] on "
        if not any(line.startswith(head) for line in lines):
            out.append(f"{head}{meta.get('written_on', '?')} written; its case's report never arrived (the run was "
                       f"interrupted): {path}")
    return out

