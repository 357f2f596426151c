"""What a train_step case shows (``suites.training``): its evidence, a training run against the
fp32 run from the same seed (the failure message's table of steps, the summary record, the
report's trajectories), and the training summary table, one row per target and config.

The step time it shows is never gated: on a 2-core CPU runner the speed-up ratio moved from 0.2 x to
10 x between runs, and fp8 on a CPU is an emulation or ``torch._scaled_mm``'s CPU path, whose time
says nothing about fp8 hardware."""
from __future__ import annotations

import math

from tabulate import tabulate

from pytest_precision.kinds import Evidence, SummaryTable, fmt, format_seconds
from pytest_precision.kinds.training import (Fp8Counts, LoopPeer, LowPrecisionLoss, OUTPUT, ScaleHealth,
                                             TrajectoryBudget, built_dtype_note, first_step_floor_db, history_text,
                                             later_step_floor_db, percent, rates_line, speedup_text, worst_text)
from pytest_precision.training import TRAIN_CONFIGS, TrainConfig, TrainMetrics

from .training_seeds import render_rates, seeds_of

__all__ = ["TrainingEvidence", "TrainingTable", "TRAINING_TABLE"]


def _g(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return f"{v:.4g}"


class TrainingEvidence(Evidence):
    """A training run against the fp32 run from the same seed."""

    def __init__(self, config: TrainConfig, metrics: TrainMetrics, scale: ScaleHealth | None = None,
                 fp8: Fp8Counts | None = None, low_precision_loss: LowPrecisionLoss | None = None,
                 peer: LoopPeer | str | None = None, shipped: bool = False):
        self.config, self.metrics, self.scale = config, metrics, scale  # scale: the float16 loss scale's health
        self.fp8 = fp8  # a float8 recipe's saturated and underflowed elements per Linear and role
        self.low_precision_loss = low_precision_loss  # the first step's loss function that returned 16 bits
        self.peer = peer  # a step_fn's careful-loop peer (training.peer), or why it could not run
        self.shipped = shipped  # the config the repository trains in (TrainSpec.ships)

    def summary(self) -> dict:
        m = self.metrics
        uname, urate = m.worst(m.underflow_rate)
        lname, lrate = m.worst(m.update_lost_rate)
        return {"steps": m.steps, "max_loss_deviation": m.max_loss_deviation,
                "underflow_elements": m.underflow_elements.get(uname), "update_lost_elements": m.update_elements.get(lname),
                "model_dtypes": sorted(m.built_dtypes),
                "grad_sqnr_db": min(m.group_grad_sqnr_db.values(), default=m.grad_sqnr_db),
                "group_grad_sqnr_db": dict(m.group_grad_sqnr_db), "worst_grad_sqnr_db": m.worst_grad_sqnr_db,
                "grad_norm_ratio": m.worst_grad_norm_ratio,
                "param_sqnr_db": m.param_sqnr_db, "max_underflow_rate": urate, "underflow_param": uname,
                "max_update_lost_rate": lrate, "update_lost_param": lname, "update_ratio": m.update_ratio,
                "skipped_steps": list(m.skipped), "first_nonfinite": list(m.first_nonfinite) if m.first_nonfinite else None,
                "step_time_s": m.step_time_s, "fp32_step_time_s": m.fp32_step_time_s,
                "step_time_spread": _finite_or_none(m.step_time_spread),
                "fp32_step_time_spread": _finite_or_none(m.fp32_step_time_spread),
                **({"fp8": self.fp8.as_dict()} if self.fp8 is not None else {}),
                **({"shipped": True} if self.shipped else {})}

    def record_fields(self, outcome) -> dict:
        return {"training": self.summary()}

    def report_fields(self, outcome) -> dict:
        """The whole trajectories (the summary record has the table's metrics)."""
        m = self.metrics
        return {"training_detail": {"losses": m.losses, "fp32_losses": m.fp32_losses, "loss_deviation": m.loss_deviation,
                                    "grad_norms": m.grad_norms, "fp32_grad_norms": m.fp32_grad_norms,
                                    "grad_norm_ratio": m.grad_norm_ratio, "scales": m.scales, "scales_used": m.scales_used,
                                    "underflow_rate": m.underflow_rate, "below_range_underflow": m.below_range_underflow,
                                    "update_lost_rate": m.update_lost_rate, "rates_against": m.truth,
                                    "regression_budget": _budget_json(outcome.baseline.budgets.get(OUTPUT))}}

    def message_lines(self, outcome) -> list[str]:
        m, c = self.metrics, self.config
        lines = [f"  {c.id}: {c.description}; against the fp32 run from the same seed, {m.steps} steps:"]
        rows = []
        for i in range(m.steps):
            scale = m.scales_used[i] if i < len(m.scales_used) else None  # the scale the step ran with
            rows.append((i, _g(m.losses[i]), _g(m.fp32_losses[i]), _g(m.loss_deviation[i]),
                         _g(m.grad_norms[i]), _g(m.fp32_grad_norms[i]), _g(m.grad_norm_ratio[i]),
                         "-" if scale is None else f"{scale:g}", "skipped" if i in m.skipped else ""))
        table = tabulate(rows, headers=("step", "loss", "fp32 loss", "rel. deviation", "grad norm", "fp32 grad norm",
                                        "ratio", "loss scale", ""), tablefmt="plain")
        lines += ["    " + row for row in table.splitlines()]
        groups = ", ".join(f"{g} {_g(v)} dB" for g, v in m.group_grad_sqnr_db.items())
        at = f" (step {m.worst_grad_sqnr_at[0]}, {m.worst_grad_sqnr_at[1]})" if m.worst_grad_sqnr_at else ""
        lines.append(f"    gradient SQNR at the first step: {groups or '-'}; worst {_g(m.worst_grad_sqnr_db)} dB{at} "
                     f"(floors {first_step_floor_db(c.mantissa_bits):.3g} and {later_step_floor_db(c.mantissa_bits):.3g} dB "
                     f"for {c.precision_name}); cosine with fp32's {m.grad_cosine:.6f}")
        lines.append(f"    final parameters: SQNR {_g(m.param_sqnr_db)} dB; update / fp32 update (median over steps) "
                     f"{_g(m.update_ratio)}")
        if len(m.groups) > 1:
            lines += [f"    {g}: {len(names)} tensors ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                      for g, names in m.groups.items()]
        lines.append(rates_line(f"gradient-underflow rate (0 here, significant in {m.truth}, first step)", m.underflow_rate,
                                m.underflow_elements))
        if any(m.below_range_underflow.values()):
            lines.append(rates_line(f"lost below {c.precision_name}'s range at the loop's scale (shown, not judged)",
                                    m.below_range_underflow, m.below_range_elements))
        lines.append(rates_line(f"update-lost rate (never moved here; {m.truth}'s first update fp32 keeps)",
                                m.update_lost_rate, m.update_elements))
        if self.scale is not None:
            h = self.scale
            reached = f" ({h.scale:g}, the largest it reached)" if h.grew else ""
            lines.append(f"    loss scale: {history_text(h)}; at step {h.step}{reached}, {sum(h.below.values())} of "
                         f"{sum(h.elements.values())} significant {h.truth} gradients below float16's normal range, "
                         f"{sum(h.below_working.values())} at {h.working:g} (a working GradScaler's scale here)")
        note = built_dtype_note(m.built_dtypes, sum(len(names) for names in m.groups.values()) or None)
        if note:
            lines.append(f"    {note}")
        if self.fp8 is not None:
            lines += _fp8_lines(self.fp8)
        return lines


def _fp8_lines(counts: Fp8Counts) -> list[str]:
    """The float8 casts of a run: the totals, then each tensor that saturated or lost values."""
    r = counts.recipe
    names = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
    if r is None:  # the spec's own conversion: what its casts were, observed
        how, where = "the spec's own conversion, observed", f"{len(counts.linears)} modules"
    else:
        fwd, grad = (names[str(d).replace("torch.", "")] for d in (r.forward_dtype, r.grad_dtype))
        history = f", amax history of {r.history} calls" if r.scaling == "delayed" else ""
        how, where = (f"{r.scaling} scaling{history}; inputs and weights {fwd}, output gradients {grad}",
                      f"{len(counts.linears)} Linears")
    lines = [f"    fp8 casts ({how}) over {where}: saturated {counts.total('saturated')} of {counts.total('elements')} "
             f"elements (worst {worst_text(counts, 'saturated')}), significant values lost to 0 "
             f"{counts.total('underflowed')} of {counts.total('significant')} "
             f"(worst {worst_text(counts, 'underflowed')})"]
    # the tensors with the most saturated, then lost, elements for their size
    worst = sorted(((max(c.saturated / c.elements, c.underflowed / max(1, c.significant)), n, role, c)
                    for (n, role), c in counts.tensors.items() if c.saturated or c.underflowed), reverse=True)
    rows = [(f"{n} {role}", c.calls, c.elements, c.saturated, "-" if c.first_saturated_call is None else
             c.first_saturated_call, c.significant, c.underflowed) for _, n, role, c in worst[:FP8_ROWS]]
    if rows:
        table = tabulate(rows, headers=("tensor", "calls", "elements", "saturated", "from call", "significant",
                                        "lost to 0"), tablefmt="plain")
        lines += ["      " + row for row in table.splitlines()]
        if len(worst) > FP8_ROWS:
            lines.append(f"      and {len(worst) - FP8_ROWS} more tensors with a saturated or lost element (the report "
                         "has every tensor)")
    return lines


FP8_ROWS = 5  # tensors a message lists


def _budget_json(budget: TrajectoryBudget | None) -> dict | None:
    """The budget the golden judged the run by, as the golden holds it (None: not judged)."""
    return None if budget is None else budget.to_json()


def _finite_or_none(v: float) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def _opt(v) -> str:
    """A metric a row may not have (a DDP case has no loss trajectory): "-"."""
    return "-" if v is None else fmt(float(v))


def _with_spread(step: float, spread: float | None) -> str:
    return format_seconds(step) + ("" if spread is None else f" \u00b1{100 * spread:.0f} %")


def _rate(rate: float, param: str, elements: int | None) -> str:
    """A table cell: the worst parameter's rate with the count that decides it."""
    if not rate:
        return "0"
    if not elements:
        return f"{percent(rate)} {param}"
    return f"{percent(rate)} ({round(rate * elements)}/{elements}) {param}"


class TrainingTable(SummaryTable):
    """One row per target and training config (the records carry their metrics under ``training``)."""

    name = "training"
    title = "precision training summary"
    detail = "; each config against the fp32 run from the same seed"
    markdown_heading = "Training (each config against the fp32 run from the same seed)"
    HEADERS = ("target", "config", "steps", "max loss dev.", "grad SQNR dB (first, worst)", "param SQNR dB",
               "grad underflow", "update lost", "skipped", "step time", "vs fp32", "verdict")

    def render(self, records: list[dict], config_order: list[str] | None = None) -> str:
        # TrainSpec(seeds=N)'s cases: a table of their own
        seeds = [r for r in records if seeds_of(r.get("regime", ""))]
        records = [r for r in records if not seeds_of(r.get("regime", ""))]
        order = {c: i for i, c in enumerate(TRAIN_CONFIGS)}
        rows = []
        for r in sorted(records, key=lambda r: (r["target"], order.get(r["config"], len(order)), r["config"])):
            if "skipped" in r or "crashed" in r:  # no metrics; the summary says why below the table
                rows.append((r["target"], r["config"], *("-" * 9), f"skip: {r['skipped']}" if "skipped" in r
                             else "FAIL crash"))
                continue
            t = r["training"]
            verdict = "pass" if r["passed"] else "FAIL " + ",".join(r["categories"])
            step, fp32_step = t.get("step_time_s"), t.get("fp32_step_time_s")
            timed = step is not None and math.isfinite(step) and step > 0
            spread = t.get("step_time_spread")
            speedup = "-" if r["config"] == "fp32" else speedup_text(step, spread, fp32_step, t.get("fp32_step_time_spread"))
            worst = t.get("worst_grad_sqnr_db")
            sqnr = _opt(t["grad_sqnr_db"]) + ("" if worst is None else f", {_opt(worst)}")
            config = f"{r['config']} (shipped)" if t.get("shipped") else r["config"]  # TrainSpec.ships
            rows.append((r["target"], config, t["steps"], _opt(t["max_loss_deviation"]), sqnr,
                         _opt(t["param_sqnr_db"]),
                         _rate(t["max_underflow_rate"], t["underflow_param"], t.get("underflow_elements")),
                         _rate(t["max_update_lost_rate"], t["update_lost_param"], t.get("update_lost_elements")),
                         len(t["skipped_steps"]),
                         _with_spread(step, spread) if timed else "-", speedup, verdict))
        table = tabulate(rows, headers=self.HEADERS, tablefmt="github")
        built = sorted({(r["target"], ", ".join(r["training"]["model_dtypes"])) for r in records
                        if "training" in r and r["training"].get("model_dtypes")})
        for r in sorted(records, key=lambda r: (r["target"], order.get(r["config"], len(order)), r["config"])):
            # a float8 recipe's casts, in the table's order: what saturated and what was lost (training.fp8)
            fp8 = r.get("training", {}).get("fp8")
            if fp8:
                table += "\n" + _fp8_note(r["target"], r["config"], fp8)
        for target, dtypes in built:  # said where a passing run is read too (the message says it in full)
            table += (f"\n{target}: model_fn() built parameters in {dtypes}; every config started from them cast to "
                      "float32 master weights (see the warning; return a float32 model to start from yours)")
        if not seeds:
            return table
        return render_rates(seeds) if not records else f"{table}\n\n{render_rates(seeds)}"


def _fp8_note(target: str, config: str, fp8: dict) -> str:
    """Under the table, a float8 recipe's run: its saturated and lost elements, with the worst tensor."""
    parts = []
    for what, total_of, word in (("saturated", "elements", "saturated"), ("underflowed", "significant", "lost to 0")):
        tensors = fp8["tensors"]
        count = sum(c[what] for c in tensors.values())
        total = sum(c[total_of] for c in tensors.values())
        worst = max(((c[what] / c[total_of], name) for name, c in tensors.items() if c[total_of] and c[what]),
                    default=None)
        worst_part = "" if worst is None else f" (worst {percent(worst[0])} {worst[1]})"
        parts.append(f"{word} {count} of {total}{worst_part}")
    return f"{target} {config}: fp8 casts {', '.join(parts)}"


TRAINING_TABLE = TrainingTable()
