"""Summary tables: the end-of-run table a kind's cases go into. Tensor kinds share
:data:`TENSOR_TABLE` (one row per target and config); a kind with other metrics (training)
supplies its own :class:`SummaryTable`. Tables read the cases' records: plain dicts, merged across
xdist workers."""
from __future__ import annotations

import math
from collections import OrderedDict

from tabulate import tabulate

from ..speed.timing import format_seconds

__all__ = ["SummaryTable", "TensorTable", "TENSOR_TABLE", "ABS_ERROR_TABLE", "HEADERS", "fmt", "worst"]


def fmt(v) -> str:
    """A table cell: 3 significant digits, inf and NaN spelled out, strings as they are."""
    if isinstance(v, str):
        return v
    if math.isnan(v) or math.isinf(v):
        return str(v)
    return f"{v:.3g}"


def worst(values, pick=max) -> float:
    """The worst of a row's values (``pick``: max or min), NaN when any is NaN: a case whose
    statistic could not be measured (a non-finite output) leaves the row's unmeasured too, and
    min/max over NaN would otherwise depend on the order of the cases."""
    values = [float(v) for v in values]
    return math.nan if any(math.isnan(v) for v in values) else pick(values)


def _statistic(records: list[dict], field: str, pick=max) -> str:
    """A row's cell: the worst of its cases' ``field``. A passing case with nothing finite to
    measure (its expected output is NaN, as a batch whose every label is ignored) has no say; a
    case whose value is NaN for any other reason makes the cell NaN (see :func:`worst`)."""
    values = [r[field] for r in records
              if not (r["passed"] and math.isnan(float(r[field])) and not (r["overflow"] or r["nan"] or r["underflow"]))]
    return fmt(worst(values, pick)) if values else "-"


class SummaryTable:
    """One table of the run's summary."""

    name = ""
    title = "precision summary"  # the terminal's separator line: "<title> (device ..., budgets keyed ...)"
    detail = ""  # appended inside the title's parentheses
    markdown_heading: str | None = None  # a heading above the table in the Markdown report

    def render(self, records: list[dict], config_order: list[str]) -> str:
        raise NotImplementedError


HEADERS = ("target", "config", "cases", "max ULP", "max rel", "SQNR dB", "overflow", "underflow", "NaN", "verdict")
ABS_HEADERS = ("target", "config", "cases", "max abs", "RMS abs", "SQNR dB", "overflow", "underflow", "NaN", "verdict")


class TensorTable(SummaryTable):
    """A row per target and config: the worst forward error of its cases in the metric the verdict
    uses (max ULP; or, ``on_abs``, max and RMS absolute error, for outputs that cross zero), the
    counts over every output, and, in timed runs, the time and the speed-up against fp32 (on CUDA
    also peak memory)."""

    name = "tensor"

    def __init__(self, on_abs: bool = False):
        self.on_abs = on_abs
        if on_abs:
            self.name = "tensor-abs"
            self.title = "precision summary, absolute error"
            self.markdown_heading = "Absolute error (outputs that cross zero: attention)"

    def rows(self, records: list[dict], config_order: list[str] | None = None) -> list[tuple]:
        groups: "OrderedDict[tuple[str, str], list[dict]]" = OrderedDict()
        order = {c: i for i, c in enumerate(config_order or [])}

        def place(config: str) -> int:  # a variant's row ("fp32+math", "fp32+compiled") beside its config's
            return order.get(config, order.get(config.split("+")[0], len(order)))
        for r in sorted(records, key=lambda r: (r["target"], place(r["config"]), r["config"])):
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
            measured = [r for r in rs if "crashed" not in r]  # a crashed case counts, and has no metrics
            if not measured:
                rows.append((target, config, len(rs), "-", "-", "-", "-", "-", "-", verdict))
                continue
            first = ((_statistic(measured, "max_abs"), _statistic(measured, "rms_abs")) if self.on_abs
                     else (_statistic(measured, "max_ulp"), _statistic(measured, "max_rel")))
            rows.append((
                target, config, len(rs), *first,
                _statistic(measured, "sqnr_db", min),
                sum(r["overflow"] for r in measured), sum(r["underflow"] for r in measured),
                sum(r["nan"] for r in measured),
                verdict,
            ))
        return rows

    def render(self, records: list[dict], config_order: list[str] | None = None) -> str:
        rows = self.rows(records, config_order)
        headers = ABS_HEADERS[:-1] if self.on_abs else HEADERS[:-1]
        extra = [() for _ in rows]
        # timed run (the default; not with --precision-no-speed): the time of the row's cases and the
        # speed-up against fp32 on the same cases; on CUDA also peak memory and what it saves against fp32
        # the callable's contract (kinds.tensor.contract, kinds.tensor.batch): bits that differ on a second call and
        # when rows run in another batch, summed over the row's cases that were re-called
        for field, header in (("rerun_differing", "2nd call differs"), ("batch_differing", "batch differs")):
            if any(field in r for r in records):
                headers += (header,)
                extra = [e + (_summed(records, row[0], row[1], field),) for e, row in zip(extra, rows)]
        if any(r.get("time_s") is not None for r in records):
            headers += ("time", "vs fp32")
            extra = [e + _speed_columns(records, row[0], row[1]) for e, row in zip(extra, rows)]
        if any(r.get("peak_bytes") is not None for r in records):
            headers += ("peak memory", "saved vs fp32")
            extra = [e + _memory_columns(records, row[0], row[1]) for e, row in zip(extra, rows)]
        table = [row[:-1] + e + row[-1:] for row, e in zip(rows, extra)]
        return tabulate(table, headers=headers + HEADERS[-1:], tablefmt="github")


TENSOR_TABLE = TensorTable()
ABS_ERROR_TABLE = TensorTable(on_abs=True)


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


def _summed(records: list[dict], target: str, config: str, field: str) -> str:
    values = _case_values(records, target, config, field)
    return str(sum(values.values())) if values else "-"


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
