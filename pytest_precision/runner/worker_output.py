"""What an xdist worker hands its controller when it ends, in one channel: the case records (for
the summary table and the reports) and the baseline usage (for the unused-baselines list).

The worker fills it at session finish (``hand_over``), into pytest-xdist's ``workeroutput``, as
plain JSON-able data (as syrupy does with its snapshot usage); the controller merges each worker's
as that worker goes down (``take_from``). Whatever else a worker must report goes here too.
"""
from __future__ import annotations

import pytest

from ..baselines.usage import USAGE_KEY
from .options import RECORDS_KEY

__all__ = ["RECORDS", "USAGE", "hand_over", "take_from"]

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
