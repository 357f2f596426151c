"""Success rate over seeds (``TrainSpec(seeds=N)``): the statistics (Fisher's exact test, the
seeds' data order, the final-loss margin) and the suite's ``seedsN`` cases end to end (pytester):
a correct spec passes with its rates shown, a loss multiplied past float16's range without a
GradScaler fails naming the rate and the test, while amp-bf16 on the same spec passes."""
import json
import math

import pytest
import torch
from training_helpers import HEADER, run_suite

from pytest_precision.reporting.report import REPORT_SCHEMA
from pytest_precision.training import TrainSpec
from pytest_precision.training.success_rate import (SeedBatches, SeedRun, fisher_exact_greater, least_failing_count,
                                                    loss_margin, rates_of, seed_order, seeded_spec)

pytest_plugins = ["pytester"]


# ---- the statistics ---------------------------------------------------------------------------

def test_fisher_none_failed_on_either_side_passes():
    assert fisher_exact_greater(0, 8, 0, 8) == 1.0
    assert fisher_exact_greater(0, 20, 0, 20) == 1.0


def test_fisher_all_failed_against_none_fails():
    # every table as extreme: 1 / C(2n, n)
    assert fisher_exact_greater(8, 8, 0, 8) == pytest.approx(1 / math.comb(16, 8))
    assert fisher_exact_greater(20, 20, 0, 20) == pytest.approx(1 / 137846528820)


def test_fisher_known_value():
    # 5 of 10 against 1 of 10: sum over k = 5, 6 of C(6, k) C(14, 10 - k) / C(20, 10) = (6 * 2002 + 1001) / 184756
    # (R's fisher.test(matrix(c(5, 5, 1, 9), 2), alternative = "greater")$p.value is 0.0704)
    assert fisher_exact_greater(5, 10, 1, 10) == pytest.approx(13013 / 184756)
    assert round(fisher_exact_greater(5, 10, 1, 10), 4) == 0.0704
    # fewer failures than the reference: nothing to flag
    assert fisher_exact_greater(1, 10, 5, 10) > 0.99


def test_fisher_rejects_impossible_tables():
    with pytest.raises(ValueError, match="more failures than runs"):
        fisher_exact_greater(3, 2, 0, 2)
    with pytest.raises(ValueError, match="ref_runs must be a non-negative int"):
        fisher_exact_greater(0, 2, 0, -1)


def test_least_failing_count_at_small_n():
    # 0.01: with no fp32 failure, 6 of 8 (p 0.0035) fail and 5 (p 0.013) do not; 7 of 20; 4 seeds never can
    assert least_failing_count(8, 0, 8) == 6
    assert fisher_exact_greater(5, 8, 0, 8) == pytest.approx(0.0128, abs=1e-4)
    assert least_failing_count(20, 0, 20) == 7
    assert least_failing_count(4, 0, 4) is None


def test_seed_order_is_the_spec_order_for_seed_zero_and_a_permutation_otherwise():
    assert seed_order(8, 5, 0) == tuple(range(8))
    orders = {seed_order(8, 5 + k, k) for k in range(1, 6)}
    assert all(sorted(o) == list(range(8)) for o in orders) and len(orders) > 1
    assert seed_order(8, 7, 2) == seed_order(8, 7, 2)  # a CPU generator: the same on every call


def test_seeded_spec_keeps_the_contract():
    spec = TrainSpec(lambda: torch.nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1), lambda i: i, steps=4, seed=10,
                     seeds=3)
    one = seeded_spec(spec, 2)
    assert (one.seed, one.seeds) == (12, 1)
    assert isinstance(one.batch_fn, SeedBatches)
    assert sorted(one.batch_fn(i) for i in range(4)) == [0, 1, 2, 3]  # only batches the spec has


def test_spec_rejects_bad_seeds():
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match="TrainSpec.seeds must be a positive int"):
            TrainSpec(lambda: None, lambda p: None, lambda i: i, seeds=bad)


def test_margin_and_bound():
    fp32 = [SeedRun(k, x, False, 0) for k, x in enumerate((2.0, 2.5, 2.1))]
    assert loss_margin([2.0, 2.5, math.nan, 2.1]) == pytest.approx(0.5)
    assert loss_margin([3.0]) == 0.0
    runs = [SeedRun(0, 2.49, False, 0), SeedRun(1, 3.01, False, 2), SeedRun(2, math.nan, True, 0, "loss at step 1")]
    r = rates_of("amp-fp16", runs, fp32, 5e-3)
    assert r.bound(0) == pytest.approx(2.5) and r.bound(1) == pytest.approx(3.0)
    assert (r.count(runs, "nonfinite"), r.count(runs, "past"), r.failed, r.fp32_failed) == (1, 1, 2, 0)
    # the floor: fp32 seeds that agree leave the config's loss tolerance
    same = [SeedRun(k, 2.0, False, 0) for k in range(3)]
    assert rates_of("bf16", same, same, 0.1).bound(0) == pytest.approx(2.2)
    with pytest.raises(ValueError, match="are not fp32's"):
        rates_of("x", runs[:2], fp32)


# ---- the suite's seedsN cases -----------------------------------------------------------------

SEEDED = HEADER + """

def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


pytest_precision.register("mlp", pytest_precision.TrainSpec(lambda: Net({SCALE}), adam, batch, steps=4, seeds={SEEDS}),
                          kind="train_step")
"""


def test_correct_spec_over_seeds_passes_and_shows_the_rates(pytester):
    pytester.makeconftest(SEEDED.format(SCALE="1.0", SEEDS=6))
    result = run_suite(pytester, "--precision-configs=fp32,amp-bf16,amp-fp16", "-k", "seeds6")
    result.assert_outcomes(passed=4)  # fp32, amp-bf16, amp-fp16 with and without a GradScaler
    result.stdout.fnmatch_lines([
        "success rate over seeds (each config against the fp32 runs from the same seeds):",
        "| target *| config *| seeds *| non-finite *| past loss bound *| failed *| fp32 failed *| skipped steps *| "
        "p (Fisher's exact test, one-sided) *| verdict *|",
        "| mlp *| fp32 *| 6 *| 0/6 (0 %) *| 0/6 (0 %) *| 0/6 (0 %) *| 0/6 (0 %) *| 0 *| 1 *| pass *|",
        "| mlp *| amp-fp16 *| 6 *| 0/6 (0 %) *| 0/6 (0 %) *| 0/6 (0 %) *| 0/6 (0 %) *| 0 *| 1 *| pass *|",
    ])


def test_seeds_one_adds_no_case(pytester):
    pytester.makeconftest(SEEDED.format(SCALE="1.0", SEEDS=1))
    result = run_suite(pytester, "--precision-configs=fp32", "--collect-only", "-q")
    result.stdout.fnmatch_lines(["*train_step[[]mlp-fp32-trajectory[]]*"])
    assert "seeds" not in result.stdout.str()


def test_loss_past_float16_range_without_a_scaler_fails_the_success_rate(pytester):
    """The plant: a loss of about 1e8 (the gradient reaching the output is past 65504): without a
    GradScaler every seed's fp16 gradients are inf and the optimizer applies them; bf16 keeps
    float32's range and passes on the same spec. The seeds come from --precision-train-seeds."""
    pytester.makeconftest(SEEDED.format(SCALE="1e8", SEEDS=1))  # the option gives the seeds
    result = run_suite(pytester, "--precision-configs=amp-bf16,amp-fp16", "--precision-train-seeds=6", "-k",
                       "amp-fp16-noscale-seeds6 or amp-bf16-seeds6", "--precision-report=report.json")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*train_step[[]mlp-amp-fp16-noscale-seeds6[]]: FAIL success_rate (failure rate 6/6 (100 %) against fp32's "
        "0/6 (0 %) over seeds 0 to 5 (6 with a non-finite loss or gradient): Fisher's exact test, one-sided, "
        "p = 0.0011 < 0.01)",
        "*seed *final loss *fp32 final loss *bound *skipped steps *first non-finite *run",
        # each seed's first op that lost the value, at its step (before: the step alone), for the first 3
        *(f"    seed {k}: first overflow in aten::* at conftest.py:* under amp-fp16-noscale*: produced *inf from finite "
          "inputs*" for k in range(3)),
        "    3 more seeds went non-finite, not located (the first 3 are)",
        "*Fisher's exact test, one-sided: p = 0.0011 for 6 failed runs of 6 against fp32's 0 of 6; a config fails "
        "below p = 0.01, here from 5 failed runs",
        "| mlp *| amp-bf16 *| 6 *| 0/6 (0 %) *|*| pass *|",
        "| mlp *| amp-fp16-noscale *| 6 *| 6/6 (100 %) *|*| 6/6 (100 %) *| 0/6 (0 %) *|*| 0.0011 *| "
        "FAIL success_rate *|",
    ])
    # the JSON report carries the counts, valid against its schema (non-finite losses as "nan")
    report = json.loads((pytester.path / "report.json").read_text())
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(report, REPORT_SCHEMA)
    case = next(c for c in report["cases"] if c["config"] == "amp-fp16-noscale")
    assert (case["success_rate"]["nonfinite"], case["success_rate"]["fp32_failed"]) == (6, 0)
    assert case["success_rate"]["final_losses"] == ["nan"] * 6


def test_ddp_configs_skip_the_success_rate_and_too_few_seeds_are_said(pytester):
    pytester.makeconftest(SEEDED.format(SCALE="1.0", SEEDS=2))
    result = run_suite(pytester, "--precision-configs=fp16,fp32", "-k", "seeds2", "-rs")
    result.assert_outcomes(passed=1, skipped=2)  # ddp-fp16 and fsdp-fp16-reduce-fp16
    result.stdout.fnmatch_lines([
        "*ddp-fp16: a DDP case compares one all-reduce; the success rate over seeds runs step loops*",
        "*fsdp-fp16-reduce-fp16: an FSDP2 case compares one step; the success rate over seeds runs step loops*",
        "2 seeds cannot fail a config at p < 0.01 (Fisher's exact test, one-sided); against no fp32 failure it takes "
        "5 seeds or more"])


def test_the_option_overrides_the_spec_and_rejects_a_bad_count(pytester):
    pytester.makeconftest(SEEDED.format(SCALE="1.0", SEEDS=8))
    result = run_suite(pytester, "--precision-configs=fp32", "--precision-train-seeds=3", "--collect-only", "-q")
    result.stdout.fnmatch_lines(["*train_step[[]mlp-fp32-trajectory[]]*", "*train_step[[]mlp-fp32-seeds3[]]*"])
    assert "seeds8" not in result.stdout.str()
    result = run_suite(pytester, "--precision-configs=fp32", "--precision-train-seeds=1", "--collect-only", "-q")
    assert "seeds" not in result.stdout.str()
    result = run_suite(pytester, "--precision-train-seeds=0")
    result.stderr.fnmatch_lines(
        ["*--precision-train-seeds=0: give a positive number of seeds (1: one run per config)*"])
