"""The end-of-run summary table: one row per target and config, merged across xdist workers."""
from __future__ import annotations

import math
from collections import OrderedDict

from tabulate import tabulate

from .devices import device_class

__all__ = ["summary_rows", "render_summary", "borrowed_budgets_line", "HEADERS"]

HEADERS = ("target", "config", "cases", "max ULP", "max rel", "SQNR dB", "overflow", "underflow", "NaN", "verdict")


def _fmt(v: float) -> str:
    if isinstance(v, str):
        return v
    if math.isnan(v) or math.isinf(v):
        return str(v)
    return f"{v:.3g}"


def summary_rows(records: list[dict], config_order: list[str] | None = None) -> list[tuple]:
    groups: "OrderedDict[tuple[str, str], list[dict]]" = OrderedDict()
    order = {c: i for i, c in enumerate(config_order or [])}
    for r in sorted(records, key=lambda r: (r["target"], order.get(r["config"], len(order)), r["config"])):
        groups.setdefault((r["target"], r["config"]), []).append(r)
    rows = []
    for (target, config), all_rs in groups.items():
        rs = [r for r in all_rs if "skipped" not in r]
        if not rs:
            rows.append((target, config, 0, "-", "-", "-", "-", "-", "-", f"skip: {all_rs[0]['skipped']}"))
            continue
        failed = [r for r in rs if not r["passed"]]
        cats = sorted({c for r in failed for c in r["categories"]})
        verdict = "pass" if not failed else f"FAIL {len(failed)}/{len(rs)}: {','.join(cats)}"
        rows.append((
            target, config, len(rs),
            _fmt(max(float(r["max_ulp"]) for r in rs)),
            _fmt(max(float(r["max_rel"]) for r in rs)),
            _fmt(min(float(r["sqnr_db"]) for r in rs)),
            sum(r["overflow"] for r in rs), sum(r["underflow"] for r in rs), sum(r["nan"] for r in rs),
            verdict,
        ))
    return rows


def render_summary(records: list[dict], config_order: list[str] | None = None) -> str:
    return tabulate(summary_rows(records, config_order), headers=HEADERS, tablefmt="github")


def borrowed_budgets_line(records: list[dict], key: str) -> str | None:
    """Says how many cases were judged by budgets recorded on other machines (golden.Golden)."""
    n = sum(1 for r in records if r.get("borrowed_budget"))
    if not n:
        return None
    return (f"{n} case(s) had no budget recorded for {key} and were judged by the widest recorded for other "
            f"{device_class(key)} machines; record this machine's with --precision-update-baselines")
