"""The end-of-run summary table: one row per target and config, merged across xdist workers."""
from __future__ import annotations

import math
from collections import OrderedDict

from tabulate import tabulate

from .devices import device_class
from .timing import format_seconds

__all__ = ["summary_rows", "render_summary", "render_training_summary", "TRAINING_HEADERS", "borrowed_budgets_line", "speed_lines", "write_terminal_summary",
           "HEADERS"]

HEADERS = ("target", "config", "cases", "max ULP", "max rel", "SQNR dB", "overflow", "underflow", "NaN", "verdict")


def _fmt(v: float) -> str:
    if isinstance(v, str):
        return v
    if math.isnan(v) or math.isinf(v):
        return str(v)
    return f"{v:.3g}"


def summary_rows(records: list[dict], config_order: list[str] | None = None) -> list[tuple]:
    records = [r for r in records if r.get("suite") != "training"]  # their own table: render_training_summary
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


TRAINING_HEADERS = ("target", "config", "steps", "max loss dev.", "grad SQNR dB", "param SQNR dB", "grad underflow",
                    "update lost", "skipped", "step time", "vs fp32", "verdict")


def _opt(v) -> str:
    """A metric a row may not have (a DDP case has no loss trajectory): "-"."""
    return "-" if v is None else _fmt(float(v))


def _rate(rate: float, param: str) -> str:
    return "0" if not rate else f"{100 * rate:.3g} % {param}"


def render_training_summary(records: list[dict], config_order: list[str] | None = None) -> str | None:
    """The training suite's table: one row per target and training config (training records carry
    their metrics under ``training``), or None when the run had none."""
    rs = [r for r in records if r.get("suite") == "training"]
    if not rs:
        return None
    from .training import TRAIN_CONFIGS

    order = {c: i for i, c in enumerate(TRAIN_CONFIGS)}
    rows = []
    for r in sorted(rs, key=lambda r: (r["target"], order.get(r["config"], len(order)), r["config"])):
        if "skipped" in r:
            rows.append((r["target"], r["config"], *("-" * 9), f"skip: {r['skipped']}"))
            continue
        t = r["training"]
        verdict = "pass" if r["passed"] else "FAIL " + ",".join(r["categories"])
        step, fp32_step = t.get("step_time_s"), t.get("fp32_step_time_s")
        timed = step is not None and math.isfinite(step) and step > 0
        speedup = f"{fp32_step / step:.2f} x" if timed and fp32_step and r["config"] != "fp32" else "-"
        rows.append((r["target"], r["config"], t["steps"], _opt(t["max_loss_deviation"]), _opt(t["grad_sqnr_db"]),
                     _opt(t["param_sqnr_db"]), _rate(t["max_underflow_rate"], t["underflow_param"]),
                     _rate(t["max_update_lost_rate"], t["update_lost_param"]), len(t["skipped_steps"]),
                     format_seconds(step) if timed else "-", speedup, verdict))
    return tabulate(rows, headers=TRAINING_HEADERS, tablefmt="github")


def render_summary(records: list[dict], config_order: list[str] | None = None) -> str:
    rows = summary_rows(records, config_order)
    headers = HEADERS[:-1]
    extra = [() for _ in rows]
    # timed run (the default; not with --precision-no-speed): the time of the row's cases and the
    # speed-up against fp32 on the same cases; on CUDA also peak memory and what it saves against fp32
    if any(r.get("time_s") is not None for r in records):
        headers += ("time", "vs fp32")
        extra = [e + _speed_columns(records, row[0], row[1]) for e, row in zip(extra, rows)]
    if any(r.get("peak_bytes") is not None for r in records):
        headers += ("peak memory", "saved vs fp32")
        extra = [e + _memory_columns(records, row[0], row[1]) for e, row in zip(extra, rows)]
    table = [row[:-1] + e + row[-1:] for row, e in zip(rows, extra)]
    return tabulate(table, headers=headers + HEADERS[-1:], tablefmt="github")


def _case_values(records: list[dict], target: str, config: str, field: str) -> dict[str, float]:
    return {r["regime"]: r[field] for r in records
            if r["target"] == target and r["config"] == config and r.get(field) is not None}


def _fp32_of(config: str) -> str:
    return "fp32" + config[len(config.split("+")[0]):]  # "+flash": compare on the same SDPA backend


def _against_fp32(records: list[dict], target: str, config: str, field: str):
    """The row's values of ``field`` by regime, and the sums of it and of fp32's over the regimes
    both have (None when none in common)."""
    mine = _case_values(records, target, config, field)
    ref = _case_values(records, target, _fp32_of(config), field)
    common = [k for k in mine if k in ref]
    sums = (sum(mine[k] for k in common), sum(ref[k] for k in common)) if common else None
    return mine, sums


def _speed_columns(records: list[dict], target: str, config: str) -> tuple[str, str]:
    mine, sums = _against_fp32(records, target, config, "time_s")
    if not mine:
        return "-", "-"
    speedup = f"{sums[1] / sums[0]:.2f} x" if sums and sums[0] else "-"
    return format_seconds(sum(mine.values())), speedup


def _memory_columns(records: list[dict], target: str, config: str) -> tuple[str, str]:
    mine, sums = _against_fp32(records, target, config, "peak_bytes")
    if not mine:
        return "-", "-"
    saved = f"{100 * (1 - sums[0] / sums[1]):.0f} %" if sums and sums[1] else "-"
    return f"{max(mine.values()) / 2**20:.3g} MiB", saved


def speed_lines(records: list[dict], fingerprint: str) -> list[str]:
    """Cases with no speed record for this device, and slower-but-noisy cases, in a line each."""
    lines = []
    missing = sum(1 for r in records if r.get("speed_status") == "no-baseline")
    if missing:
        lines.append(f"no speed baseline for this device ({fingerprint}) in {missing} case(s): "
                     "record with --precision-update-baselines")
    noisy = [f"{r['target']}-{r['config']}-{r['regime']} {r['speed_ratio']:.2f} x" for r in records
             if r.get("speed_status") == "noisy"]
    if noisy:
        lines.append(f"slower but within the noise (not failed): {', '.join(noisy)}")
    return lines


def borrowed_budgets_line(records: list[dict], key: str) -> str | None:
    """Says how many cases were judged by budgets recorded on other machines (golden.Golden)."""
    n = sum(1 for r in records if r.get("borrowed_budget"))
    if not n:
        return None
    return (f"{n} case(s) had no budget recorded for {key} and were judged by the widest recorded for other "
            f"{device_class(key)} machines; record this machine's with --precision-update-baselines")


def write_terminal_summary(tr, state) -> None:
    """The end of a run: baselines written, the table, budget and speed notes, traces, audits."""
    from .audit import render_audits  # the audit pulls in the tracer; only needed here
    from .devices import numerics_key

    if not state.records:
        return
    updates = sorted(r["baseline_update"] for r in state.records if r.get("baseline_update"))
    if updates:
        tr.write_sep("=", f"precision baselines written: {len(updates)} (under {state.store.root})")
        for line in updates:
            tr.write_line(line)
    key = numerics_key(state.device)
    if any(r.get("suite") != "training" for r in state.records):
        tr.write_sep("=", f"precision summary (device {state.device}, budgets keyed {key})")
        tr.write_line(render_summary(state.records, [c.id for c in state.configs]))
    training = render_training_summary(state.records)
    if training:
        tr.write_sep("=", f"precision training summary (device {state.device}, budgets keyed {key}; each config "
                          "against the fp32 run from the same seed)")
        tr.write_line(training)
    borrowed = borrowed_budgets_line(state.records, key)
    if borrowed:
        tr.write_line(borrowed)
    for line in speed_lines(state.records, state.fingerprint):
        tr.write_line(line)
    traced = sorted((r for r in state.records if r.get("trace")), key=lambda r: r["case"])
    if traced:
        tr.write_sep("=", f"precision trace ({len(traced)} case(s))")
        for r in traced:
            tr.write_line(f"{r['case']}:")
            tr.write_line(r["trace"])
    audit_lines = render_audits(sorted(state.records, key=lambda r: (r["target"], r["config"])))
    if audit_lines:
        tr.write_sep("=", "precision audit: the dtype each op ran in")
        for line in audit_lines:
            tr.write_line(line)
