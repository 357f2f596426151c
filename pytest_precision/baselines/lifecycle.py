"""The one life of a golden baseline: find it, fail when it is missing (saying the command that
writes it), judge a result within its accepted budget, or accept a new one under the update flag
and say what changed. Every golden goes through :meth:`BaselineCheck.check`: the tensor outputs
of the softmax and attention kinds, the metric dictionaries of the training kind, the ``golden``
fixture of users' own tests.

What is stored and how it is judged is a :class:`BaselineEntry`: :class:`TensorOutputs` here
(float64 oracles on the config's rounded inputs stored as float32, errors in ULPs or max abs),
the training kind's metric entries in ``pytest_precision.training.baseline``.

Accepted budgets are keyed by the numerics key of the machine (``platform.devices``: device type
and CPU ISA or GPU compute capability), then by output name. A machine with no budget of its own
is judged by the widest budget recorded for its device type, or when its type has none (a first
run on a GPU of goldens recorded on CPUs) by the widest of any machine, and the result says so;
a strict check (``--precision-strict-budgets``) borrows nothing.

Nothing is written without the update flag, and nothing is written by ``check`` itself: under the
flag it *prepares* the write, and whoever knows the case's verdict (the suite's runner, the
``golden`` fixture at the end of its test) calls :meth:`BaselineCheck.commit` when the result
passed every other check, or :meth:`BaselineCheck.refuse` with the reason. A rewrite keeps what
the old pair still holds (other machines' budgets, speed records) from whichever file is
readable, moves an unreadable file aside, and refuses a file of a newer schema.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch

from ..numerics.budgets import MACHINE_SPREAD, Budget, abs_floor, regression_budget, violations
from ..platform.devices import device_class, machine_name, numerics_key
from ..numerics.formats import format_of
from ..numerics.metrics import Comparison, compare
from .store import Baseline, BaselineError, BaselineStore, checksum, same_value, unlimited

__all__ = ["BaselineCheck", "BaselineResult", "BaselineEntry", "TensorOutput", "TensorOutputs", "PendingWrite",
           "budget_sources", "SINGLE"]

SINGLE = "reference"  # the array name when a case has one output


def budget_sources(recorded: dict, key: str, strict: bool = False) -> list[str]:
    """The numerics keys whose budgets judge this machine: its own, else (unless ``strict``) every
    one of its device type, else every one recorded. A borrowed budget is scaled by this machine's
    peer error where the entry can (``BaselineEntry.budget_from``), so the reference stored on a
    CPU still judges a GPU's result through the error a correct op has on each."""
    if key in recorded or strict:
        return [key] if key in recorded else []
    same_type = sorted(k for k in recorded if device_class(k) == device_class(key))
    return same_type or sorted(recorded)


@dataclass
class BaselineResult:
    """What a check found. ``problems`` are (category, sentence) past the budget; ``error`` says
    why the baseline cannot judge (missing, corrupt, inconsistent) or could not be written;
    ``absent`` why a case has none at all (drawn inputs); ``note`` that the budget was borrowed
    from other machines. Under the update flag, ``updated`` is the line of a committed write and
    ``refused`` the reason a prepared one was not accepted (with its line, ``refused_line``)."""

    comparisons: dict[str, Comparison] = field(default_factory=dict)
    budgets: dict = field(default_factory=dict)  # output name -> Budget (tensors) or budget dict (metrics)
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

    def message_lines(self, update_command: str) -> list[str]:
        """The golden's part of a failure message."""
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
            label = f"{name} " if several else ""
            lines.append(f"  {label}against the golden (regression budget {b.describe()}):")
            over = f", {c.count_over(b.max_ulp)} of {c.numel} elements over" if b.max_ulp is not None else ""
            lines.append(f"    max ULP {c.max_ulp:.4g}, max abs {c.max_abs:.4g}{over};"
                         f" overflow {c.overflow}, underflow {c.underflow}, NaN {c.nan}")
        for note in (self.note, self.moved_inputs, self.unjudged):
            if note:
                lines.append(f"    ({note})")
        lines.append(f"  if the new results are intended, accept them as the golden with: {update_command}")
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
            label = _label(name) if len(new) > 1 else ""
            moved += [f"{label}{k} {before.get(k)!r} -> {v!r}" for k, v in e["budget"].items() if before.get(k) != v]
        return moved


@dataclass
class TensorOutput:
    """One output under golden check: what the run gave and its float64 oracle."""

    out: torch.Tensor
    reference: torch.Tensor
    dtype: torch.dtype
    scale: float = 1.0
    log_domain: bool = False
    abs_budget: bool = False  # regression budget on max abs error instead of max ULP (attention)
    underflow_floor: float = 0.0  # see numerics.metrics.compare
    # the max-abs and RMS error a correct implementation can have under another summation order
    # (the problem's conditioning, given by the kind): the regression budget never sits below them
    error_floor: float | None = None
    rms_floor: float | None = None
    # the same-precision peer against the oracle in this run: what the budget's typical error is
    # never held below a fraction of, and what scales a budget borrowed from another machine
    peer: Comparison | None = None

    def compare_with(self, ref: torch.Tensor) -> Comparison:
        return compare(self.out, ref, self.dtype, scale=self.scale, log_domain=self.log_domain,
                       underflow_floor=self.underflow_floor)

    def budget_for(self, accepted: Comparison, ref: torch.Tensor) -> Budget:
        if not self.abs_budget:
            return regression_budget(accepted)
        top = float(ref[torch.isfinite(ref)].abs().max()) if bool(torch.isfinite(ref).any()) else 0.0
        return regression_budget(accepted, abs_floor_value=abs_floor(top, format_of(self.dtype).mantissa_bits),
                                 reorder_max=self.error_floor or 0.0, reorder_rms=self.rms_floor or 0.0)


# what a golden keeps of the peer's error at acceptance (to carry a budget to another machine)
_PEER_FIELDS = ("max_ulp", "mean_ulp", "max_abs", "rms_abs")


class TensorOutputs(BaselineEntry):
    """Named tensor outputs: the float32 references are stored, each output's error against its
    reference is judged by the regression budget accepted with it."""

    def __init__(self, outputs: dict[str, TensorOutput], *, inputs: torch.Tensor | None = None,
                 seed: int | None = None, input_spec: dict | None = None):
        self.outputs = outputs
        self.names = tuple(outputs)
        self.input_checksum = checksum(inputs) if inputs is not None else None
        self.seed, self.input_spec = seed, input_spec
        self._refs = {n: o.reference.detach().to(torch.float32).cpu() for n, o in outputs.items()}
        self.peer_scale: dict[str, float] = {}  # output -> how much more this machine's peer errs (borrowed budgets)

    def arrays(self) -> dict[str, torch.Tensor]:
        return self._refs

    def accepted_outputs(self, result: BaselineResult) -> dict[str, dict]:
        entries = {}
        for name, o in self.outputs.items():
            cmp = o.compare_with(self._refs[name])
            budget = o.budget_for(cmp, self._refs[name])
            result.comparisons[name], result.budgets[name] = cmp, budget
            entries[name] = {"budget": budget.as_dict(), "accepted": cmp.summary()}
            if o.peer is not None:
                entries[name]["peer"] = {k: getattr(o.peer, k) for k in _PEER_FIELDS}
        return entries

    def meta_fields(self) -> dict:
        dtypes = {n: format_of(o.dtype).name for n, o in self.outputs.items()}
        return {"dtypes": dtypes, "seed": self.seed, "input_spec": self.input_spec, "input_checksum": self.input_checksum}

    def carried_meta(self, old: Baseline | None) -> dict:
        """The old metadata (other machines' budgets, speed records) when it is about the same
        outputs: the same names and, where the .npz could be read, the same shapes."""
        if old is None:
            return {}
        if old.arrays is None:  # only the JSON could be read: its outputs' names
            same = set(old.meta.get("dtypes") or self._refs) == set(self._refs)
        else:
            same = set(old.arrays) == set(self._refs) and all(old.arrays[n].shape == self._refs[n].shape
                                                               for n in self._refs)
        return dict(old.meta) if same else {}

    def inputs_moved(self, base: Baseline) -> bool:
        """Whether the inputs' bits differ from those the golden was accepted on while what drew
        them (regime, seed, shapes and dtypes) is the same: another machine drew them (torch's
        float32 ``randn`` differs between vector ISAs), not another generator."""
        stored = base.meta.get("input_checksum")
        if self.input_checksum is None or stored is None or stored == self.input_checksum:
            return False
        spec = base.meta.get("input_spec")
        return spec is not None and spec == json.loads(json.dumps(self.input_spec))

    def inconsistency(self, base: Baseline, key: str, command: str) -> str | None:
        stored = base.meta.get("input_checksum")
        if self.input_checksum is not None and stored is not None and stored != self.input_checksum \
                and not self.inputs_moved(base):
            return (f"{base.json_path}: the inputs changed since the golden was accepted (checksum "
                    f"{stored[:12]} -> {self.input_checksum[:12]}): a generator or input-spec change, not a "
                    f"precision regression; check it and re-accept with: {command}")
        if set(base.arrays) != set(self.outputs):
            return (f"{base.npz_path}: holds outputs {sorted(base.arrays)}, this check has {sorted(self.outputs)}; "
                    f"re-accept with: {command}")
        for name, o in self.outputs.items():
            ref = base.arrays[name]
            if tuple(ref.shape) != tuple(o.out.shape):
                return (f"{base.npz_path}: shape mismatch for {name}, golden {tuple(ref.shape)} vs output "
                        f"{tuple(o.out.shape)}; re-accept with: {command}")
        return None

    def budget_from(self, name: str, records: list[dict], borrowed: bool) -> Budget:
        """Borrowed budgets are scaled by how much more this machine's peer errs than the peer
        did where each was accepted (its summation order is this machine's too), and at least by
        the spread measured between machines (``MACHINE_SPREAD``): never down."""
        o = self.outputs[name]
        largest_key, typical_key = ("max_abs", "rms_abs") if o.abs_budget else ("max_ulp", "mean_ulp")
        cap = self.peer_cap
        budgets = []
        for record in records:
            budget = Budget.from_dict(record["budget"])
            if borrowed:
                stored = record.get("peer")
                largest = typical = 1.0
                if o.peer is not None and isinstance(stored, dict):
                    largest = _ratio(getattr(o.peer, largest_key), stored.get(largest_key), cap)
                    typical = _ratio(getattr(o.peer, typical_key), stored.get(typical_key), cap)
                self.peer_scale[name] = max(self.peer_scale.get(name, 1.0), largest, typical)
                budget = budget.scaled(max(largest, MACHINE_SPREAD["largest"]), max(typical, MACHINE_SPREAD["typical"]))
            budgets.append(budget)
        return Budget.widest(budgets)

    @property
    def peer_cap(self) -> float:
        return MAX_PEER_SCALE["another device type" if self.across_devices else "same device type"]

    def borrowed_clause(self) -> str:
        grown = max(self.peer_scale.values(), default=1.0)
        spread = (f"the spread between machines ({MACHINE_SPREAD['largest']:.3g} x the largest error, "
                  f"{MACHINE_SPREAD['typical']:.3g} x the typical)")
        if grown >= self.peer_cap:
            return (f", scaled by this machine's peer error, at most {self.peer_cap:g} x: the stored peer errs "
                    f"{self.peer_cap:g} or more times less than this machine's (more than machines were measured to "
                    "differ: an edited golden? see `python -m pytest_precision baselines show`)")
        if grown > max(MACHINE_SPREAD.values()):
            return f", scaled by this machine's peer error (up to {grown:.3g} x) or {spread}"
        return f", scaled by {spread}"

    def changes(self, old: dict[str, dict], new: dict[str, dict]) -> list[str]:
        """The budget fields that moved, then the peer's errors (what scales a borrowed budget)."""
        moved = super().changes(old, new)
        for name, e in new.items():
            before, after = old.get(name, {}).get("peer") or {}, e.get("peer") or {}
            label = _label(name) if len(new) > 1 else ""
            moved += [f"{label}peer {k} {before.get(k)!r} -> {after.get(k)!r}" for k in _PEER_FIELDS
                      if not same_value(before.get(k), after.get(k))]
        return moved

    def judge(self, base: Baseline, budgets: dict, result: BaselineResult) -> None:
        moved = self.inputs_moved(base)
        if moved:
            result.moved_inputs = (
                "the inputs' bits differ from those the golden was accepted on, drawn from the same seed and spec "
                "(another machine's float32 randn, or an edit of the generator that kept its shapes and dtypes? "
                "pytest_precision.numerics.inputs.seeded_normal draws the same bits everywhere): judged by this run's error against its float64 oracle within the golden's budget, "
                "not element by element")
        for name, o in self.outputs.items():
            # with moved inputs the stored reference is another input's: the error is taken against
            # this run's oracle instead, the quantity the budget was accepted on
            cmp = o.compare_with(o.reference if moved else base.arrays[name])
            budget = budgets[name] if o.peer is None else budgets[name].with_typical_floor(o.peer)
            result.comparisons[name], result.budgets[name] = cmp, budget
            prefix = "" if name == SINGLE else f"{name}: "
            result.problems += [(cat, prefix + s) for cat, s in violations(cmp, budget)]

    def describe(self, outputs: dict[str, dict]) -> str:
        return "; ".join(_label(n) + Budget.from_dict(e["budget"]).describe() for n, e in outputs.items())


# The most a borrowed budget grows by the peers' ratio: a stored peer error 1e300 times smaller than
# this machine's is an edited golden, and would let any regression pass. Between machines of one
# device type a correct op's largest error moved up to 3.0 x (MACHINE_SPREAD's measurement); to
# another device type (a first run on a GPU of goldens recorded on CPUs) nothing is measured yet.
MAX_PEER_SCALE = {"same device type": 3.0, "another device type": 16.0}


def _ratio(now: float, then, cap: float) -> float:
    """How many times ``then`` ``now`` is, at least 1 (1 where either is missing, zero or not
    finite), at most ``cap``."""
    try:
        r = float(now) / float(then)
    except (TypeError, ValueError, ZeroDivisionError):
        return 1.0
    return min(r, cap) if r > 1.0 and r != float("inf") else 1.0


def _label(name: str) -> str:
    return "" if name == SINGLE else f"{name} "


@dataclass
class PendingWrite:
    """A golden prepared under the update flag, written only when the case's verdict allows."""

    result: BaselineResult
    arrays: dict[str, torch.Tensor]
    meta: dict
    unreadable: list  # files of the old pair that could not be read: moved aside, not overwritten
    line: str  # what the write changes, for the summary


@dataclass
class BaselineCheck:
    """The baseline store bound to one test key, config and device: the golden of one case."""

    store: BaselineStore
    key: str
    config_id: str
    device: str
    update: bool
    update_command: str
    strict: bool = False  # a machine without a budget of its own fails rather than borrow one
    pending: list[PendingWrite] = field(default_factory=list, init=False, repr=False)
    committed: bool = field(default=False, init=False)  # a prepared golden was written

    @property
    def budget_key(self) -> str:
        return numerics_key(self.device)

    @property
    def head(self) -> str:
        """How the lines about writing this golden begin: ``<key> [<config>] on <numerics key>``."""
        return f"{self.key} [{self.config_id}] on {self.budget_key}"

    def check(self, entry: BaselineEntry) -> BaselineResult:
        """Judge ``entry`` against its stored baseline, or (update flag) prepare it as the new one:
        written by :meth:`commit` once the case passed its other checks."""
        if self.update:
            return self._prepare(entry)
        try:
            # no stored array larger than the case's output is inflated
            base = self.store.load(self.key, self.config_id, {n: tuple(a.shape) for n, a in entry.arrays().items()})
        except BaselineError as e:
            if e.newer_schema is not None:
                return BaselineResult(error=str(e))
            return BaselineResult(error=f"{e}\n(the file is left as it is; rewrite it with: {self.update_command})")
        if base is None:
            npz, _ = self.store.paths(self.key, self.config_id)
            return BaselineResult(error=f"no golden baseline at {npz}\nwrite it with: {self.update_command}")
        return self._judge(entry, base)

    def check_outputs(self, outputs: dict[str, TensorOutput], *, inputs: torch.Tensor | None = None,
                      seed: int | None = None, input_spec: dict | None = None) -> BaselineResult:
        return self.check(TensorOutputs(outputs, inputs=inputs, seed=seed, input_spec=input_spec))

    def check_output(self, out: torch.Tensor, reference: torch.Tensor, *, dtype: torch.dtype | None = None,
                     inputs: torch.Tensor | None = None, scale: float = 1.0, log_domain: bool = False,
                     seed: int | None = None, input_spec: dict | None = None) -> BaselineResult:
        """One output: ``out`` against the stored reference under the regression budget, or (update
        flag) ``reference`` stored with the error ``out`` has against it as the new budget."""
        one = TensorOutput(out, reference, dtype or out.dtype, scale, log_domain)
        return self.check_outputs({SINGLE: one}, inputs=inputs, seed=seed, input_spec=input_spec)

    def _judge(self, entry: BaselineEntry, base: Baseline) -> BaselineResult:
        error = entry.inconsistency(base, self.budget_key, self.update_command)
        if error:
            return BaselineResult(error=error)
        key = self.budget_key
        recorded = base.meta.get("budgets", {})
        result = BaselineResult()
        sources = budget_sources(recorded, key, self.strict)
        if not sources:
            scope = " (strict budgets: none borrowed)" if self.strict else ""
            return BaselineResult(error=(
                f"{base.json_path}: no accepted budget for '{key}'{scope} (has: "
                f"{', '.join(recorded) or 'none'}); accept with: {self.update_command}"))
        budgets = {}
        entry.across_devices = all(device_class(k) != device_class(key) for k in sources)
        for name in entry.names:
            try:
                budgets[name] = entry.budget_from(name, [recorded[k]["outputs"][name] for k in sources],
                                                  borrowed=sources != [key])
            except (KeyError, TypeError, ValueError) as e:
                return BaselineResult(error=f"{base.json_path}: corrupt budget for '{name}' under "
                                            f"{', '.join(sources)} ({e!r})")
        unlimited_now = sorted({u for k in sources for name in entry.names
                                for u in unlimited(recorded[k]["outputs"][name])})
        if unlimited_now:
            result.unjudged = (f"not judged on {', '.join(unlimited_now)}: the golden's limit is unlimited because "
                               "what it accepted was not finite")
        try:
            entry.judge(base, budgets, result)
        except (KeyError, TypeError, ValueError) as e:  # a hand-edited budget of the wrong type
            return BaselineResult(error=f"{base.json_path}: corrupt budget under {', '.join(sources)} ({e!r})")
        if sources != [key]:  # after judging: what the entry did with borrowed budgets is known then
            result.borrowed_across_devices = all(device_class(k) != device_class(key) for k in sources)
            other = (f" (no {device_class(key)} machine has one: a first run on this device type)"
                     if result.borrowed_across_devices else "")
            result.note = (f"no budget recorded for {key}: judged by the widest recorded for "
                           f"{', '.join(sources)}{other}{entry.borrowed_clause()}; record this machine's with: "
                           f"{self.update_command}")
        return result

    def _prepare(self, entry: BaselineEntry) -> BaselineResult:
        """The new golden of ``entry``, keeping what the old pair still holds: another machine's
        budgets and the speed records, from the JSON when it is readable (whatever the .npz)."""
        pair = self.store.read_pair(self.key, self.config_id)
        if pair.newer_schema is not None:
            return BaselineResult(error=f"{pair.json_error}; the file is left as it is")
        old = Baseline(pair.arrays, pair.meta, pair.npz_path, pair.json_path) if pair.meta is not None else None
        result = BaselineResult()
        outputs = entry.accepted_outputs(result)
        meta = entry.carried_meta(old)
        for stale in ("schema_version", "npz_sha256"):
            meta.pop(stale, None)
        budgets = dict(meta.get("budgets", {}))
        key = self.budget_key
        old_outputs = budgets.get(key, {}).get("outputs", {}) if isinstance(budgets.get(key), dict) else {}
        kept = sorted(k for k in budgets if k != key)
        budgets[key] = {"outputs": outputs, "torch": torch.__version__, "machine": machine_name(self.device),
                        **entry.key_record()}
        meta.update({"key": self.key, "config": self.config_id, **entry.meta_fields(), "written_on": key,
                     "torch": torch.__version__, "budgets": budgets})
        head = self.head
        if not old_outputs:
            line = f"{head} new: {entry.describe(outputs)}"
        else:
            moved = entry.changes(old_outputs, outputs)
            line = f"{head} changed: {', '.join(moved)}" if moved else f"{head} unchanged"
        speed = len(meta.get("speed") or {})
        if kept or speed:
            line += "; kept " + " and ".join(filter(None, (kept and f"the budgets of {', '.join(kept)}",
                                                           speed and f"{speed} speed record(s)")))
        self.pending.append(PendingWrite(result, entry.arrays(), meta, pair.unreadable(), line))
        return result

    def commit(self) -> None:
        """Write what ``check`` prepared (the case passed its other checks). A file of the old pair
        that could not be read is moved aside and named in the result's line; a write that fails
        (a read-only directory) becomes the result's error."""
        for p in self.pending:
            try:
                moved = self.store.move_aside(p.unreadable)
                self.store.write(self.key, self.config_id, p.arrays, p.meta)
            except OSError as e:
                where = e.filename or self.store.paths(self.key, self.config_id)[0].parent
                p.result.error = f"{self.head}: cannot write the golden baseline: {where}: {e.strerror or e}"
                continue
            p.result.updated = p.line + "".join(f"; moved the unreadable {a} aside to {b}" for a, b in moved)
            self.committed = True
        self.pending.clear()

    def refuse(self, reason: str) -> None:
        """Drop what ``check`` prepared: the case failed (``reason``); nothing is written."""
        for p in self.pending:
            p.result.refused, p.result.refused_line = reason, f"{self.head} not accepted: {reason}"
        self.pending.clear()

    def speed_record(self, fingerprint: str) -> dict | None:
        """The speed and memory recorded with this golden for a device fingerprint, if any."""
        try:
            meta = self.store.load_meta(self.key, self.config_id)
        except BaselineError:
            return None  # the accuracy check names the damaged file
        return None if meta is None else meta.get("speed", {}).get(fingerprint)

    def record_speed(self, fingerprint: str, entry: dict) -> bool:
        """Store ``entry`` for the fingerprint beside the golden (update flag only); False when
        there is no golden to store it with."""
        try:
            base = self.store.load(self.key, self.config_id)
        except BaselineError:
            return False
        if base is None:
            return False
        meta = dict(base.meta)
        meta["speed"] = {**meta.get("speed", {}), fingerprint: entry}
        self.store.write_meta(self.key, self.config_id, meta)
        return True
