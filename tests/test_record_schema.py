"""The case record is typed (kinds.record.CaseRecord), and the report's schema is held against it:
every field the report carries has a property of its JSON type, and every property of a report
case comes from a field (or is the verdict, the metrics or the timing the report groups them in)."""
import ast
import types
import typing
from pathlib import Path

import pytest

from pytest_precision.kinds.record import UNSET, CaseRecord, record_fields
from pytest_precision.reporting.report import REPORT_SCHEMA, build_report

CASE = REPORT_SCHEMA["$defs"]["case"]
PACKAGE = Path(__file__).resolve().parents[1] / "pytest_precision"
# the modules that read records (the summary, its tables, the reports, the plots, the audit section)
READERS = ("reporting/summary.py", "reporting/report.py", "reporting/plots.py", "reporting/merge.py", "kinds/tables.py",
           "explain/audit.py")
JSON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null", list: "array",
              dict: "object"}


def field_types(annotation) -> set[str]:
    """The JSON types a field of this annotation is written as."""
    if isinstance(annotation, types.UnionType):
        return set().union(*(field_types(a) for a in typing.get_args(annotation)))
    return {JSON_TYPES[typing.get_origin(annotation) or annotation]}


def schema_types(fragment: dict) -> set[str]:
    """The JSON types a schema fragment allows (numbers: the report writes non-finite ones as strings)."""
    if fragment.get("$ref") == "#/$defs/number":
        return {"number", "integer"}
    if "anyOf" in fragment:
        return set().union(*(schema_types(f) for f in fragment["anyOf"]))
    if "enum" in fragment:
        return {JSON_TYPES[type(v)] for v in fragment["enum"]}
    declared = fragment["type"]
    out = {declared} if isinstance(declared, str) else set(declared)
    return out | ({"integer"} if "number" in out else set())


def test_a_report_case_has_exactly_the_properties_the_record_fields_give():
    renamed = {f.metadata["renamed"] for f in CaseRecord.__dataclass_fields__.values() if f.metadata.get("renamed")}
    from_record = {*record_fields("identity"), *record_fields("case"), *renamed, "metrics", "contract", "timing"}
    assert set(CASE["properties"]) == from_record
    assert set(CASE["required"]) == {*record_fields("identity"), "verdict"}
    assert set(CASE["properties"]["metrics"]["properties"]) == set(record_fields("metrics"))
    assert set(CASE["properties"]["metrics"]["required"]) == set(record_fields("metrics"))
    assert set(CASE["properties"]["timing"]["properties"]) == set(record_fields("timing"))
    assert set(CASE["properties"]["contract"]["properties"]) == set(record_fields("contract"))


def test_every_field_the_report_carries_has_its_json_type_in_the_schema():
    hints = typing.get_type_hints(CaseRecord)
    for name, f in CaseRecord.__dataclass_fields__.items():
        where = f.metadata.get("report")
        if where is None or f.metadata.get("renamed") == "verdict":  # not in the report, or made from the field
            continue
        prop = CASE["properties"][f.metadata.get("renamed") or name] if where not in ("metrics", "contract", "timing") else \
            CASE["properties"][where]["properties"][name]
        assert field_types(hints[name]) <= schema_types(prop), name


def test_a_record_leaves_out_the_fields_it_does_not_have_and_keeps_its_nulls():
    record = CaseRecord("t", "fp32", "unit", suite="softmax", passed=True, categories=[], baseline_update=None)
    assert record.as_dict() == {"target": "t", "config": "fp32", "regime": "unit", "suite": "softmax", "passed": True,
                                "categories": [], "baseline_update": None}
    assert record.speed_status is UNSET
    assert CaseRecord.from_dict(record.as_dict()) == record
    with pytest.raises(TypeError):
        CaseRecord.from_dict({**record.as_dict(), "max_ulps": 1.0})


def test_what_a_user_kinds_evidence_adds_is_carried_beside_the_fields():
    """A kind of a user's own returns its Evidence's record_fields: a name that is not a field is
    kept in the record (its own table may read it), after the fields, and never replaces one."""
    record = CaseRecord("t", "fp32", "unit", suite="mine", passed=True)
    record.add(my_metric=3.5, max_ulp=1.0)
    assert record.as_dict() == {"target": "t", "config": "fp32", "regime": "unit", "suite": "mine", "passed": True,
                                "max_ulp": 1.0, "my_metric": 3.5}
    assert list(record.as_dict())[-1] == "my_metric"
    case = build_report([record.as_dict()], device="cpu", numerics_key="cpu-x", fingerprint="f", torch_version="2",
                        configs=["fp32"])["cases"][0]
    assert case["target"] == "t" and "my_metric" not in repr(case)  # the report's schema holds


def test_a_typed_record_reports_as_its_dict_did():
    record = CaseRecord("t", "fp16", "unit", suite="softmax", kind="softmax", nodeid="n", passed=False,
                        categories=["accuracy"], max_ulp=float("inf"), max_abs=1.0, rms_abs=0.5, max_rel=0.1,
                        sqnr_db=40.0, overflow=0, underflow=1, nan=0, baseline_update=None, baseline_refused=None,
                        borrowed_budget=False, borrowed_across_devices=False, time_s=1e-3, speed_status="pass",
                        speed_ratio=1.0, peak_bytes=None, speed_shared=None, headline="FAIL accuracy (x)",
                        golden_note=None)
    case = build_report([record.as_dict()], device="cpu", numerics_key="k", fingerprint="f", torch_version="2",
                        configs=["fp16"])["cases"][0]
    assert case == {"nodeid": "n", "suite": "softmax", "target": "t", "config": "fp16", "regime": "unit",
                    "verdict": "fail", "categories": ["accuracy"], "headline": "FAIL accuracy (x)",
                    "metrics": {"max_ulp": "inf", "max_rel": 0.1, "sqnr_db": 40.0, "overflow": 0, "underflow": 1,
                                "nan": 0},
                    "baseline_update": None, "baseline_refused": None, "borrowed_budget": False, "golden_note": None,
                    "timing": {"time_s": 1e-3, "speed_status": "pass", "speed_ratio": 1.0, "peak_bytes": None}}


def _keys_read(source: str) -> set[str]:
    """The string keys read from a record (named ``r`` or ``record``): ``r["k"]``, ``r.get("k")``, ``"k" in r``."""
    def is_record(node):
        return isinstance(node, ast.Name) and node.id in ("r", "record")

    def text(node):
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    keys = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and is_record(node.value):
            keys.add(text(node.slice))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and is_record(node.func.value) and node.args:
            keys.add(text(node.args[0]))
        elif isinstance(node, ast.Compare) and any(is_record(c) for c in node.comparators):
            keys.add(text(node.left))
    return keys - {None}


def test_every_key_the_readers_read_from_a_record_is_a_field():
    fields = set(CaseRecord.__dataclass_fields__)
    for module in READERS:
        keys = _keys_read((PACKAGE / module).read_text(encoding="utf-8"))
        assert keys and keys <= fields, (module, sorted(keys - fields))
