"""pytest's rerun options on suite cases (issue 42): their node ids round-trip through pytest's cache
as a parametrised test's do, so ``--lf`` reruns the failed cases alone, ``--ff`` runs them first and
``--sw`` continues from the one that failed. Before, ``--lf`` and ``--sw`` reran every case."""
pytest_plugins = ["pytester"]

# a softmax correct in fp32 and 5 % high in bf16: the bf16 cases fail, the fp32 ones pass
PLANTED = """
import torch
import pytest_precision


@pytest_precision.register("mine", kind="softmax")
def mine(x):
    xf = x.float()
    e = (xf - xf.amax(-1, keepdim=True)).exp()
    out = e / e.sum(-1, keepdim=True)
    return (out * 1.05 if x.dtype == torch.bfloat16 else out).to(x.dtype)
"""
ARGS = ("--precision-suite", "--precision-configs=fp32,bf16", "--precision-no-speed", "-k",
        "softmax and mine and (unit or near-ties)")


def test_last_failed_and_failed_first_rerun_the_suite_cases_that_failed(pytester):
    pytester.makeconftest(PLANTED)
    pytester.runpytest(*ARGS, "--precision-update-baselines")  # goldens of the passing cases
    pytester.runpytest(*ARGS).assert_outcomes(passed=2, failed=2)
    result = pytester.runpytest(*ARGS, "--lf")
    outcomes = result.parseoutcomes()
    assert (outcomes["failed"], outcomes.get("passed", 0)) == (2, 0), outcomes
    result.stdout.fnmatch_lines(["run-last-failure: rerun previous 2 failures*"])
    result = pytester.runpytest(*ARGS, "--ff", "-v")
    result.assert_outcomes(passed=2, failed=2)
    lines = [line for line in result.stdout.lines if line.startswith("precision-suite::softmax[") and "%]" in line]
    assert ["bf16" in line for line in lines] == [True, True, False, False], lines  # the failures first


def test_stepwise_continues_from_the_suite_case_that_failed(pytester):
    pytester.makeconftest(PLANTED)
    pytester.runpytest(*ARGS, "--precision-update-baselines")
    first = pytester.runpytest(*ARGS, "--sw")
    first.assert_outcomes(failed=1, passed=first.parseoutcomes().get("passed", 0))
    again = pytester.runpytest(*ARGS, "--sw")
    again.stdout.fnmatch_lines(["stepwise: skipping * already passed items*"])
    before, after = first.parseoutcomes(), again.parseoutcomes()
    assert before.get("passed", 0) > 0 and after["deselected"] - before["deselected"] == before["passed"]


def test_stepwise_skip_passes_over_the_first_failing_suite_case(pytester):
    pytester.makeconftest(PLANTED)
    pytester.runpytest(*ARGS, "--precision-update-baselines")
    result = pytester.runpytest(*ARGS, "--sw-skip", "-v")
    # the first failing case is skipped over, the run stops at the second
    outcomes = result.parseoutcomes()
    assert outcomes["failed"] == 2 and "stepwise" in result.stdout.str(), result.stdout.str()[-2000:]
    again = pytester.runpytest(*ARGS, "--sw", "-v")
    again.stdout.fnmatch_lines(["stepwise: skipping * already passed items*"])
