"""The golden check of a training run: the fp32 trajectory it is compared with, and the accepted
budgets of its metrics (the regression budget of the training suite).

A training golden (``<baselines>/train_step/<target>/trajectory/<config>.npz`` and ``.json``) holds
the fp32 run's loss and gradient-norm trajectories and this config's own loss trajectory (float32),
and, per numerics key, the metrics accepted with it and the budgets derived from them:

- the fp32 run of this session must repeat the fp32 trajectory stored for this machine's numerics
  key (a model, data, optimizer or torch change shows here as a moved trajectory, not as a
  precision regression); stored per key because a user's ``nn.init`` draws different float32
  values on different CPU ISAs, so the fp32 run itself differs between machines;
- the largest relative loss deviation from fp32 may grow to ``REGRESSION_SLACK`` x the accepted
  one plus a floor (a tenth of the config's absolute limit);
- the worst per-parameter gradient-underflow and update-lost rates may grow by ``RATE_SLACK``;
- no more steps skipped by the GradScaler than accepted plus one, and no non-finite step where the
  accepted run had none.

Nothing is written without the update flag, as for every golden (golden.py).
"""
from __future__ import annotations

import math

import torch

from .baselines import UPDATE_OPTION, BaselineError, checksum
from .budgets import REGRESSION_SLACK
from .devices import device_class, machine_name
from .golden import Golden, GoldenResult, budget_sources
from .training import TrainConfig, TrainMetrics, Trajectory

__all__ = ["check_trajectory", "load_baseline", "budget_sources", "message_lines", "rates_line",
           "FP32_TRAJECTORY_RTOL", "RATE_SLACK", "OUTPUT"]

# fp32 loss trajectories of the built-in GPT agree across CPU ISAs (AVX512, AVX2, default) to
# about 1e-6 relative over 8 AdamW steps; a change of model, data or optimizer moves them by 1e-3
# and more
FP32_TRAJECTORY_RTOL = 1e-4
RATE_SLACK = 0.02  # two percentage points of a parameter's elements
OUTPUT = "trajectory"  # the one output name under which budgets are filed (baseline tools read it)


def load_baseline(golden: Golden):
    """(the stored baseline or None, None), or (None, a GoldenResult naming the damaged file) when
    it cannot be read and there is no update flag to rewrite it."""
    try:
        return golden.store.load(golden.key, golden.config_id), None
    except BaselineError as e:
        if golden.update:
            return None, None
        return None, GoldenResult(error=f"{e}\n(the file is left as it is; {UPDATE_OPTION} rewrites it)")


def message_lines(g: GoldenResult, update_command: str) -> list[str]:
    """The golden's part of a failure message."""
    if g.error:
        return ["  golden baseline:"] + ["    " + s for s in g.error.splitlines()]
    return ([f"    ({g.note})"] if g.note else []) + [
        f"  if the new results are intended, accept them as the golden with: {update_command}"]


def rates_line(word: str, rates: dict[str, float]) -> str:
    """The five highest nonzero per-parameter rates, as a message line."""
    top = sorted(((r, n) for n, r in rates.items() if r > 0), reverse=True)[:5]
    return f"    {word}: " + (", ".join(f"{n} {100 * r:.1f} %" for r, n in top) if top else "none")


def _accepted(m: TrainMetrics) -> dict:
    uname, urate = m.worst(m.underflow_rate)
    lname, lrate = m.worst(m.update_lost_rate)
    return {"max_loss_deviation": m.max_loss_deviation, "max_underflow_rate": urate, "underflow_param": uname,
            "max_update_lost_rate": lrate, "update_lost_param": lname, "skipped_steps": len(m.skipped),
            "first_nonfinite_step": m.first_nonfinite[0] if m.first_nonfinite else None,
            "grad_sqnr_db": m.grad_sqnr_db, "param_sqnr_db": m.param_sqnr_db}


def _budget(acc: dict, config: TrainConfig) -> dict:
    return {"max_loss_deviation": REGRESSION_SLACK * acc["max_loss_deviation"] + 0.1 * config.loss_rtol,
            "max_underflow_rate": min(1.0, acc["max_underflow_rate"] + RATE_SLACK),
            "max_update_lost_rate": min(1.0, acc["max_update_lost_rate"] + RATE_SLACK),
            "skipped_steps": acc["skipped_steps"] + 1,
            "first_nonfinite_step": acc["first_nonfinite_step"]}


def _widest(budgets: list[dict]) -> dict:
    out = {k: max(b[k] for b in budgets) for k in ("max_loss_deviation", "max_underflow_rate",
                                                   "max_update_lost_rate", "skipped_steps")}
    firsts = [b.get("first_nonfinite_step") for b in budgets if b.get("first_nonfinite_step") is not None]
    out["first_nonfinite_step"] = min(firsts) if firsts else None
    return out


def _inputs_checksum(ref: Trajectory, batch0) -> str:
    """The initial parameters and the first batch: what the seed and the data give."""
    parts = [ref.initial[n].flatten() for n in sorted(ref.initial)]
    leaves = batch0 if isinstance(batch0, (tuple, list)) else (list(batch0.values()) if isinstance(batch0, dict) else [batch0])
    parts += [t.detach().flatten().to(torch.float64).cpu() for t in leaves if isinstance(t, torch.Tensor)]
    return checksum(torch.cat([p.to(torch.float64) for p in parts]))


def _violations(m: TrainMetrics, budget: dict) -> list[tuple[str, str]]:
    acc = _accepted(m)
    out = []
    if not acc["max_loss_deviation"] <= budget["max_loss_deviation"]:
        out.append(("accuracy", f"max loss deviation from fp32 {acc['max_loss_deviation']:.3g} > budget "
                                f"{budget['max_loss_deviation']:.3g}"))
    for key, word, param in (("max_underflow_rate", "gradient-underflow rate", "underflow_param"),
                             ("max_update_lost_rate", "update-lost rate", "update_lost_param")):
        if acc[key] > budget[key]:
            cat = "underflow" if key == "max_underflow_rate" else "accuracy"
            out.append((cat, f"{word} {100 * acc[key]:.1f} % in {acc[param]} > budget {100 * budget[key]:.1f} %"))
    if acc["skipped_steps"] > budget["skipped_steps"]:
        out.append(("overflow", f"{acc['skipped_steps']} steps skipped by the GradScaler > budget {budget['skipped_steps']}"))
    first, allowed = acc["first_nonfinite_step"], budget.get("first_nonfinite_step")
    if first is not None and (allowed is None or first < allowed):
        out.append(("nan", f"non-finite at step {first}, accepted {'none' if allowed is None else f'from step {allowed}'}"))
    return out


def check_trajectory(golden: Golden, config: TrainConfig, run: Trajectory, ref: Trajectory, metrics: TrainMetrics,
                     batch0, seed: int) -> GoldenResult:
    """Compare with the golden, or (update flag) write it; ``GoldenResult.problems`` are the
    regression verdicts, its ``error`` a golden that cannot judge (missing, corrupt, moved)."""
    store, key, cid = golden.store, golden.key, golden.config_id
    input_sum = _inputs_checksum(ref, batch0)
    acc = _accepted(metrics)
    result = GoldenResult()
    base, unusable = load_baseline(golden)
    if unusable:
        return unusable
    nk = golden.budget_key
    if golden.update:
        budgets = dict(base.meta.get("budgets", {})) if base is not None else {}
        old = budgets.get(nk, {}).get("outputs", {}).get(OUTPUT, {}).get("budget")
        new = _budget(acc, config)
        budgets[nk] = {"outputs": {OUTPUT: {"budget": new, "accepted": acc}}, "torch": torch.__version__,
                       "machine": machine_name(golden.device), "fp32_loss": list(ref.losses),
                       "input_checksum": input_sum}
        arrays = {"fp32_loss": torch.tensor(ref.losses), "loss": torch.tensor(run.losses),
                  "fp32_grad_norm": torch.tensor([math.nan if g is None else g for g in ref.grad_norms])}
        store.write(key, cid, arrays, {
            "key": key, "config": cid, "dtypes": {OUTPUT: str(config.compute_dtype).replace("torch.", "")},
            "written_on": nk, "torch": torch.__version__, "seed": seed, "input_spec": {"steps": len(ref.losses)},
            "input_checksum": input_sum, "budgets": budgets})
        head = f"{key} [{cid}] on {nk}"
        if old is None:
            result.updated = f"{head} new: " + _describe(new)
        else:
            moved = [f"{k} {old.get(k)!r} -> {v!r}" for k, v in new.items() if old.get(k) != v]
            result.updated = f"{head} changed: {', '.join(moved)}" if moved else f"{head} unchanged"
        return result
    npz, _ = store.paths(key, cid)
    if base is None:
        return GoldenResult(error=f"no golden baseline at {npz}\nwrite it with: {golden.update_command}")
    recorded = base.meta.get("budgets", {})
    mine = recorded.get(nk) if isinstance(recorded.get(nk), dict) else None
    if mine is not None:
        if mine.get("input_checksum") not in (None, input_sum):
            return GoldenResult(error=(
                f"{base.json_path}: the initial parameters or the first batch changed since the golden was accepted "
                f"on {nk} (a seed, model or data change, not a precision regression); re-accept with: "
                f"{golden.update_command}"))
        stored = mine.get("fp32_loss")
        if not isinstance(stored, list) or len(stored) != len(ref.losses):
            return GoldenResult(error=(
                f"{base.json_path}: holds {len(stored) if isinstance(stored, list) else 0} fp32 steps for {nk}, this run "
                f"has {len(ref.losses)}; re-accept with: {golden.update_command}"))
        problem = _fp32_moved(ref.losses, stored)
        if problem:
            result.problems.append(("regression", problem))
    sources = budget_sources(recorded, nk)
    if not sources:
        return GoldenResult(error=(f"{base.json_path}: no accepted budget for '{nk}' nor any {device_class(nk)} "
                                   f"machine; accept with: {golden.update_command}"))
    if sources != [nk]:
        result.note = (f"no budget recorded for {nk}: judged by the widest recorded for {', '.join(sources)}, its "
                       f"fp32 trajectory not compared; "
                       f"record this machine's with: {golden.update_command}")
    try:
        budget = _widest([recorded[k]["outputs"][OUTPUT]["budget"] for k in sources])
    except (KeyError, TypeError, ValueError) as e:
        return GoldenResult(error=f"{base.json_path}: corrupt training budget under {', '.join(sources)} ({e!r})")
    result.problems += _violations(metrics, budget)
    result.budgets[OUTPUT] = budget  # a dict here, not a Budget: training budgets have their own fields
    return result


def _fp32_moved(now: list[float], stored: list[float]) -> str | None:
    """A sentence when this session's fp32 losses left the stored ones by more than the tolerance."""
    for i, (a, b) in enumerate(zip(now, stored)):
        if not (a == b or abs(a - b) <= FP32_TRAJECTORY_RTOL * abs(b)):  # NaN moved too
            rel = abs(a - b) / abs(b) if b else math.inf
            return (f"the fp32 trajectory moved: step {i} loss {a:.6g} vs golden {b:.6g} (relative {rel:.2g} > "
                    f"{FP32_TRAJECTORY_RTOL:g}): the model, data, optimizer or torch changed the fp32 run itself")
    return None


def _describe(b: dict) -> str:
    return (f"max loss deviation {b['max_loss_deviation']:.3g}, underflow rate {100 * b['max_underflow_rate']:.1f} %, "
            f"update-lost rate {100 * b['max_update_lost_rate']:.1f} %, skipped steps {b['skipped_steps']}")
