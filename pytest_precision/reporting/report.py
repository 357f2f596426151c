"""Report files of a run: ``--precision-report=FILE.json`` (every suite case, schema REPORT_SCHEMA)
and ``--precision-report-md=FILE`` (the terminal's summary table in Markdown, for CI job
summaries and pull-request comments).

Both are built from the session's records, so under xdist they hold every worker's cases. The
output is deterministic: cases sorted, keys sorted, no timestamps. JSON has no inf or NaN: a
non-finite float (an infinite max ULP) is written as the string "inf", "-inf" or "nan".
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..kinds.details import MAGNITUDE_EDGES, ULP_EDGES
from ..kinds.record import record_fields
from .summary import borrowed_budgets_line, case_lines, speed_lines, tables

__all__ = ["REPORT_SCHEMA", "REPORT_VERSION", "build_report", "write_json_report", "render_markdown",
           "write_markdown_report", "json_safe"]

REPORT_VERSION = 1

_NUMBER = {"$ref": "#/$defs/number"}
_NUMBER_OR_NULL = {"anyOf": [_NUMBER, {"type": "null"}]}
_COUNT = {"type": "integer", "minimum": 0}
_STATS = {  # metrics.Comparison.summary()
    "type": "object",
    "required": ["max_ulp", "p99_ulp", "mean_ulp", "max_abs", "rms_abs", "max_rel", "sqnr_db", "cosine",
                 "overflow", "underflow", "nan", "missing_nan", "flushed_subnormal"],
    "properties": {**{k: _NUMBER for k in ("max_ulp", "p99_ulp", "mean_ulp", "max_abs", "rms_abs", "max_rel", "sqnr_db", "cosine")},
                   **{k: _COUNT for k in ("overflow", "underflow", "nan", "missing_nan", "flushed_subnormal")}},
}
_BUDGET = {  # budgets.Budget.as_dict(): a null limit is not limited
    "type": "object",
    "required": ["max_ulp", "max_abs", "mean_ulp", "rms_abs", "overflow", "underflow", "nan", "missing_nan"],
    "properties": {**{k: _NUMBER_OR_NULL for k in ("max_ulp", "max_abs", "mean_ulp", "rms_abs")},
                   **{k: _COUNT for k in ("overflow", "underflow", "nan", "missing_nan")}},
}
_HISTOGRAM = {
    "type": "object", "required": ["counts", "nonfinite"],
    "properties": {"counts": {"type": "array", "items": _COUNT}, "nonfinite": _COUNT},
}

REPORT_SCHEMA: dict = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "pytest-precision report",
    "type": "object",
    "required": ["report_version", "device", "numerics_key", "fingerprint", "torch", "configs", "ulp_edges",
                 "magnitude_edges", "totals", "cases"],
    "properties": {
        "report_version": {"const": REPORT_VERSION},
        "device": {"type": "string"},
        "numerics_key": {"type": "string", "description": "the key accepted budgets are filed under (cpu-avx512, cuda-sm90)"},
        "fingerprint": {"type": "string", "description": "the device fingerprint speed records are keyed by"},
        "torch": {"type": "string"},
        "configs": {"type": "array", "items": {"type": "string"}},
        "ulp_edges": {"type": "array", "items": {"type": "number"},
                      "description": "histogram bin i counts ULPs in (edges[i-1], edges[i]]; bin 0 exact zeros, the last bin above the top edge"},
        "magnitude_edges": {"type": "array", "items": {"type": "number"},
                            "description": "bins of |logit - row max| for error_by_magnitude, same convention"},
        "totals": {"type": "object", "required": ["cases", "passed", "failed", "skipped"],
                   "properties": {k: _COUNT for k in ("cases", "passed", "failed", "skipped")}},
        "cases": {"type": "array", "items": {"$ref": "#/$defs/case"}},
    },
    "$defs": {
        "number": {"anyOf": [{"type": "number"}, {"enum": ["inf", "-inf", "nan"]}],
                   "description": "a float; non-finite values are the strings inf, -inf, nan"},
        "case": {
            "type": "object",
            "required": ["nodeid", "suite", "target", "config", "regime", "verdict"],
            "properties": {
                "nodeid": {"type": "string"},
                "suite": {"type": "string"},
                "target": {"type": "string"},
                "config": {"type": "string", "description": "config id, with the SDPA backend (+flash) for attention"},
                "regime": {"type": "string"},
                "verdict": {"enum": ["pass", "fail", "skip"]},
                "skip_reason": {"type": "string"},
                "crash_reason": {"type": "string", "description": "a failed case that has no metrics: the target "
                                 "raised, broke its kind's contract or ran past its time limit (category crash)"},
                "categories": {"type": "array", "items": {"type": "string"}},
                "headline": {"type": "string", "description": "the failure message's first line, without the node id"},
                "metrics": {"type": "object", "description": "the forward output against the oracle, counts over every output",
                            "required": ["max_ulp", "max_rel", "sqnr_db", "overflow", "underflow", "nan"],
                            "properties": {"max_ulp": _NUMBER, "max_rel": _NUMBER, "sqnr_db": _NUMBER,
                                           "overflow": _COUNT, "underflow": _COUNT, "nan": _COUNT}},
                "outputs": {"type": "object", "additionalProperties": {
                    "type": "object",
                    "required": ["dtype", "shape", "oracle", "peer", "peer_budget", "golden", "regression_budget"],
                    "properties": {
                        "dtype": {"type": "string"},
                        "shape": {"type": "array", "items": _COUNT},
                        "oracle": _STATS,
                        "peer": {"anyOf": [_STATS, {"type": "null"}]},
                        "peer_budget": {"anyOf": [_BUDGET, {"type": "null"}]},
                        "golden": {"anyOf": [_STATS, {"type": "null"}], "description": "against the stored golden"},
                        "regression_budget": {"anyOf": [_BUDGET, {"type": "null"}]},
                        "ulp_histogram": {"anyOf": [_HISTOGRAM, {"type": "null"}]},
                    }}},
                "golden_note": {"type": ["string", "null"],
                                "description": "why the golden did not judge, or whose budget it borrowed"},
                "borrowed_budget": {"type": "boolean"},
                "variants_note": {"type": "string", "description": "the target's variants were not decided at "
                                  "collection (its probe call ran in no dtype, or exited): every variant was kept, and why"},
                "inputs_moved": {"type": "boolean", "description": "the inputs' bits differ from those the golden was "
                                 "accepted on (same seed and spec): judged against this run's oracle within its budget"},
                "unjudged_limits": {"type": "string", "description": "the golden holds a limit as unlimited (what it "
                                    "accepted was not finite): which, and that the metric was not judged"},
                "declare": {"type": "array", "items": {"type": "array", "prefixItems": [{"type": "string"}, {}],
                                                        "minItems": 2, "maxItems": 2},
                            "description": "declarations the failure names, [key, value] (a dtype as {\"dtype\": name}): "
                                           "what the target does by design (reporting.declarations)"},
                "declare_any": {"type": "array", "items": {"type": "array", "prefixItems": [{"type": "string"}, {}],
                                                            "minItems": 2, "maxItems": 2},
                                "description": "a crash on inputs with several features: any one of these declarations "
                                               "would skip them"},
                "explained": {"type": "boolean", "description": "with the declarations added, nothing but the golden "
                                                                "would fail"},
                "baseline_update": {"type": ["string", "null"]},
                "baseline_refused": {"type": ["string", "null"],
                                     "description": "under the update flag: the golden not written, and why"},
                "contract": {"type": "object", "description": "the callable's contract beyond its values (cases whose "
                             "target was called again: fp32, or any config of a target declaring deterministic= or "
                             "batch_invariant=)",
                             "properties": {
                                 "rerun_differing": {**_COUNT, "description": "elements (every output) whose bits "
                                                     "differ on a second call on fresh copies of the same inputs"},
                                 "rerun_max_ulp": {**_NUMBER, "description": "the largest such difference, in ULPs"},
                                 "batch_differing": {**_COUNT, "description": "forward-output elements whose bits "
                                                     "differ when rows run alone or inside another batch"}}},
                "timing": {"type": "object", "properties": {
                    "time_s": _NUMBER_OR_NULL, "speed_status": {"type": ["string", "null"]},
                    "speed_ratio": _NUMBER_OR_NULL, "peak_bytes": {"type": ["integer", "null"]}}},
                "training": {"type": "object", "description": "training suite: the run against the fp32 run from the same seed",
                             "required": ["steps", "max_loss_deviation", "grad_sqnr_db", "param_sqnr_db",
                                          "max_underflow_rate", "max_update_lost_rate", "skipped_steps"],
                             "properties": {
                                 "steps": _COUNT, "max_loss_deviation": _NUMBER_OR_NULL, "grad_sqnr_db": _NUMBER,
                                 "param_sqnr_db": _NUMBER_OR_NULL,
                                 "max_underflow_rate": {"type": "number", "description": "worst parameter: fraction of its fp32-nonzero gradients that are 0 here (first step)"},
                                 "underflow_param": {"type": "string"},
                                 "max_update_lost_rate": {"type": "number", "description": "worst parameter: fraction of the elements fp32 moved that never moved here"},
                                 "update_lost_param": {"type": "string"},
                                 "underflow_elements": {"type": ["integer", "null"], "description": "the significant gradients of underflow_param the rate counts over"},
                                 "update_lost_elements": {"type": ["integer", "null"], "description": "the significant first updates of update_lost_param the rate counts over"},
                                 "model_dtypes": {"type": "array", "items": {"type": "string"}, "description": "dtypes other than float32 model_fn built parameters in (cast to float32 master weights)"},
                                 "update_ratio": _NUMBER_OR_NULL,
                                 "skipped_steps": {"type": "array", "items": _COUNT},
                                 "first_nonfinite": {"anyOf": [{"type": "null"}, {"type": "array"}]},
                                 "step_time_s": _NUMBER_OR_NULL, "fp32_step_time_s": _NUMBER_OR_NULL,
                                 "step_time_spread": _NUMBER_OR_NULL, "fp32_step_time_spread": _NUMBER_OR_NULL,
                                 "ddp": {"type": "object", "description": "DDP cases: the hook's gradients against uncompressed DDP"},
                                 "fsdp": {"type": "object", "description": "FSDP2 cases: the gathered gradients of the "
                                          "mixed-precision policy against single-process fp32 on the same data"},
                                 "group_grad_sqnr_db": {"type": "object", "additionalProperties": _NUMBER,
                                                        "description": "gradient SQNR per optimizer parameter "
                                                        "group, against fp32"},
                                 "fp8": {"type": "object", "description": "float8 recipes: per Linear and role, "
                                         "the elements cast, saturated and lost to 0"},
                                 "shipped": {"type": "boolean", "description": "the config the repository trains in "
                                             "(TrainSpec.ships; a Lightning Trainer's precision)"}}},
                "success_rate": {"type": "object", "description": "a train_step seedsN case: the config's runs from N seeds "
                                 "against the fp32 runs from the same seeds (Fisher's exact test, one-sided)",
                                 "required": ["seeds", "nonfinite", "past_bound", "failed", "fp32_failed", "p_value"],
                                 "properties": {
                                     "seeds": _COUNT, "nonfinite": _COUNT, "past_bound": _COUNT, "failed": _COUNT,
                                     "fp32_failed": _COUNT, "p_value": _NUMBER, "margin": _NUMBER,
                                     "skipped_steps": {"type": "array", "items": _COUNT},
                                     "final_losses": {"type": "array", "items": _NUMBER},
                                     "fp32_final_losses": {"type": "array", "items": _NUMBER}}},
                "training_detail": {"type": "object", "description": "per-step losses, deviations, gradient norms, loss scales; per-parameter rates"},
                "error_by_magnitude": {"anyOf": [{"type": "null"}, {
                    "type": "object", "required": ["counts", "max_ulp"],
                    "properties": {"counts": {"type": "array", "items": _COUNT},
                                   "max_ulp": {"type": "array", "items": _NUMBER}}}]},
            },
        },
    },
}

# where a case's record goes in its report case (kinds.record.CaseRecord; tests/test_record_schema.py
# holds REPORT_SCHEMA against it)
_IDENTITY = record_fields("identity")
_TIMING = record_fields("timing")
_METRICS = record_fields("metrics")
_CARRIED = record_fields("case")
_CONTRACT = record_fields("contract")


def json_safe(value):
    """``value`` with every non-finite float replaced by "inf", "-inf" or "nan" (tuples as lists)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _case(record: dict) -> dict:
    case = {k: record.get(k) for k in _IDENTITY}
    case["nodeid"] = case["nodeid"] or f"{record['target']}-{record['config']}-{record['regime']}"
    case["suite"] = case["suite"] or ""
    if "skipped" in record:
        return {**case, "verdict": "skip", "skip_reason": record["skipped"]}
    case["verdict"] = "pass" if record["passed"] else "fail"
    if "crashed" in record:
        case["crash_reason"] = record["crashed"]
    if all(k in record for k in _METRICS):  # training cases carry theirs under "training"
        case["metrics"] = {k: record[k] for k in _METRICS}
    case.update({k: record[k] for k in _CARRIED if k in record})
    if any(k in record for k in _CONTRACT):
        case["contract"] = {k: record[k] for k in _CONTRACT if k in record}
    if any(k in record for k in _TIMING):
        case["timing"] = {k: record.get(k) for k in _TIMING}
    return case


def _sort_key(record: dict) -> tuple:
    return (record.get("suite") or "", record["target"], record["config"], record["regime"], record.get("nodeid") or "")


def totals(records: list[dict]) -> dict:
    skipped = sum(1 for r in records if "skipped" in r)
    failed = sum(1 for r in records if "skipped" not in r and not r["passed"])
    return {"cases": len(records), "passed": len(records) - skipped - failed, "failed": failed, "skipped": skipped}


def build_report(records: list[dict], *, device: str, numerics_key: str, fingerprint: str, torch_version: str,
                 configs: list[str]) -> dict:
    return json_safe({
        "report_version": REPORT_VERSION, "device": device, "numerics_key": numerics_key,
        "fingerprint": fingerprint, "torch": torch_version, "configs": list(configs),
        "ulp_edges": list(ULP_EDGES), "magnitude_edges": list(MAGNITUDE_EDGES),
        "totals": totals(records),
        "cases": [_case(r) for r in sorted(records, key=_sort_key)],
    })


def write_json_report(path: Path, report: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # allow_nan=False: json_safe replaced every non-finite float; anything left is a bug, not output
    path.write_text(json.dumps(report, indent=2, sort_keys=True, allow_nan=False) + "\n", encoding="utf-8")


def render_markdown(records: list[dict], *, config_order: list[str], device: str, numerics_key: str,
                    fingerprint: str, extra_lines: list[str] = ()) -> str:
    """The terminal's summary table (tabulate's github format is Markdown), a line of totals and
    the failing cases with their headline."""
    t = totals(records)
    lines = [f"## pytest-precision: {t['failed']} failed, {t['passed']} passed, {t['skipped']} skipped "
             f"of {t['cases']} cases", "",
             f"device {device}, budgets keyed {numerics_key}", ""]
    for table, rs in tables(records):
        if table.markdown_heading:
            lines += [f"### {table.markdown_heading}", ""]
        lines += [table.render(rs, config_order), ""]
    notes = [line for line in (*case_lines(records), borrowed_budgets_line(records, numerics_key),
                               *speed_lines(records, fingerprint), *extra_lines) if line]
    lines += [f"- {line}" for line in notes]
    if notes:
        lines.append("")
    failed = [r for r in sorted(records, key=_sort_key) if "skipped" not in r and not r["passed"]]
    if failed:
        lines += ["### Failing cases", ""]
        lines += [f"- `{r.get('nodeid') or r['target']}`: {_escape(r.get('headline') or 'FAIL ' + ','.join(r['categories']))}"
                  for r in failed]
        lines.append("")
    return "\n".join(lines)


def _escape(text: str) -> str:
    """Headlines hold `*`, `_` and `<` (`max ULP 3 > budget 2`); Markdown must show them as they are."""
    for ch in "\\`*_<>|[]":
        text = text.replace(ch, "\\" + ch)
    return text


def write_markdown_report(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
