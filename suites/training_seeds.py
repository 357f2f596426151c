"""The train_step kind's success-rate cases: a spec with ``TrainSpec(seeds=N)``, N > 1, gets one
more case per config, regime ``seedsN`` (``train_step[tiny_gpt-amp-fp16-seeds8]``): the config run
from N seeds against the fp32 runs from the same seeds (``training.success_rate`` has the seeds,
the bound and the test). It has no golden (N trajectories are not worth storing; the fp32 runs of
the same session judge it, as the drawn regimes' oracle does); the DDP configs have no step loop
to run from seeds and skip it.

Its record carries ``success_rate`` (the counts, the p-value, each seed's final loss), which the
training table renders as a table of its own under the trajectories' (``render_rates``).
"""
from __future__ import annotations

from tabulate import tabulate

from pytest_precision.kinds import BaselineResult, Case, Evidence, Memo, Outcome, TargetError
from pytest_precision.training import TRAIN_CONFIGS, TrainConfig, TrainingError, TrainSpec
from pytest_precision.kinds.training import (ALPHA, GlobalStateError, SeedRates, SeedRun, least_failing_count, rates_of,
                                             seed_runs, seeded_spec)

from .training_faults import step_fault

__all__ = ["PREFIX", "regime_of", "seeds_of", "run_case", "SeedEvidence", "render_rates", "TEST_NAME"]

PREFIX = "seeds"  # the regime's name: seeds8
TEST_NAME = "Fisher's exact test, one-sided"
FP32_RUNS: Memo[tuple, list] = Memo("(spec, device) -> the fp32 runs from its seeds")


def regime_of(spec: TrainSpec) -> str | None:
    """The success-rate case's regime name of ``spec``, or None (one seed: no such case)."""
    return f"{PREFIX}{spec.seeds}" if spec.seeds > 1 else None


def seeds_of(regime: str) -> int | None:
    """N of a ``seedsN`` regime, else None."""
    rest = regime[len(PREFIX):] if regime.startswith(PREFIX) else ""
    return int(rest) if rest.isdigit() else None


def _runs(case: Case, spec: TrainSpec, config: TrainConfig) -> list[SeedRun]:
    try:
        return seed_runs(spec, config, case.device, f"target {case.target.name!r} (train_step) under config {config.id}")
    except TrainingError as e:
        raise TargetError(str(e)) from e.__cause__


def run_case(case: Case, spec: TrainSpec) -> Outcome:
    """The config's seeds against fp32's (memoised per spec and device), judged by their failure rates."""
    config = case.config
    memo, key = case.state.memo(FP32_RUNS), (spec, case.device)
    if key not in memo:
        memo[key] = _runs(case, spec, TRAIN_CONFIGS["fp32"])
    fp32 = memo[key]
    runs = fp32 if config.id == "fp32" else _runs(case, spec, config)
    rates = rates_of(config.id, runs, fp32, config.loss_rtol)
    absent = BaselineResult(absent=f"{spec.seeds} seeds have no golden; the fp32 runs of the same seeds judge them")
    faults = _faults(case, spec, config, runs) if not rates.passed else {}
    outcome = Outcome(case.kind.suite, case.kind.name, case.target.name, config.id, case.regime,
                      SeedEvidence(config, rates, faults), absent)
    if not rates.passed:
        nonfinite, past = rates.count(runs, "nonfinite"), rates.count(runs, "past")
        why = [f"{nonfinite} with a non-finite loss or gradient" if nonfinite else "",
               f"{past} with a final loss past its fp32 twin's + {_margin(rates)}" if past else ""]
        outcome.add("oracle", "success_rate",
                    f"failure rate {_rate(rates.failed, rates.n)} against fp32's {_rate(rates.fp32_failed, len(fp32))} "
                    f"over seeds {spec.seed} to {spec.seed + spec.seeds - 1} ({', '.join(w for w in why if w)}): "
                    f"{TEST_NAME}, p = {rates.p_value:.2g} < {ALPHA:g}")
    return outcome


LOCATED_SEEDS = 3  # seeds whose fault is located (each a replay and a float64 step): the rest are counted


def _faults(case: Case, spec: TrainSpec, config: TrainConfig, runs: list[SeedRun]) -> dict[int | None, str]:
    """Per seed whose run went non-finite, the first ``LOCATED_SEEDS``: the first op that lost the
    value, at its step (training_faults.step_fault), or why it could not be named; under None, how
    many more went non-finite."""
    out = {}
    nonfinite = [(k, run) for k, run in enumerate(runs) if run.nonfinite and run.step is not None]
    for k, run in nonfinite[:LOCATED_SEEDS]:
        try:
            fault = step_fault(seeded_spec(spec, k), config, case.device, run.step)
        except GlobalStateError as e:  # the re-run's step left torch's state changed (restored)
            raise TargetError(str(e)) from None
        except TrainingError as e:
            out[run.seed] = f"not located ({str(e).splitlines()[0]})"
            continue
        out[run.seed] = fault.describe(config.id) if fault is not None else "no op produced it in the traced step"
    if len(nonfinite) > LOCATED_SEEDS:
        out[None] = f"{len(nonfinite) - LOCATED_SEEDS} more seeds went non-finite, not located (the first {LOCATED_SEEDS} are)"
    return out


def _rate(k: int, n: int) -> str:
    return f"{k}/{n} ({100 * k / n:.0f} %)" if n else "0/0"


def _margin(rates: SeedRates) -> str:
    floor = f", at least {rates.rtol:g} of it" if rates.rtol else ""
    return f"{rates.margin:.3g}{floor}"


def _bound_text(rates: SeedRates) -> str:
    return (f"a run fails with a non-finite loss or gradient, or a final loss past the fp32 run's from the same seed + "
            f"{_margin(rates)} (the fp32 seeds' final losses spread by {rates.margin:.3g})")


class SeedEvidence(Evidence):
    """A config's runs from N seeds against the fp32 runs from the same seeds."""

    def __init__(self, config: TrainConfig, rates: SeedRates, faults: dict[int, str] | None = None):
        self.config, self.rates = config, rates
        self.faults = faults or {}  # seed -> the first op that lost its value (a failing case's seeds); None -> the rest

    def record_fields(self, outcome) -> dict:
        return {"success_rate": self.rates.as_dict()}

    def report_fields(self, outcome) -> dict:
        return {"success_rate_detail": {"seeds": [r.seed for r in self.rates.runs],
                                        "first_nonfinite": [r.where or None for r in self.rates.runs],
                                        "first_fault": [self.faults.get(r.seed) for r in self.rates.runs]}}

    def message_lines(self, outcome) -> list[str]:
        r, c = self.rates, self.config
        lines = [f"  {c.id}: {c.description}; {r.n} seeds, each its own initialisation and data order, against the "
                 f"fp32 runs from the same seeds; {_bound_text(r)}:"]
        rows = [(run.seed, f"{run.final_loss:.5g}", f"{ref.final_loss:.5g}", f"{r.bound(k):.5g}", run.skipped,
                 run.where or "-", "FAIL" if run.failed(r.bound(k)) else "ok")
                for k, (run, ref) in enumerate(zip(r.runs, r.fp32))]
        table = tabulate(rows, headers=("seed", "final loss", "fp32 final loss", "bound", "skipped steps",
                                        "first non-finite", "run"), tablefmt="plain")
        lines += ["    " + row for row in table.splitlines()]
        lines += [f"    seed {seed}: {text}" if seed is not None else f"    {text}" for seed, text in self.faults.items()]
        least = least_failing_count(r.n, r.fp32_failed, len(r.fp32))
        lines.append(f"    {TEST_NAME}: p = {r.p_value:.2g} for {r.failed} failed runs of {r.n} against fp32's "
                     f"{r.fp32_failed} of {len(r.fp32)}; a config fails below p = {ALPHA:g}, here from "
                     + (f"{least} failed runs" if least is not None else "no count (too few seeds)"))
        return lines


HEADERS = ("target", "config", "seeds", "non-finite", "past loss bound", "failed", "fp32 failed", "skipped steps",
           f"p ({TEST_NAME})", "verdict")


def render_rates(records: list[dict]) -> str:
    """The success-rate cases' table: one row per target and config."""
    order = {c: i for i, c in enumerate(TRAIN_CONFIGS)}
    rows = []
    for r in sorted(records, key=lambda r: (r["target"], order.get(r["config"], len(order)), r["config"])):
        if "success_rate" not in r:
            rows.append((r["target"], r["config"], *("-" * 7), f"skip: {r['skipped']}" if "skipped" in r
                         else "FAIL crash"))
            continue
        s = r["success_rate"]
        n = s["seeds"]
        skipped = s["skipped_steps"]
        skips = f"{sum(skipped)} in {sum(1 for k in skipped if k)} runs" if any(skipped) else "0"
        rows.append((r["target"], r["config"], str(n), _rate(s["nonfinite"], n), _rate(s["past_bound"], n),
                     _rate(s["failed"], n), _rate(s["fp32_failed"], n), skips, f"{s['p_value']:.2g}",
                     "pass" if r["passed"] else "FAIL " + ",".join(r["categories"])))
    table = ("success rate over seeds (each config against the fp32 runs from the same seeds):\n"
             + tabulate(rows, headers=HEADERS, tablefmt="github", disable_numparse=True))
    # too few seeds for any count to reach p < ALPHA: said, since such a case passes whatever fails
    few = sorted({s["seeds"] for r in records if (s := r.get("success_rate"))
                  and least_failing_count(s["seeds"], s["fp32_failed"], s["seeds"]) is None})
    for n in few:
        table += (f"\n{n} seeds cannot fail a config at p < {ALPHA:g} ({TEST_NAME}); against no fp32 failure it "
                  f"takes {_fewest_seeds()} seeds or more")
    return table


def _fewest_seeds() -> int:
    """The fewest seeds with which a config can fail against no fp32 failure (every run failed)."""
    return next(n for n in range(1, 100) if least_failing_count(n, 0, n) is not None)
