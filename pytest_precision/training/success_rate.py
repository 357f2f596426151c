"""Success rate over seeds: a training config run from N seeds, its failure rate set against the
fp32 runs' from the same seeds with an exact one-sided test (``TrainSpec(seeds=N)``).

**A seed** ``k`` (0 to N - 1) is the spec run with ``seed = spec.seed + k``: torch is seeded with it
before ``model_fn()`` (the model's initialisation) and the step's own random draws follow from it;
its **data order** is a permutation of the batch indices ``0 .. steps - 1``, drawn from a CPU
generator seeded with that seed (``seed_order``): step ``i`` runs on ``batch_fn(order[i])``, as a
shuffled epoch would. Seed 0 keeps the spec's own order, so its run is the trajectory case's run.
The batches stay those of the contract (``batch_fn(i)`` for ``i < steps``): a ``batch_fn`` over a
finite list is never asked for a batch it does not have.

**A run fails** when a loss (or a gradient the optimizer applied) is not finite, or when its final
loss (the last step's) is past its bound: the final loss of the fp32 run from the same seed (same
initialisation, same batches) plus the fp32 runs' spread, the largest minus the smallest of their
final losses (``loss_margin``). A run that ends further above its fp32 twin than any two fp32 seeds
end apart did worse than a change of seed explains; less is within what picking another seed does.
The margin is never below the config's ``loss_rtol`` of the fp32 twin's loss (the relative loss
deviation the trajectory case accepts of a correct step: a few seeds can agree by chance). Pairing
each run with its own fp32 twin takes the seeds' own spread (their batches, their initialisation)
out of the comparison: on the built-in GPT the fp32 seeds' final losses spread by 0.046 while a
correct amp-fp16 run ends within 1e-4 of its twin. The steps the GradScaler skipped are counted,
not failed: a run that skipped too many to train ends past the bound where its model trains by
more than the margin.

**A config fails** when its failure count is higher than fp32's beyond chance: Fisher's exact test,
one-sided (``fisher_exact_greater``), p below ``ALPHA`` (0.01). It needs the counts to differ by
much at small N: with 8 seeds and no fp32 failure, 6 failures of 8 (p 0.0035) fail, 5 (p 0.013)
do not; from 20 seeds on, 7 (p 0.0042 at 20). A rare blow-up shows only from 7 failures against
none: 5 of 100 is p = 0.030, and a 5 % rate needs about 200 seeds. The statistics are ``math``
only (no scipy).

Measured on the built-in GPT (8 steps, 20 seeds, one thread): the fp32 final losses range from
5.4665 to 5.5127 (spread 0.046), while each run ends within 3.7e-5 of its fp32 twin under amp-fp16,
8e-5 without a scaler, 2.1e-4 under amp-bf16, 1.1e-3 under fp8 and 0.04 under pure bf16 (whose loss
is itself a bf16 number, 0.03 apart at 5.5). A limit, measured on the test's MLP
(``tests/test_training_seeds.py``): with its loss times 1e8, amp-fp16 with a GradScaler skipped every
one of its 4 steps in all 6 runs (the scaler starts at 65536 and halves once a step) and still
passes, since 4 Adam steps move that model's loss less than its seeds spread (1.08e7 of 1e8): the
skipped-step count shows it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["ALPHA", "SeedBatches", "seed_order", "seeded_spec", "SeedRun", "seed_run", "seed_runs",
           "loss_margin", "fisher_exact_greater", "SeedRates", "rates_of", "least_failing_count"]

ALPHA = 0.01  # a config fails where Fisher's one-sided p is below this


def seed_order(steps: int, seed: int, offset: int) -> tuple[int, ...]:
    """The batch indices seed ``offset`` runs its steps on: the spec's own order for offset 0, else a
    permutation of ``range(steps)`` drawn from a CPU generator seeded with ``seed`` (same on every machine)."""
    if offset == 0:
        return tuple(range(steps))
    g = torch.Generator(device="cpu").manual_seed(seed)
    return tuple(int(i) for i in torch.randperm(steps, generator=g))


@dataclass(frozen=True)
class SeedBatches:
    """``batch_fn`` of one seed: step ``i`` gets ``batch_fn(order[i])`` (hashable: specs key the memos)."""

    batch_fn: Callable[[int], Any]
    order: tuple[int, ...]

    def __call__(self, i: int) -> Any:
        return self.batch_fn(self.order[i])


def seeded_spec(spec, offset: int):
    """``spec`` as seed ``offset`` runs it: seed ``spec.seed + offset``, its data order, one seed."""
    seed = spec.seed + offset
    return dataclasses.replace(spec, seed=seed, seeds=1,
                               batch_fn=SeedBatches(spec.batch_fn, seed_order(spec.steps, seed, offset)))


@dataclass(frozen=True)
class SeedRun:
    """What one seed's run counts: its final loss, whether a loss or an applied gradient was not
    finite, and how many steps the GradScaler skipped."""

    seed: int
    final_loss: float
    nonfinite: bool
    skipped: int
    where: str = ""  # the first non-finite value: "loss at step 3", "gradient of fc1.weight at step 0"
    step: int | None = None  # the step of ``where``

    def past(self, bound: float) -> bool:
        """Whether the final loss is past ``bound`` (a non-finite one is past every bound)."""
        return not self.final_loss <= bound

    def failed(self, bound: float) -> bool:
        return self.nonfinite or self.past(bound)


def seed_run(seed: int, trajectory) -> SeedRun:
    """A training.run.Trajectory as one seed's counts."""
    where = ""
    if trajectory.first_nonfinite is not None:
        step, what = trajectory.first_nonfinite
        where = f"{what} at step {step}"
    else:  # a non-finite loss at a step the scaler skipped (first_nonfinite leaves those out)
        step = next((i for i, x in enumerate(trajectory.losses) if not math.isfinite(x)), None)
        where = "" if step is None else f"loss at step {step}"
    return SeedRun(seed, trajectory.losses[-1], bool(where), len(trajectory.skipped), where, step)


def seed_runs(spec, config, device: str, where: str = "") -> list[SeedRun]:
    """``spec`` run from each of its seeds under ``config`` (a training.configs.TrainConfig);
    ``where`` names the target and config in a TrainingError's message (the seed is added)."""
    from .run import run_training

    return [seed_run(spec.seed + k, run_training(seeded_spec(spec, k), config, device,
                                                 f"{where}, seed {spec.seed + k}" if where else ""))
            for k in range(spec.seeds)]


def loss_margin(fp32_finals: list[float]) -> float:
    """How far the fp32 runs' final losses spread over the seeds: the largest minus the smallest of
    the finite ones (0 for fewer than two)."""
    finite = [x for x in fp32_finals if math.isfinite(x)]
    return max(finite) - min(finite) if len(finite) > 1 else 0.0


def fisher_exact_greater(failed: int, runs: int, ref_failed: int, ref_runs: int) -> float:
    """Fisher's exact test, one-sided: the chance, with the four margins fixed, that the first
    group has ``failed`` or more of all the failures, if each run of either group failed with the
    same chance (the hypergeometric tail). Small: the first group fails more often than the second."""
    for name, v in (("failed", failed), ("runs", runs), ("ref_failed", ref_failed), ("ref_runs", ref_runs)):
        if not (isinstance(v, int) and v >= 0):
            raise ValueError(f"fisher_exact_greater: {name} must be a non-negative int, got {v!r}")
    if failed > runs or ref_failed > ref_runs:
        raise ValueError(f"fisher_exact_greater: more failures than runs ({failed}/{runs}, {ref_failed}/{ref_runs})")
    total, fails = runs + ref_runs, failed + ref_failed
    if total == 0:
        return 1.0
    top = sum(math.comb(fails, k) * math.comb(total - fails, runs - k) for k in range(failed, min(fails, runs) + 1))
    # exact integers to the one division: the tail of a 0/20 against 20/20 table is 7e-12
    return top / math.comb(total, runs)


def least_failing_count(runs: int, ref_failed: int, ref_runs: int, alpha: float = ALPHA) -> int | None:
    """The fewest failures of ``runs`` that fail against ``ref_failed`` of ``ref_runs`` (None: none do)."""
    return next((k for k in range(runs + 1) if fisher_exact_greater(k, runs, ref_failed, ref_runs) < alpha), None)


@dataclass
class SeedRates:
    """One config's seeds against the fp32 runs of the same seeds."""

    config: str
    runs: list[SeedRun]
    fp32: list[SeedRun]
    margin: float  # the fp32 final losses' spread (loss_margin)
    rtol: float = 0.0  # the config's loss_rtol: the margin is at least this much of the fp32 twin's loss

    @property
    def n(self) -> int:
        return len(self.runs)

    def bound(self, k: int) -> float:
        """Seed ``k``'s final-loss bound: its fp32 twin's final loss plus the margin (inf where the
        twin ended non-finite: that run has nothing to be held to)."""
        twin = self.fp32[k].final_loss
        return twin + max(self.margin, self.rtol * abs(twin)) if math.isfinite(twin) else math.inf

    def count(self, runs: list[SeedRun], what: str) -> int:
        """Runs of ``runs`` (this config's or fp32's, seed by seed) that are non-finite, past their
        bound (finite), or either (failed)."""
        test = {"nonfinite": lambda k, r: r.nonfinite, "past": lambda k, r: not r.nonfinite and r.past(self.bound(k)),
                "failed": lambda k, r: r.failed(self.bound(k))}[what]
        return sum(1 for k, r in enumerate(runs) if test(k, r))

    @property
    def failed(self) -> int:
        return self.count(self.runs, "failed")

    @property
    def fp32_failed(self) -> int:
        return self.count(self.fp32, "nonfinite")  # its own twin: past no bound

    @property
    def p_value(self) -> float:
        return fisher_exact_greater(self.failed, self.n, self.fp32_failed, len(self.fp32))

    @property
    def passed(self) -> bool:
        return not self.p_value < ALPHA

    @property
    def skipped_steps(self) -> list[int]:
        return [r.skipped for r in self.runs]

    def as_dict(self) -> dict:
        """The record's fields (the summary table's row, the report)."""
        return {"seeds": self.n, "nonfinite": self.count(self.runs, "nonfinite"),
                "past_bound": self.count(self.runs, "past"),
                "failed": self.failed, "fp32_failed": self.fp32_failed, "p_value": self.p_value,
                "margin": self.margin,
                "skipped_steps": self.skipped_steps, "final_losses": [r.final_loss for r in self.runs],
                "fp32_final_losses": [r.final_loss for r in self.fp32]}


def rates_of(config: str, runs: list[SeedRun], fp32: list[SeedRun], rtol: float = 0.0) -> SeedRates:
    """``runs`` of ``config`` against the ``fp32`` runs of the same seeds (in the same order), with
    the margin they set; ``rtol``: the config's loss_rtol (the margin's floor)."""
    if len(runs) != len(fp32) or any(a.seed != b.seed for a, b in zip(runs, fp32)):
        raise ValueError(f"{config}: the runs' seeds {[r.seed for r in runs]} are not fp32's {[r.seed for r in fp32]}")
    return SeedRates(config, runs, fp32, loss_margin([r.final_loss for r in fp32]), rtol)
