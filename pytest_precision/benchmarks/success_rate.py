"""Success rate over seeds on the built-in GPT: each training config's failure rate against fp32's
over N seeds, and two plants whose rate climbs.

    python -m pytest_precision.benchmarks.success_rate [--seeds 20] [--configs ...] [--plant loss|lr|none]

Each seed is a run as the suite's ``seedsN`` case makes it (``training.success_rate``: the seed's
initialisation and data order); each config is set against the fp32 runs of the same seeds with
the suite's bound and test (Fisher's exact test, one-sided, p < 0.01). It prints one table per
spec: the configs' non-finite, past-bound and failed counts, the GradScaler's skipped steps, p and
the verdict.

Plants (``--plant``), each a sweep of the built-in GPT's spec:

- ``loss``: the loss multiplied by M before the backward (AdamW is blind to the gradients' scale, so
  fp32 trains as before; float16 gradients overflow past 65504, and without a GradScaler the
  optimizer applies them);
- ``lr``: AdamW's learning rate raised: the weights grow until float16's forward overflows (a NaN
  loss); a GradScaler skips the steps whose scaled gradients overflow, so its weights grow less
  (measured: it keeps 19 runs of 20 finite at lr 1, none at lr 3).

Measured with 20 seeds on a 2-core CPU machine: every config of the
unplanted GPT 0 of 20; without a GradScaler, loss x 5e5 3 of 20 (p 0.12), x 1e6 20 of 20. It takes
minutes (1 to 5 s per 8-step run on one busy core): ``--seeds 8`` is faster.

The plants on the built-in GPT, 20 seeds each (failed runs; the test's p; the verdict):

- loss x 1e5, 2e5, 3e5 without a GradScaler: 0 of 20; x 5e5: 3 non-finite (p 0.12, pass); x 7e5:
  15 (p 3.9e-7, FAIL); x 1e6: 20 (p 7.3e-12, FAIL). With a GradScaler at 7e5 and 1e6 nothing blows
  up, but the scaler, starting at 65536 and halving once per skipped step, skips all 8 steps of every
  run: 20 of 20 end past the bound, untrained (FAIL). amp-bf16, with float32's range, fails none.
- AdamW at lr 1 (3e-3 is the spec's): 20 of 20 non-finite without a scaler (seeds 0 to 3 reach a NaN
  loss at step 5 of 8), 1 of 20 with one (65 steps skipped, p 0.5, pass); at lr 3, 20 of 20 both
  ways (at step 2 without a scaler; 120 steps skipped with one: a scaler scales only the backward, and
  cannot prevent the forward's overflow). fp32's own runs stay finite (at lr 3 their final losses
  spread by 470); amp-bf16 fails none.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from tabulate import tabulate

from pytest_precision.kinds.registry import get_kind
from pytest_precision.training import TRAIN_CONFIGS, TrainSpec
from pytest_precision.training.success_rate import ALPHA, rates_of, seed_runs

CONFIGS = ("fp32", "amp-bf16", "amp-fp16", "amp-fp16-noscale", "bf16", "bf16-sr", "fp8-e4m3")


@dataclasses.dataclass(frozen=True)
class ScaledLoss:
    """A loss_fn: the model's loss times ``factor`` (the loss-multiplier plant)."""

    factor: float

    def __call__(self, model, batch):
        return self.factor * model(*batch)


@dataclasses.dataclass(frozen=True)
class AdamW:
    """The built-in GPT's optimizer at another learning rate (the learning-rate plant)."""

    lr: float

    def __call__(self, params):
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.01, foreach=False)


def measure(spec: TrainSpec, configs, seeds: int, label: str) -> list[tuple]:
    """One row per config: ``spec``'s seeds under it against fp32's."""
    spec = dataclasses.replace(spec, seeds=seeds)

    def runs(config):
        return seed_runs(spec, TRAIN_CONFIGS[config], "cpu")

    fp32 = runs("fp32")
    rows = []
    for config in configs:
        start = time.perf_counter()
        got = fp32 if config == "fp32" else runs(config)
        r = rates_of(config, got, fp32, TRAIN_CONFIGS[config].loss_rtol)
        n = r.n
        skipped = r.skipped_steps
        rows.append((label, config, n, f"{r.count(got, 'nonfinite')}/{n}", f"{r.count(got, 'past')}/{n}",
                     f"{r.failed}/{n}", f"{r.fp32_failed}/{n}",
                     f"{sum(skipped)} in {sum(1 for k in skipped if k)}" if any(skipped) else "0",
                     f"{r.margin:.3g}", f"{r.p_value:.2g}", "pass" if r.passed else "FAIL",
                     f"{time.perf_counter() - start:.0f} s"))
        print(tabulate([rows[-1]], tablefmt="plain"), flush=True)
    return rows


HEADERS = ("spec", "config", "seeds", "non-finite", "past bound", "failed", "fp32 failed", "skipped steps (runs)",
           "fp32 spread", f"p (Fisher, one-sided; fails < {ALPHA:g})", "verdict", "time")


def builtin_gpt() -> TrainSpec:
    """The built-in GPT's spec, as the runner finds it: the train_step kind's default target."""
    return next(t.fn for t in get_kind("train_step").default_targets() if t.name == "tiny_gpt")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--plant", choices=("loss", "lr", "none", "both"), default="both")
    parser.add_argument("--factors", default="1e5,3e5,5e5,7e5,1e6", help="loss multipliers of the loss plant")
    parser.add_argument("--lrs", default="1,3", help="learning rates of the lr plant")
    parser.add_argument("--plant-configs", default="amp-bf16,amp-fp16,amp-fp16-noscale")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gpt = builtin_gpt()
    rows = []
    if args.configs:
        rows += measure(gpt, args.configs.split(","), args.seeds, "tiny_gpt")
    plant_configs = args.plant_configs.split(",")
    if args.plant in ("loss", "both"):
        for factor in args.factors.split(","):
            spec = dataclasses.replace(gpt, loss_fn=ScaledLoss(float(factor)))
            rows += measure(spec, plant_configs, args.seeds, f"loss x {factor}")
    if args.plant in ("lr", "both"):
        for lr in args.lrs.split(","):
            spec = dataclasses.replace(gpt, optimizer_fn=AdamW(float(lr)))
            rows += measure(spec, plant_configs, args.seeds, f"lr {lr}")
    print()
    print(tabulate(rows, headers=HEADERS, tablefmt="github"))


if __name__ == "__main__":
    main()
