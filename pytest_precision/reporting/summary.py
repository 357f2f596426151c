"""The end-of-run summary: the baselines written, one table per kind's table (tensor kinds share
one; training has its own), the borrowed-budget and speed notes, traces and audits. Built from the
run's records, merged across xdist workers."""
from __future__ import annotations

import re

from ..baselines.commands import offer_rerun
from ..kinds.fresh import FRESH, seed_line
from ..kinds.registry import get_kind, registered
from ..kinds.tables import HEADERS, TENSOR_TABLE, SummaryTable
from ..platform.devices import device_class, numerics_key
from .declarations import declaration_lines

__all__ = ["HEADERS", "tables", "summary_rows", "render_summary", "borrowed_budgets_line", "speed_lines", "case_lines",
           "write_terminal_summary"]


def _table_of(record: dict) -> SummaryTable:
    try:
        return get_kind(record["kind"]).table
    except (KeyError, ValueError):  # a record without a known kind: the tensor table's fields
        return TENSOR_TABLE


def tables(records: list[dict]) -> list[tuple[SummaryTable, list[dict]]]:
    """Each table the records go into, with its records, in the order the kinds come."""
    out: dict[str, tuple[SummaryTable, list[dict]]] = {}
    for r in records:
        table = _table_of(r)
        out.setdefault(table.name, (table, []))[1].append(r)
    return list(out.values())


def summary_rows(records: list[dict], config_order: list[str] | None = None) -> list[tuple]:
    """The tensor kinds' rows of ``records``: one per target and config."""
    return TENSOR_TABLE.rows([r for r in records if _table_of(r) is TENSOR_TABLE], config_order)


def render_summary(records: list[dict], config_order: list[str] | None = None) -> str:
    """The tensor kinds' table of ``records`` (what the terminal prints first)."""
    return TENSOR_TABLE.render([r for r in records if _table_of(r) is TENSOR_TABLE], config_order)


_LOAD = re.compile(r"used (\d+(?:\.\d+)?) cores")


def _collapse_loads(reasons) -> list[str]:
    """One sentence per reason, the neighbours' loads of a busy machine as their range (each case
    measured its own: "used 1.30 to 1.35 cores")."""
    loads: dict[str, list[float]] = {}
    for reason in reasons:
        m = _LOAD.search(reason)
        key = _LOAD.sub("used {} cores", reason) if m else reason
        loads.setdefault(key, []).extend([float(m.group(1))] if m else [])
    out = []
    for key, values in loads.items():
        if not values:
            out.append(key)
            continue
        low, high = min(values), max(values)
        out.append(key.replace("{}", f"{low:.2f}" if low == high else f"{low:.2f} to {high:.2f}"))
    return sorted(out)


def speed_lines(records: list[dict], fingerprint: str) -> list[str]:
    """Cases with no speed record for this device, and slower-but-noisy cases, in a line each."""
    lines = []
    missing = sum(1 for r in records if r.get("speed_status") == "no-baseline")
    if missing:
        lines.append(f"no speed baseline for this device ({fingerprint}) in {missing} case(s): "
                     f"{offer_rerun()}")
    noisy = [f"{r['target']}-{r['config']}-{r['regime']} {r['speed_ratio']:.2f} x" for r in records
             if r.get("speed_status") == "noisy"]
    if noisy:
        lines.append(f"slower but within the noise (not failed): {', '.join(noisy)}")
    shared = [r for r in records if r.get("speed_status") == "shared"]
    if shared:
        why = _collapse_loads(r.get("speed_shared") or "a shared machine" for r in shared)
        named = [f"{r['target']}-{r['config']}-{r['regime']} {r['speed_ratio']:.2f} x" for r in shared[:8]]
        more = f" and {len(shared) - 8} more" if len(shared) > 8 else ""
        lines.append(f"{len(shared)} case(s) slower but not failed ({'; '.join(why)}); rerun them serially on an idle "
                     f"machine to judge speed: {', '.join(named)}{more}")
    unrecorded = [r for r in records if r.get("speed_status") == "unrecorded"]
    if unrecorded:
        lines.append(f"speed not recorded in {len(unrecorded)} case(s) ({unrecorded[0].get('speed_shared')}): "
                     f"{offer_rerun(' in a serial run')}")
    return lines


def _crash_word(record: dict) -> str:
    """How a case without measurements failed: ``crashed``, or the declaration's category (``unsupported``,
    ``contract``) where it raised on what its target can declare."""
    category = (record.get("categories") or ["crash"])[0]
    return "crashed" if category == "crash" else category


def case_lines(records: list[dict]) -> list[str]:
    """The cases the tables cannot explain: each crashed case with its reason, and the skipped ones
    by reason (a whole row's skip shows in its row too)."""
    lines = [f"{_crash_word(r)}: {r.get('nodeid') or r['target']}: {r['crashed']}"
             for r in sorted(records, key=lambda r: r.get("nodeid") or r["target"]) if "crashed" in r]
    skipped: dict[str, int] = {}
    for r in records:
        if "skipped" in r:
            skipped[r["skipped"]] = skipped.get(r["skipped"], 0) + 1
    lines += [f"{n} case(s) skipped: {reason}" for reason, n in sorted(skipped.items())]
    moved = sum(1 for r in records if r.get("inputs_moved"))
    if moved:
        lines.append(f"{moved} case(s) drew inputs whose bits differ from those their goldens were accepted on, from "
                     "the same seed and spec (another machine's float32 randn, or a generator edited without changing its "
                     "shapes and dtypes?): judged by their error against the "
                     "float64 oracle within the golden's budget; pytest_precision.numerics.inputs.seeded_normal draws the same "
                     "bits on every machine")
    unjudged = sorted(r.get("nodeid") or r["target"] for r in records if r.get("unjudged_limits"))
    if unjudged:
        lines.append(f"{len(unjudged)} case(s) judged by goldens holding an unlimited limit (what they accepted was not "
                     f"finite, so that metric is not judged): {', '.join(unjudged[:5])}"
                     + (f" and {len(unjudged) - 5} more" if len(unjudged) > 5 else ""))
    # the callable's contract, where it was reported and not judged (kinds.tensor.contract, kinds.tensor.batch)
    for field, what, declare in (("rerun_differing", "gave other bits on a second call on fresh copies of the same "
                                  "inputs", "deterministic"),
                                 ("batch_differing", "gave rows whose bits depend on the batch around them",
                                  "batch_invariant")):
        found = sorted({r["target"] for r in records if r.get(field) and r.get("passed")})
        if found:
            lines.append(f"{', '.join(found)}: {what} (reported, not judged: declare {declare}=True to require the "
                         "same bits)")
    notes = {(r["target"], r["variants_note"]) for r in records if r.get("variants_note")}
    lines += [f"target {target!r}: {note}" for target, note in sorted(notes)]
    return lines


def baseline_lines(records: list[dict], written: list[str] = ()) -> list[tuple[str, list[str]]]:
    """Under the update flag: (heading, lines) of the goldens written and of those not accepted;
    ``written``: the golden lines the cases' reports carried (an interrupted xdist run's workers
    never hand over their records)."""
    out = []
    for field, heading in (("baseline_update", "precision baselines written"),
                           ("baseline_refused", "precision baselines not accepted")):
        lines = sorted({r[field] for r in records if r.get(field)} | (set(written) if field == "baseline_update" else set()))
        if lines:
            out.append((f"{heading}: {len(lines)}", lines))
    return out


def borrowed_budgets_line(records: list[dict], key: str) -> str | None:
    """Says how many cases were judged by budgets recorded on other machines."""
    n = sum(1 for r in records if r.get("borrowed_budget"))
    if not n:
        return None
    across = sum(1 for r in records if r.get("borrowed_across_devices"))
    whose = (f"other {device_class(key)} machines" if not across else
             f"other machines ({across} of them by machines of another device type, no {device_class(key)} "
             "machine having one)")
    return (f"{n} case(s) had no budget recorded for {key} and were judged by the widest recorded for {whose}; "
            f"{offer_rerun()} (--precision-strict-budgets fails them instead)")


def write_terminal_summary(tr, options, records: list[dict], written: list[str] = ()) -> None:
    """The end of a run: baselines written, the tables, budget and speed notes, traces, audits."""
    from ..explain.audit import render_audits  # the audit pulls in the tracer; only needed here

    for heading, lines in baseline_lines(records, written):
        tr.write_sep("=", f"{heading} (under {options.store.root})")
        for line in lines:
            tr.write_line(line)
    if not records:
        return
    key = numerics_key(options.device)
    for table, rs in tables(records):
        tr.write_sep("=", f"{table.title} (device {options.device}, budgets keyed {key}{table.detail})")
        tr.write_line(table.render(rs, [c.id for c in options.configs]))
    for line in case_lines(records):
        tr.write_line(line)
    targets = [*registered(), *options.ini_targets]
    block = declaration_lines(records, origins={t.name: t.origin for t in targets},
                              wheres={t.name: t.where for t in targets if t.where},
                              existing={t.name: t.declared for t in targets})
    if block:
        tr.write_sep("=", "precision: declarations this run found (one edit)")
        for line in block:
            tr.write_line(line)
    if any(r.get("regime") == FRESH for r in records):  # the header's line, for runs that hide it (-q)
        tr.write_line(seed_line(options.fresh_seed, options.explore))
    borrowed = borrowed_budgets_line(records, key)
    if borrowed:
        tr.write_line(borrowed)
    for line in speed_lines(records, options.fingerprint):
        tr.write_line(line)
    traced = sorted((r for r in records if r.get("trace")), key=lambda r: r["case"])
    if traced:
        tr.write_sep("=", f"precision trace ({len(traced)} case(s))")
        for r in traced:
            tr.write_line(f"{r['case']}:")
            tr.write_line(r["trace"])
    audit_lines = render_audits(sorted(records, key=lambda r: (r["target"], r["config"])))
    if audit_lines:
        tr.write_sep("=", "precision audit: the dtype each op ran in")
        for line in audit_lines:
            tr.write_line(line)
