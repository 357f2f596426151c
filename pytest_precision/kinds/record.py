"""The record of one suite case: its fields, their types and what they mean.

Every suite case leaves one (runner.collection builds it from the case's outcome, the speed gate,
the tracer and, when a report is asked for, the outcome's detail). The records cross from xdist
workers to the controller, and feed the summary table, the reports and the plots, as plain dicts
(``CaseRecord.as_dict``): a field the case does not have is left out of its dict, not written as
None, because the JSON report tells a missing field from a null one (no timing at all, or a case
timed with no memory figure).

``report`` says where the JSON report puts a field (``reporting.report`` maps records by it and
tests/test_record_schema.py holds ``REPORT_SCHEMA`` against it): ``identity`` and ``case`` fields are
case fields of the same name, ``metrics`` and ``timing`` fields are grouped under that name,
``verdict`` fields are renamed (the name given), and fields without one stay in the terminal's
summary only.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

__all__ = ["CaseRecord", "UNSET", "record_fields"]


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()  # a field the record does not have (left out of its dict)


def _field(report: str | None = None, renamed: str | None = None):
    return field(default=UNSET, metadata={"report": report, "renamed": renamed})


@dataclass
class CaseRecord:
    # which case
    target: str = field(metadata={"report": "identity"})  # the target's registered name
    config: str = field(metadata={"report": "identity"})  # config id with its variant: "fp32", "fp16+flash"
    regime: str = field(metadata={"report": "identity"})  # the inputs' regime: "unit", "len1", "hypothesis"
    suite: str = _field("identity")  # the kind's suite: "softmax", "train_step"
    kind: str = _field()  # the kind's name: which summary table the case goes in
    nodeid: str = _field("identity")  # the case's pytest node id
    # the verdict: a skipped case has ``skipped`` and no verdict fields, any other ``passed`` and ``categories``
    skipped: str = _field("verdict", renamed="skip_reason")  # why it was skipped ("expected to fail: ..." for xfail)
    passed: bool = _field("verdict", renamed="verdict")
    categories: list[str] = _field("case")  # its problems' categories, in headline order ([] when it passed)
    crashed: str = _field("verdict", renamed="crash_reason")  # a failed case without measurements: why
    # declarations the case's failure names, as [key, value] in plain types (kinds.declarations.Declaration):
    # ``declare`` all needed; ``declare_any`` one of them (a crash on inputs with several features);
    # ``explained``: with them declared, nothing but the golden is left failing (reporting.declarations)
    declare: list = _field("case")
    declare_any: list = _field("case")
    explained: bool = _field("case")
    skipped_by: list = _field()  # declarations that would skip the case ([key, value]; the summary's block reads it)
    headline: str = _field("case")  # the failure message's first line (with the report's detail, or a crash)
    # tensor kinds: the forward output against the float64 oracle; the counts over every output
    max_ulp: float = _field("metrics")
    max_abs: float = _field()
    rms_abs: float = _field()
    max_rel: float = _field("metrics")
    sqnr_db: float = _field("metrics")
    overflow: int = _field("metrics")
    underflow: int = _field("metrics")
    nan: int = _field("metrics")
    # the callable's contract (kinds.tensor.contract, kinds.tensor.batch): elements whose bits differ on a second
    # call on fresh copies of the same inputs, and its largest difference in ULPs; elements whose
    # bits differ when rows run alone or in another batch
    rerun_differing: int = _field("contract")
    rerun_max_ulp: float = _field("contract")
    batch_differing: int = _field("contract")
    eager_max_ulp: float = _field()  # a compiled case: the eager run in the same config
    eager_max_abs: float = _field()
    # training kinds: the run against the fp32 run from the same seed (the training table's metrics)
    training: dict = _field("case")
    success_rate: dict = _field("case")  # a train_step seedsN case: its seeds' failures against fp32's (training_seeds)
    # the golden
    baseline_update: str | None = _field("case")  # under the update flag: the "old -> new" line of the write
    baseline_refused: str | None = _field("case")  # under the update flag: the golden not written, and why
    borrowed_budget: bool = _field("case")  # judged by budgets recorded on other machines
    borrowed_across_devices: bool = _field()  # ... of another device type
    inputs_moved: bool = _field("case")  # only when true: the inputs' bits differ from the golden's
    unjudged_limits: str = _field("case")  # only when some: limits the golden holds as unlimited
    variants_note: str = _field("case")  # why the target's variants were all kept (undecided at collection)
    # the speed gate (timed cases)
    time_s: float | None = _field("timing")  # median seconds per call
    speed_status: str | None = _field("timing")  # speed.gate.SpeedVerdict.status
    speed_ratio: float | None = _field("timing")  # against the recorded median
    peak_bytes: int | None = _field("timing")  # CUDA only
    speed_shared: str | None = _field()  # why the timing shared the machine
    # --precision-trace, --precision-audit
    case: str = _field()  # the item's name, that the trace and audit sections are headed by
    trace: str = _field()  # the op-by-op trace, rendered
    audit: dict = _field()  # explain.audit.audit(): ops and flags
    # the report's detail (only when a report or plots are asked for)
    outputs: dict[str, dict] = _field("case")  # per output: kinds.details.output_detail
    error_by_magnitude: dict | None = _field("case")  # kinds.details.error_by_magnitude
    golden_note: str | None = _field("case")  # why the golden did not judge, or whose budget it borrowed
    training_detail: dict = _field("case")  # training kinds: the whole trajectories

    def __post_init__(self):
        # what a kind of a user's own adds through its Evidence besides these fields: carried in
        # the record as before (its own summary table may read it), not in the JSON report
        self._extra: dict = {}

    def add(self, **values) -> None:
        """Set fields; a name that is not a field is kept beside them (a user kind's evidence)."""
        for name, value in values.items():
            if name in _NAMES:
                setattr(self, name, value)
            else:
                self._extra[name] = value

    def as_dict(self) -> dict:
        """The record as it crosses from xdist workers and is read by the reports: plain data,
        without the fields it does not have."""
        out = {f.name: value for f in fields(self) if (value := getattr(self, f.name)) is not UNSET}
        return {**out, **{k: v for k, v in self._extra.items() if k not in out}}

    @classmethod
    def from_dict(cls, data: dict) -> "CaseRecord":
        return cls(**data)


_NAMES = frozenset(f.name for f in fields(CaseRecord))


def record_fields(report: str) -> tuple[str, ...]:
    """The names of the fields the JSON report puts at ``report`` (see the module docstring)."""
    return tuple(f.name for f in fields(CaseRecord) if f.metadata.get("report") == report)
