"""The suite's pytest items: one per kind x target x config x variant x regime, with stable ids
(``precision-suite::softmax[torch.softmax-fp32-unit]``), and how one runs.

Every case leaves a record for the summary and the reports, whatever happens to it: judged,
skipped inside the suite (with the reason), or crashed (the target raised, broke its contract,
ran past its time limit or tried to end the process; with the reason). Under the update flag its
golden is written only when the case passed every check but the golden's own; otherwise it is
"not accepted".
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from ..baselines.lifecycle import BaselineCheck
from ..baselines.store import file_component, name_problem
from ..explain.audit import audit
from ..explain.tracing import render_trace, trace
from ..kinds.cases import NO_VARIANT, Case
from ..kinds.kind import Kind
from ..kinds.compiled import Compiled
from ..kinds.fresh import REPLAYED, crash_note, input_seed, is_fresh
from ..kinds.outcome import PrecisionFailure
from ..kinds.record import CaseRecord
from ..kinds.registry import kinds, registered, target_names_problem
from ..kinds.session import RunState
from ..kinds.target import Target, TargetError, crash_category, lacking_sentence
from ..speed.alignment import tensor_core_misalignments, warn_misalignments
from ..speed.gate import check_speed
from .exits import THREADS_KEY, ThreadWatch, TargetEnded, refuse_process_exits, suspend_capture
from .options import OPTIONS_KEY, RECORDS_KEY, RunOptions
from .seed_memory import SeedMemory
from .timelimit import CaseTimeout, case_limit, time_limit
from .variants import VariantDecision, decide_variants, shared_dir

__all__ = ["RUN_STATE_KEY", "SuiteCollector", "SuiteItem", "suite_targets", "suites", "keyword_expressions", "crash_reason",
           "crash_fields",
           "users_traceback"]

LINT_SEEN_KEY = pytest.StashKey[set]()  # (target, op, dims) the alignment lint has warned about
RUN_STATE_KEY = pytest.StashKey[RunState]()  # the session's run state, handed to every case (Case.state)


def suites() -> dict[str, list[Kind]]:
    """The kinds grouped by suite (the report group), in the registry's order."""
    out: dict[str, list[Kind]] = {}
    for kind in kinds():
        out.setdefault(kind.suite, []).append(kind)
    return out


def suite_targets(suite_kinds: list[Kind], options: RunOptions) -> list[Target]:
    """The suite's targets: the registered (and ini) ones of its kinds, in registration order. The
    built-in targets (torch's ops before the project's kernels) run when nothing at all is
    registered, or beside the registered ones with --precision-builtins: a project's run is its
    own targets, in the suites of their kinds only."""
    names = {k.name for k in suite_kinds}
    every = registered() + options.ini_targets
    mine = [t for t in every if t.kind in names]
    if every and not options.builtins:
        return mine
    taken = {(t.kind, t.name) for t in mine}
    defaults = sorted((t for k in suite_kinds for t in k.default_targets() if (t.kind, t.name) not in taken),
                      key=lambda t: t.origin != "built-in")
    return mine + defaults


class SuiteCollector(pytest.Collector):
    """Parent of the suite items (node id prefix ``precision-suite``)."""

    def collect(self):
        options: RunOptions = self.config.stash[OPTIONS_KEY]
        state = self.config.stash[RUN_STATE_KEY]
        items = []
        files: dict[str, str] = {}  # baseline file as the file system spells it -> the case's name
        for suite_kinds in suites().values():
            by_name = {k.name: k for k in suite_kinds}
            targets = suite_targets(suite_kinds, options)
            problem = target_names_problem(targets)
            if problem:
                raise self.CollectError(problem)
            for target in targets:
                kind = by_name[target.kind]
                target = kind.session_target(target, state)
                try:
                    regimes = kind.regime_names(target)
                except ValueError as e:  # an op target without inputs= (an ini line)
                    raise self.CollectError(str(e)) from None
                decision = decide_variants(kind, target, options.device, options.timeout, "ini precision_timeout",
                                           shared_dir(self.config), before_exit=lambda: suspend_capture(self.config))
                variants = decision.variants(kind, options.device)
                if options.compile and kind.compiles:
                    variants = [*variants, Compiled(NO_VARIANT, options.device)]
                for config in kind.target_configs(target, kind.configs(options.configs)):
                    for variant in variants:
                        for regime in regimes:
                            case = Case(kind, target, config, variant, regime, options.device, state)
                            problem = name_problem(case.config_id)
                            if problem:
                                raise self.CollectError(f"kind {kind.name!r}: config name {problem}")
                            other = files.setdefault(file_component(f"{case.baseline_key}/{case.config_id}"), case.name)
                            if other != case.name:
                                raise self.CollectError(f"cases {other} and {case.name} would share baseline files")
                            items.append(SuiteItem.from_parent(self, name=case.name, case=case, decision=decision,
                                                               nodeid=_item_id(self, case.name)))
        return items


def keyword_expressions(items: list) -> None:
    """Give each suite item the ``-k`` expression that selects it and nothing else: its name, less
    every other item whose name contains it (``-k`` matches substrings without case:
    ``softmax[t-fp32-unit]`` is inside ``safe_softmax[t-fp32-unit]``). Names follow the rule of
    names, so the expression is a run of -k tokens and pastes as it is."""
    by_bracket: dict[str, list[str]] = {}  # "[...]" part -> lower-cased names holding it
    for item in items:
        name = item.name.lower()
        start = name.find("[")
        while start >= 0:
            end = name.find("]", start)
            if end < 0:
                break
            by_bracket.setdefault(name[start:end + 1], []).append(item.name)
            start = name.find("[", start + 1)
    for item in items:
        if not isinstance(item, SuiteItem):
            continue
        name = item.name.lower()
        bracket = name[name.find("["):]
        others = sorted({n for n in by_bracket.get(bracket, ()) if n != item.name and name in n.lower()})
        item.keyword_expression = " and not ".join([item.name, *others])


def crash_fields(error: BaseException, reason: str) -> dict:
    """The record's verdict fields of a crashed case: ``unsupported`` where the target raised on inputs
    of one feature it can declare it lacks (the declaration explains the failure), else ``crash``
    (with the declarations any one of which may explain it, where the inputs had several)."""
    declarations = getattr(error, "declarations", ())
    category = crash_category(error)
    if category != "crash":
        return dict(categories=[category], crashed=reason, headline=f"FAIL {category} ({reason}; {lacking_sentence(error)})",
                    declare=[declarations[0].as_plain()], explained=True)
    fields = dict(categories=["crash"], crashed=reason, headline=f"FAIL crash ({reason})")
    if declarations:
        fields.update(declare_any=[d.as_plain() for d in declarations], explained=False)
    needs = getattr(error, "needs", ())
    if needs:  # the block lists them; the crash itself stays unexplained
        fields.update(declare=[d.as_plain() for d in needs], explained=False)
    return fields


def crash_reason(error: BaseException) -> str:
    """One line saying why a case crashed."""
    if isinstance(error, (CaseTimeout, TargetError, TargetEnded)):
        text = error.reason if isinstance(error, CaseTimeout) else str(error)
    elif isinstance(error, pytest.fail.Exception):
        text = f"failed: {error.msg}"
    else:
        text = f"{type(error).__name__}: {error}"
    return text.splitlines()[0] if text else type(error).__name__


_LIBRARIES = tuple(str(Path(p).resolve()) for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                                                     sysconfig.get_paths()["stdlib"]})


def users_traceback(error: BaseException, full: bool = False) -> str:
    """What a target raised, as the frames of the user's code (and the frame that raised, when a
    library raised it): the harness's frames and libraries' inner frames say nothing to the user.
    ``full`` (pytest's ``--fulltrace``): every frame."""
    info = pytest.ExceptionInfo.from_exception(error)
    entries = list(info.traceback)
    if not entries or full:
        return str(info.getrepr(style="long" if full else "short", chain=False))

    def users(entry) -> bool:
        if str(entry.frame.f_globals.get("__name__", "")).startswith("pytest_precision."):  # the harness, its kinds
            return False
        path = str(Path(entry.path).resolve()) if str(entry.path) else ""
        return bool(path) and not path.startswith(_LIBRARIES)

    last = entries[-1]
    info.traceback = info.traceback.filter(lambda e: e is last or users(e))
    return str(info.getrepr(style="short", chain=False, funcargs=False, showlocals=False))


# the user property a case's report carries the golden it wrote in (``runner.worker_output``)
WRITTEN_PROPERTY = "precision_baseline_written"


def _item_id(collector, name: str):
    """A case's node id as pytest parses one back from its cache (``--lf``, ``--ff``, ``--sw``): the
    kind as the name, the case's bracket as its parameters, as a parametrised test's id is
    (``precision-suite::softmax[mine-bf16-unit]``); a name without a bracket is the name."""
    kind, bracket, params = name.partition("[")
    parent = collector.nodeid if isinstance(collector.nodeid, str) else str(collector.nodeid)
    if not bracket or not params.endswith("]") or not hasattr(collector, "id"):
        return f"{parent}::{name}"
    return collector.id.child(kind).with_params(params[:-1])


class SuiteItem(pytest.Item):
    def __init__(self, *, case: Case, decision: VariantDecision | None = None, **kw):
        super().__init__(**kw)
        self.case = case
        self.decision = decision or VariantDecision(("",))  # how its target's variants were decided
        self.add_marker("precision")
        self.add_marker("precision_suite")
        self.outcome = None
        self.keyword_expression = self.name  # keyword_expressions() refines it once every item is known

    def _record(self, **fields) -> dict:
        """The record of a case that left no outcome (skipped, crashed), as it crosses from xdist workers."""
        case = self.case
        record = CaseRecord(case.target.name, case.config_id, case.regime, suite=case.kind.suite, kind=case.kind.name,
                            nodeid=self.nodeid, **fields)
        if self.decision.note:
            record.variants_note = self.decision.note
        return record.as_dict()

    def runtest(self) -> None:
        options: RunOptions = self.config.stash[OPTIONS_KEY]
        records: list = self.config.stash[RECORDS_KEY]
        case = self.case
        baseline = BaselineCheck(options.store, case.baseline_key, case.config_id, options.device, options.update,
                                 options.update_command(suite_item=self.keyword_expression,
                                                        config_id=getattr(case.config, "base", case.config.id)),
                                 strict=options.strict_budgets, add_machine=options.add_machine)
        threads = self.config.stash.get(THREADS_KEY, None) or ThreadWatch()
        who = f"target {case.target.name!r}"
        try:
            # the code under test can neither outlast its limit nor end the process, and the
            # threads it leaves running are named (runner.timelimit, runner.exits)
            with time_limit(*case_limit(self, options.timeout), case=self.nodeid,
                            before_exit=lambda: suspend_capture(self.config)), \
                    threads.case(self.nodeid, who), refuse_process_exits(who):
                record, failure = self._run(options, baseline)
        except pytest.skip.Exception as e:  # recorded, so the summary and reports show it with its reason
            records.append(self._record(skipped=str(e.msg)))
            raise
        except pytest.xfail.Exception as e:  # the interpreter or a known limit of torch's op: not the target's crash
            baseline.refuse(f"expected to fail: {e.msg}")
            records.append(self._record(skipped=f"expected to fail: {e.msg}"))
            raise
        except (KeyboardInterrupt, pytest.exit.Exception):
            raise
        except BaseException as e:  # the target raised, broke its contract, ran past its limit or tried to exit
            memory = self._seed_memory(options)
            seed = input_seed(case)
            if memory is not None and seed is not None:
                memory.remember(case.name, seed)
            reason = crash_reason(e)
            baseline.refuse(reason)
            refused = f"{baseline.head} not accepted: {reason}" if options.update and not baseline.committed else None
            records.append(self._record(passed=False, baseline_refused=refused, **crash_fields(e, reason)))
            raise
        fields = record.as_dict()
        records.append(fields)
        if fields.get("baseline_update"):  # with the case's report, so an interrupted xdist run still lists it
            self.user_properties.append((WRITTEN_PROPERTY, fields["baseline_update"]))
        if failure is not None:
            raise failure

    def _run(self, options: RunOptions, baseline: BaselineCheck) -> tuple[CaseRecord, PrecisionFailure | None]:
        case = self.case
        reason = case.config.skip_reason(options.device)
        if reason:
            pytest.skip(reason)
        if self.decision.problem:  # a case the target does not support is skipped, hung probe or not
            reason = case.kind.why_skipped(case)
            if reason:
                pytest.skip(reason)
            raise TargetError(f"target {case.target.name!r} ({case.kind.name}): {self.decision.problem}")
        outcome = self._judge(options, baseline)
        if self.decision.note:
            outcome.details.append(f"target {case.target.name!r}: {self.decision.note}")
        self._settle_golden(baseline, outcome)
        record = outcome.record()
        if options.speed and not outcome.baseline.refused:
            self._time(options, baseline, outcome, record)
        if options.trace or (options.audit and case.regime == case.kind.audit_regime):
            self._trace(options, outcome, record)
        record.nodeid = self.nodeid
        if self.decision.note:
            record.variants_note = self.decision.note
        if options.details:
            record.add(**outcome.report_details())
        self.outcome = outcome
        if outcome.passed and outcome.not_judged:  # a verdict it could not give is not a pass
            pytest.skip(f"not judged: {'; '.join(outcome.not_judged)} (every other verdict passed)")
        failure = None if outcome.passed else PrecisionFailure(outcome.message(self.nodeid, baseline.update_command))
        return record, failure

    def _seed_memory(self, options: RunOptions) -> SeedMemory | None:
        """The failing seeds remembered in pytest's cache, for a case drawing its inputs from a seed
        that was not given on the command line (runner.seed_memory); None otherwise."""
        if options.fresh_seed is not None and not options.explore:
            return None
        return SeedMemory(getattr(self.config, "cache", None))

    def _judge(self, options: RunOptions, baseline: BaselineCheck):
        """The case's outcome. A fresh or drawn case first replays the seeds it failed on in earlier
        runs (the latest first): the first that still fails is the outcome, one that passes is
        forgotten; then its own seed, remembered if it fails."""
        case = self.case
        case.state.replays.pop(case.name, None)  # a rerun of the item starts from its own seed
        memory = self._seed_memory(options)
        own = input_seed(case)
        if memory is None or own is None:
            return case.kind.run(case, baseline)
        for seed in [s for s in memory.seeds(case.name) if s != own]:
            case.state.replays[case.name] = seed
            try:
                outcome = case.kind.run(case, baseline)
            except pytest.skip.Exception:  # outside what the target declares now: not a failure to keep
                memory.forget(case.name, seed)
                continue
            if not outcome.passed:
                if not is_fresh(case):  # a fresh case's seed line says it
                    outcome.details.insert(0, f"drawn from seed {seed}, {REPLAYED}")
                return outcome
            memory.forget(case.name, seed)
        case.state.replays.pop(case.name, None)
        outcome = case.kind.run(case, baseline)
        if not outcome.passed:
            memory.remember(case.name, own)
        return outcome

    @staticmethod
    def _settle_golden(baseline: BaselineCheck, outcome) -> None:
        """Under the update flag: write the golden the case prepared when it passed every check but
        the golden's own, else drop it with the reason (one place for every kind)."""
        if not baseline.pending:
            return
        blocking = [p.sentence for p in outcome.problems if p.check != "golden"]
        if blocking:
            baseline.refuse("; ".join(blocking))
            return
        baseline.commit()
        if outcome.baseline.error:  # the write failed (a read-only directory)
            outcome.add("golden", "baseline", outcome.baseline.error)

    def _time(self, options: RunOptions, baseline: BaselineCheck, outcome, record: CaseRecord) -> None:
        """The speed gate and the tensor-core lint for this case; adds to the outcome."""
        case = self.case
        bench = case.kind.bench_call(case)
        if bench is None:  # nothing of fixed size to time
            return
        regime = case.kind.regimes_for(case.target).get(case.regime)
        if getattr(case.config, "tensor_core_dtypes", False) and not (regime is not None and regime.irregular):
            # once per target, op and shape in a run: the shapes are the suite's, the ops the target's
            seen = self.config.stash.setdefault(LINT_SEEN_KEY, set())
            found = [m for m in tensor_core_misalignments(bench) if (case.target.name, m.op, m.dims) not in seen]
            seen.update((case.target.name, m.op, m.dims) for m in found)
            warn_misalignments(found, f"target {case.target.name!r} ({self.name})")
        speed = check_speed(lambda: case.kind.bench_call(case), options.device, baseline, options.speed_threshold,
                            options.fingerprint, bench, parallel=options.parallel)
        del bench
        for category, sentence in speed.problems():
            outcome.add(category, category, sentence)
        if speed.verdict.status in ("noisy", "shared"):  # a slower verdict is in the headline already
            outcome.details.append(speed.verdict.describe())
        record.add(**speed.record(), passed=outcome.passed, categories=outcome.categories)

    def _trace(self, options: RunOptions, outcome, record: CaseRecord) -> None:
        """--precision-trace: the case's ops; --precision-audit: the dtypes they ran in (once per
        target and config, on the kind's audit regime). Kept in the record, so xdist merges it."""
        case = self.case
        call = case.kind.trace_call(case)
        if call is None:
            return
        record.case = self.name
        if options.trace:
            record.trace = render_trace(trace(call))
            if not outcome.passed:
                outcome.details.append("op trace:\n" + record.trace)
        if options.audit and case.regime == case.kind.audit_regime:
            record.audit = audit(call, autocast=getattr(case.config, "autocast_dtype", None) is not None)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, PrecisionFailure):
            return str(excinfo.value)
        if isinstance(excinfo.value, (CaseTimeout, TargetEnded)):
            return f"{self.nodeid}: {excinfo.value}{crash_note(self.case)}"
        if isinstance(excinfo.value, TargetError):
            error = excinfo.value
            cause = error.__cause__
            tb = "" if cause is None else "\n" + users_traceback(cause, full=bool(self.config.getoption("fulltrace")))
            lacking = lacking_sentence(error)
            named = bool(lacking)
            if crash_category(error) != "crash":  # the cause and the keyword first
                return f"{self.nodeid}: FAIL {crash_category(error)} ({lacking})\n  {error}{crash_note(self.case, named)}{tb}"
            note = f"\n  {lacking}" if lacking else ""
            return f"{self.nodeid}: {error}{note}{crash_note(self.case, named)}{tb}"
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return Path(self.case.kind.source_file), 0, self.nodeid
