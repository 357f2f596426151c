"""What one golden check stores and how it is judged (:class:`BaselineEntry`, the hooks the
lifecycle calls), and what the check found (:class:`BaselineResult`, with the golden's part of a
failure message).

A stored baseline is an ``.npz`` of float32 arrays and a JSON of metadata whose ``budgets`` map
numerics key -> ``{"outputs": {name: {"budget": ..., "accepted": ...}}, "torch", "machine",
...key_record()}``. The entries: :class:`~pytest_precision.baselines.tensors.TensorOutputs`
(tensor outputs), the training kind's metric entries in ``pytest_precision.training.baseline``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..numerics.describe import Held, comparison_lines
from ..numerics.metrics import Comparison
from .commands import offer
from .reading import Baseline

__all__ = ["SINGLE", "BaselineResult", "BaselineEntry", "output_label"]

SINGLE = "reference"  # the array name when a case has one output


@dataclass
class BaselineResult:
    """What a check found. ``problems`` are (category, sentence) past the budget; ``error`` says
    why the baseline cannot judge (missing, corrupt, inconsistent) or could not be written;
    ``absent`` why a case has none at all (drawn inputs); ``note`` that the budget was borrowed
    from other machines. Under the update flag, ``updated`` is the line of a committed write and
    ``refused`` the reason a prepared one was not accepted (with its line, ``refused_line``)."""

    comparisons: dict[str, Comparison] = field(default_factory=dict)
    budgets: dict = field(default_factory=dict)  # output name -> Budget (tensors) or a training budget (training.budget)
    problems: list[tuple[str, str]] = field(default_factory=list)
    error: str | None = None
    updated: str | None = None  # "old -> new" line when the baseline was (re)written
    note: str | None = None
    absent: str | None = None
    borrowed_across_devices: bool = False  # the borrowed budgets are of another device type
    refused: str | None = None
    refused_line: str | None = None
    moved_inputs: str | None = None  # the inputs' bits moved (same seed and spec): how the result was judged instead
    unjudged: str | None = None  # limits the golden holds as unlimited (what was accepted was not finite)

    @property
    def comparison(self) -> Comparison | None:
        return next(iter(self.comparisons.values()), None)

    @property
    def budget(self):
        return next(iter(self.budgets.values()), None)

    def message_lines(self, update_command: str, *, brief: bool = True) -> list[str]:
        """The golden's part of a failure message: ``brief`` in a suite case's (whose oracle block
        gave the statistics and the worst elements), the whole block in the ``golden`` fixture's."""
        if self.absent:
            return [f"  no golden baseline: {self.absent}"]
        if self.refused:
            return [f"  golden baseline not accepted: the case failed ({self.refused}); nothing written"]
        if self.error:
            return ["  golden baseline:"] + ["    " + s for s in self.error.splitlines()]
        lines = []
        several = len(self.comparisons) > 1
        for name, c in self.comparisons.items():
            b = self.budgets[name]
            lines += comparison_lines(c, f"the golden (regression budget {b.describe()})", held=[Held.regression(b)],
                                      name=name if several else None, brief=brief)
        lines += [f"    ({note})" for note in (self.note, self.moved_inputs, self.unjudged) if note]
        lines.append(f"  {offer(update_command)}")
        return lines


class BaselineEntry:
    """What one check stores and how it is judged: the hooks :class:`BaselineCheck` calls.

    A stored baseline is an ``.npz`` of float32 arrays and a JSON of metadata whose ``budgets``
    map numerics key -> ``{"outputs": {name: {"budget": ..., "accepted": ...}}, "torch", "machine",
    ...key_record()}``."""

    names: tuple[str, ...] = ()
    # set by BaselineCheck before budget_from: the budgets borrowed are of another device type only
    across_devices: bool = False

    def borrowed_clause(self) -> str:
        """Added to the borrowed-budget note: how the borrowed budgets were adapted, what they leave unjudged."""
        return ""

    def arrays(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def accepted_outputs(self, result: BaselineResult) -> dict[str, dict]:
        """{name: {"budget": ..., "accepted": ...}} for this machine's key (may fill ``result``)."""
        raise NotImplementedError

    def accepted_against(self, base: Baseline, result: BaselineResult) -> dict[str, dict]:
        """The accepted budgets of this run against a stored golden's references (a machine's budgets
        added to an existing golden); by default those of ``accepted_outputs``, which the stored
        tensors do not enter."""
        return self.accepted_outputs(result)

    def meta_fields(self) -> dict:
        """Top-level metadata written with the baseline (seed, input spec and checksum, dtypes)."""
        return {}

    def key_record(self) -> dict:
        """Extra fields stored under this machine's numerics key."""
        return {}

    def carried_meta(self, old: Baseline | None) -> dict:
        """What a rewrite keeps of the old metadata (its ``budgets`` are updated, not replaced).
        ``old.arrays`` is None when only the JSON could be read."""
        return {"budgets": old.meta.get("budgets", {})} if old is not None else {}

    def inconsistency(self, base: Baseline, key: str, command: str) -> str | None:
        """Why the stored baseline cannot judge this result (other inputs, other outputs), or None."""
        return None

    def budget_from(self, name: str, records: list[dict], borrowed: bool) -> object:
        """The budget of output ``name`` from the records ({"budget", "accepted", ...}) of the
        machines that judge this one: this machine's own, or (``borrowed``) every machine of its
        device type, whose loosest budget applies. Raises KeyError, TypeError or ValueError on a
        corrupt record."""
        raise NotImplementedError

    def judge(self, base: Baseline, budgets: dict, result: BaselineResult) -> None:
        """Fill ``result`` with the comparisons and the problems past ``budgets``."""
        raise NotImplementedError

    def describe(self, outputs: dict[str, dict]) -> str:
        """The accepted budgets, for the line that reports a new baseline."""
        raise NotImplementedError

    def changes(self, old: dict[str, dict], new: dict[str, dict]) -> list[str]:
        """Each budget field that moved, "old -> new", for the line that reports a rewrite."""
        moved = []
        for name, e in new.items():
            before = old.get(name, {}).get("budget", {}) or {}
            label = output_label(name) if len(new) > 1 else ""
            moved += [f"{label}{k} {before.get(k)!r} -> {v!r}" for k, v in e["budget"].items() if before.get(k) != v]
        return moved

def output_label(name: str) -> str:
    return "" if name == SINGLE else f"{name} "
