"""The one life of a golden baseline: find it, fail when it is missing (saying the command that
writes it), judge a result within its accepted budget, or accept a new one under the update flag
and say what changed. Every golden goes through :meth:`BaselineCheck.check`: the tensor outputs
of the softmax and attention kinds, the metric dictionaries of the training kind, the ``golden``
fixture of users' own tests.

What is stored and how it is judged is a :class:`BaselineEntry` (``entry``): the tensor outputs
(``tensors``: float64 oracles on the config's rounded inputs stored as float32, errors in ULPs or
max abs), the training kind's metric entries in ``pytest_precision.training.baseline``.

Accepted budgets are keyed by the numerics key of the machine (``platform.devices``: device type
and CPU ISA or GPU compute capability), then by output name. A machine with no budget of its own
is judged by the widest budget recorded for its device type, or when its type has none (a first
run on a GPU of goldens recorded on CPUs) by the widest of any machine, and the result says so;
a strict check (``--precision-strict-budgets``) borrows nothing.

A machine's budgets are added to existing goldens (``add_machine``, ``--precision-add-machine``: a
first run on a new GPU): each golden is judged as above, and where it passes, this machine's budgets,
from its errors against the *stored* references, are written beside the others into the JSON alone;
the tensors and the other machines' budgets are left as they are, and a golden that already holds
this machine's key, or a case without a golden, writes nothing.

Nothing is written without the update flag, and nothing is written by ``check`` itself: under the
flag it *prepares* the write, and whoever knows the case's verdict (the suite's runner, the
``golden`` fixture at the end of its test) calls :meth:`BaselineCheck.commit` when the result
passed every other check, or :meth:`BaselineCheck.refuse` with the reason. A rewrite keeps what
the old pair still holds (other machines' budgets, speed records) from whichever file is
readable, moves an unreadable file aside, and refuses a file of a newer schema.

A borrowing machine is less sensitive than one with budgets of its own: nanoGPT's attention with its
softmax computed in the input dtype failed 38 of 120 cases with the machine's own budgets and 2 of
120 with borrowed ones. So ``--precision-strict-budgets`` is for a machine whose budgets are recorded.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..numerics.metrics import ComparisonSpec
from ..platform.devices import device_class, machine_name, numerics_key
from .commands import OFFER, offer
from .entry import SINGLE, BaselineEntry, BaselineResult
from .reading import Baseline
from .schema import BaselineError, unlimited
from .store import BaselineStore
from .tensors import TensorOutput, TensorOutputs

__all__ = ["BaselineCheck", "PendingWrite", "budget_sources"]


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
class PendingWrite:
    """A golden prepared under the update flag, written only when the case's verdict allows."""

    result: BaselineResult
    arrays: dict[str, torch.Tensor] | None  # None: the JSON alone is rewritten (a machine's budgets added)
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
    add_machine: bool = False  # this machine's budgets added to existing goldens, nothing else written
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
        base, error = self._load(entry)
        if error is not None:
            return error
        result = self._judge(entry, base)
        if self.add_machine:
            self._add_machine(entry, base, result)
        return result

    def _load(self, entry: BaselineEntry) -> tuple[Baseline | None, BaselineResult | None]:
        """The stored golden, or the result that says why there is none to judge against."""
        try:
            # no stored array larger than the case's output is inflated
            base = self.store.load(self.key, self.config_id, {n: tuple(a.shape) for n, a in entry.arrays().items()})
        except BaselineError as e:
            if e.newer_schema is not None:
                return None, BaselineResult(error=str(e))
            return None, BaselineResult(error=f"{e}\n(the file is left as it is; {offer(self.update_command)})")
        if base is None:
            npz, _ = self.store.paths(self.key, self.config_id)
            return None, BaselineResult(error=f"no golden baseline at {npz}\n{offer(self.update_command)}")
        return base, None

    def _add_machine(self, entry: BaselineEntry, base: Baseline, result: BaselineResult) -> None:
        """Prepare this machine's budgets beside the others' in ``base``'s JSON, where the golden
        passed (the module docstring); what it did goes into ``result.note``."""
        key = self.budget_key
        recorded = base.meta.get("budgets", {})
        if key in recorded:
            result.note = f"{self.head}: the golden already holds budgets for {key}; left as they are"
            return
        if result.error or result.problems:
            return  # the case fails on the golden: nothing is added (the runner refuses nothing prepared)
        outputs = entry.accepted_against(base, BaselineResult())
        meta = {k: v for k, v in base.meta.items() if k != "schema_version"}
        meta["budgets"] = {**recorded, key: {"outputs": outputs, "torch": torch.__version__,
                                             "machine": machine_name(self.device), **entry.key_record()}}
        line = (f"{self.head} added: {entry.describe(outputs)}; kept the tensors and the budgets of "
                f"{', '.join(sorted(recorded)) or 'no other machine'}")
        if result.note:  # judged by borrowed budgets: what this run records is this machine's own
            result.note = result.note.split("; " + OFFER)[0] + "; this machine's are added now"
        self.pending.append(PendingWrite(result, None, meta, [], line))

    def check_outputs(self, outputs: dict[str, TensorOutput], *, inputs: torch.Tensor | None = None,
                      seed: int | None = None, input_spec: dict | None = None) -> BaselineResult:
        return self.check(TensorOutputs(outputs, inputs=inputs, seed=seed, input_spec=input_spec))

    def check_output(self, out: torch.Tensor, reference: torch.Tensor, *, dtype: torch.dtype | None = None,
                     inputs: torch.Tensor | None = None, scale: float = 1.0, log_domain: bool = False,
                     seed: int | None = None, input_spec: dict | None = None) -> BaselineResult:
        """One output: ``out`` against the stored reference under the regression budget, or (update
        flag) ``reference`` stored with the error ``out`` has against it as the new budget."""
        one = TensorOutput(out, reference, ComparisonSpec(dtype or out.dtype, scale, log_domain))
        return self.check_outputs({SINGLE: one}, inputs=inputs, seed=seed, input_spec=input_spec)

    def _whose(self, base: Baseline) -> str | None:
        """The case a golden names as its own (``key [config]``) where it is not this one: a golden
        copied or renamed from another config, target, regime or kind; None where it is this case's
        (or predates the record)."""
        key, config = base.meta.get("key"), base.meta.get("config")
        if key is None and config is None:
            return None
        return None if (key, config) == (self.key, self.config_id) else f"{key} [{config}]"

    def _judge(self, entry: BaselineEntry, base: Baseline) -> BaselineResult:
        whose = self._whose(base)
        if whose is not None:
            return BaselineResult(error=(
                f"{base.json_path}: this golden is {whose}'s, not {self.key} [{self.config_id}]'s (copied or renamed "
                f"from another case?): its references and budgets were accepted for that case, so nothing is judged "
                f"against them; {offer(self.update_command)}"))
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
                f"{', '.join(recorded) or 'none'}); {offer(self.update_command)}"))
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
                           f"{', '.join(sources)}{other}{entry.borrowed_clause()}; "
                           f"{offer(self.update_command)}")
        return result

    def _prepare(self, entry: BaselineEntry) -> BaselineResult:
        """The new golden of ``entry``, keeping what the old pair still holds: another machine's
        budgets and the speed records, from the JSON when it is readable (whatever the .npz)."""
        pair = self.store.read_pair(self.key, self.config_id)
        if pair.newer_schema is not None:
            return BaselineResult(error=f"{pair.json_error}; the file is left as it is")
        old = Baseline(pair.arrays, pair.meta, pair.npz_path, pair.json_path) if pair.meta is not None else None
        whose = self._whose(old) if old is not None else None
        if whose is not None:
            old = None  # another case's golden under this name: nothing of it is kept
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
        if whose is not None:
            line = f"{head} new (it replaces {whose}'s golden, which was under this name): {entry.describe(outputs)}"
        elif not old_outputs:
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
                if p.arrays is None:
                    self.store.write_meta(self.key, self.config_id, p.meta)
                else:
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
