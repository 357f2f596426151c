"""Reports of several machines in one table: ``python -m pytest_precision report merge A.json B.json``.

A CI matrix runs the suites on several machines (an A100 job and an H100 job, say), each writing
``--precision-report``. Merged, every target and config gets one row per machine, side by side, so
the numerics of the same code on different GPUs (or CPUs) can be compared: the summary table's
columns (cases, worst forward error, counts, verdict) plus the machine. Training cases, whose
metrics are their own, get a row per machine with their verdicts.
"""
from __future__ import annotations

import json
from pathlib import Path

from tabulate import tabulate

from ..kinds.tables import HEADERS, TENSOR_TABLE
from .report import REPORT_VERSION

__all__ = ["MergeError", "load_report", "merged_rows", "render_merged"]


class MergeError(ValueError):
    """A report that cannot be merged; the message names the file."""


def _float(v):
    if isinstance(v, str) and v in ("inf", "-inf", "nan"):
        return float(v)
    return v


def load_report(path: Path) -> dict:
    """A ``--precision-report`` file, checked for what merging reads."""
    path = Path(path)
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise MergeError(f"{path}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:
        raise MergeError(f"{path}: not JSON ({e})") from None
    if not isinstance(report, dict) or report.get("report_version") != REPORT_VERSION:
        found = report.get("report_version") if isinstance(report, dict) else type(report).__name__
        raise MergeError(f"{path}: not a pytest-precision report of version {REPORT_VERSION} (found {found!r}); "
                         "write one with pytest --precision-suite --precision-report=FILE.json")
    missing = [k for k in ("device", "numerics_key", "fingerprint", "cases") if k not in report]
    if missing:
        raise MergeError(f"{path}: the report lacks {', '.join(missing)}")
    return report


def _label(report: dict) -> str:
    """The machine: its numerics key and the device name that begins its fingerprint."""
    name = str(report["fingerprint"]).split(",")[0].strip()
    return f"{report['numerics_key']} ({name})" if name else str(report["numerics_key"])


def _labels(reports: list[tuple[Path, dict]]) -> list[str]:
    labels = [_label(r) for _, r in reports]
    return [f"{lab} [{p.name}]" if labels.count(lab) > 1 else lab for lab, (p, _) in zip(labels, reports)]


def _records(report: dict) -> list[dict]:
    """The report's cases as summary-table records."""
    out = []
    for case in report["cases"]:
        r = {"target": case["target"], "config": case["config"], "regime": case["regime"]}
        if case["verdict"] == "skip":
            r["skipped"] = case.get("skip_reason") or "skipped"
        else:
            r["passed"] = case["verdict"] == "pass"
            r["categories"] = case.get("categories") or []
            r.update({k: _float(v) for k, v in (case.get("metrics") or {}).items()})
        out.append(r)
    return out


def _verdict_rows(records: list[dict]) -> list[tuple]:
    """Rows of cases without tensor metrics (training): counts and verdicts only."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        groups.setdefault((r["target"], r["config"]), []).append(r)
    rows = []
    for (target, config), rs in sorted(groups.items()):
        ran = [r for r in rs if "skipped" not in r]
        failed = [r for r in ran if not r["passed"]]
        if not ran:
            verdict = f"skip: {rs[0]['skipped']}"
        else:
            cats = sorted({c for r in failed for c in r["categories"]})
            verdict = "pass" if not failed else f"FAIL {len(failed)}/{len(ran)}: {','.join(cats)}"
        rows.append((target, config, len(ran), "-", "-", "-", "-", "-", "-", verdict))
    return rows


def merged_rows(reports: list[tuple[Path, dict]]) -> list[tuple]:
    """One row per target, config and machine, rows of one target and config together (machines in
    the order given); the columns are the summary table's with the machine after the config."""
    labels = _labels(reports)
    order: list[str] = []
    for _, report in reports:
        order += [c for c in report.get("configs", []) if c not in order]
    per_machine: dict[tuple[str, str], dict[str, tuple]] = {}
    for label, (_, report) in zip(labels, reports):
        records = _records(report)
        tensor = [r for r in records if "skipped" in r or "max_ulp" in r]
        other = [r for r in records if not ("skipped" in r or "max_ulp" in r)]
        for row in TENSOR_TABLE.rows(tensor, order) + _verdict_rows(other):
            per_machine.setdefault((row[0], row[1]), {})[label] = row
    rank = {c: i for i, c in enumerate(order)}
    keys = sorted(per_machine, key=lambda k: (k[0], rank.get(k[1].split("+")[0], len(rank)), k[1]))
    rows = []
    for key in keys:
        for label in labels:
            row = per_machine[key].get(label)
            if row is None:
                rows.append((key[0], key[1], label, 0, "-", "-", "-", "-", "-", "-", "not run"))
            else:
                rows.append((row[0], row[1], label, *row[2:]))
    return rows


def render_merged(reports: list[tuple[Path, dict]]) -> str:
    """The merged table (GitHub Markdown) under a list of the machines and their totals."""
    lines = [f"## pytest-precision: {len(reports)} reports merged", ""]
    for label, (path, report) in zip(_labels(reports), reports):
        t = report.get("totals", {})
        lines.append(f"- {label}: {path.name}, device {report['device']}, torch {report.get('torch', '?')}: "
                     f"{t.get('failed', '?')} failed, {t.get('passed', '?')} passed, {t.get('skipped', '?')} skipped")
    headers = (*HEADERS[:2], "machine", *HEADERS[2:])
    lines += ["", tabulate(merged_rows(reports), headers=headers, tablefmt="github"), ""]
    return "\n".join(lines)
