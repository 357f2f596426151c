"""Unused baselines: reported at the end of a --precision-suite run (also merged from xdist
workers), only within what the run could have used, and removed by ``baselines prune``."""
import io
import shutil
import textwrap

import pytest

from pytest_precision.baselines.usage import BaselineUsage, find_unused, incomplete_reason

CONFTEST = textwrap.dedent("""
    import pytest_precision

    @pytest_precision.register("mine", kind="softmax")
    def mine(x):
        return x.float().softmax(-1).to(x.dtype)
""")
USER_TEST = textwrap.dedent("""
    import torch

    def test_golden(precision_config, golden):
        x = torch.linspace(-3, 3, 64).reshape(4, 16)
        inp = precision_config.prepare(x)
        with precision_config:
            out = inp.value.softmax(-1)
        golden.check(out, torch.softmax(inp.exact, -1), inputs=x)
""")
ARGS = ("--precision-suite", "--precision-configs=fp32", "--precision-no-speed")


def _stale(gold, src, dst):
    (gold / dst).parent.mkdir(parents=True, exist_ok=True)
    for suffix in (".npz", ".json"):
        shutil.copy(gold / f"{src}{suffix}", gold / f"{dst}{suffix}")


def _unused_block(stdout):
    lines = stdout.splitlines()
    head = [i for i, line in enumerate(lines) if "unused baseline(s) under" in line]
    if not head:
        return None
    names = []
    for line in lines[head[0] + 1:]:
        if not line.startswith("  "):
            break
        names.append(line.strip())
    return lines[head[0]], names


@pytest.fixture
def project(pytester):
    """A project, its goldens accepted, then three made stale; its sessions run in this process (a
    pytest process each took 5 to 10 s)."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_user=USER_TEST)
    pytester.makeini("[pytest]\nprecision_baseline_dir = gold\n")
    r = pytester.runpytest(*ARGS, "--precision-update-baselines")
    assert r.ret == 0, r.stdout.str()[-3000:]
    gold = pytester.path / "gold"
    _stale(gold, "softmax/mine/unit/fp32", "softmax/mine/removed-regime/fp32")  # a regime that is gone
    _stale(gold, "test_user/test_golden/fp32", "test_user/test_gone/fp32")  # a test that is gone
    _stale(gold, "softmax/mine/unit/fp32", "softmax/mine/unit/bf16")  # a config this run does not select
    return pytester


def _prune(project, *args):
    from pytest_precision.__main__ import main

    out = io.StringIO()
    return main(["baselines", "prune", "--dir", "gold", *args], cwd=project.path, out=out), out.getvalue()


STALE = ["softmax/mine/removed-regime/fp32", "test_user/test_gone/fp32"]


@pytest.mark.slow(reason="three processes start; test_two_workers_usage_merged_equals_one_runs checks the channel")
def test_xdist_workers_usage_is_merged(project):
    pytest.importorskip("xdist")
    r = project.runpytest_subprocess(*ARGS, "-n", "2")
    assert r.ret == 0, r.stdout.str()[-3000:]
    assert _unused_block(r.stdout.str())[1] == STALE


def test_deselected_cases_keep_their_baselines(project):
    r = project.runpytest(*ARGS, "-k", "mine and unit")
    assert r.ret == 0, r.stdout.str()[-3000:]
    # deselected cases (scale20, attention, the user test) would have used theirs: not reported;
    # the stale ones belong to no collected case, selected or not
    assert _unused_block(r.stdout.str())[1] == STALE


def test_unused_are_reported_then_pruned_and_the_next_run_reports_none(project):
    r = project.runpytest(*ARGS)
    assert r.ret == 0, r.stdout.str()[-3000:]
    head, names = _unused_block(r.stdout.str())
    assert head.startswith("2 unused baseline(s) under ") and "python -m pytest_precision baselines prune" in head
    assert names == STALE  # bf16 is out of scope: no bf16 case ran
    code, out = _prune(project, "--dry-run")
    assert code == 0 and "would remove 4 file(s) of 2 unused baseline(s)" in out, out
    gold = project.path / "gold"
    assert (gold / "softmax/mine/removed-regime/fp32.npz").exists()
    code, out = _prune(project)
    assert code == 0 and "removed 4 file(s)" in out, out
    assert not (gold / "softmax/mine/removed-regime").exists()
    assert (gold / "softmax/mine/unit/bf16.npz").exists()
    r = project.runpytest(*ARGS)
    assert r.ret == 0 and _unused_block(r.stdout.str()) is None


def test_partial_runs_judge_nothing():
    usage = BaselineUsage()
    assert incomplete_reason(usage, pytest.ExitCode.INTERRUPTED, 0, 0) == "the run ended with INTERRUPTED"
    assert "stopped at the first failures" in incomplete_reason(usage, pytest.ExitCode.TESTS_FAILED, 1, 1)
    assert incomplete_reason(usage, pytest.ExitCode.TESTS_FAILED, 3, 0) is None


def test_scope_rules(tmp_path):
    for name in ("softmax/t/a/fp32", "softmax/t/b/fp32", "softmax/t/a/fp16", "tests/test_x/test_y/fp32",
                 "tests/test_z/test_w/fp32"):
        (tmp_path / f"{name}.json").parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f"{name}.json").write_text("{}")
    usage = BaselineUsage(used={"softmax/t/a/fp32"})
    assert find_unused(tmp_path, usage, suite_ran=True, kinds={"softmax"}) == ["softmax/t/b/fp32", "tests/test_x/test_y/fp32",
                                                            "tests/test_z/test_w/fp32"]
    assert find_unused(tmp_path, usage, suite_ran=False, kinds={"softmax"}) == ["tests/test_x/test_y/fp32", "tests/test_z/test_w/fp32"]
    usage.whole_project, usage.module_prefixes = False, {"tests/test_x/"}
    usage.excused_prefixes = {"tests/test_x/test_y"}
    usage.excused = {"softmax/t/b/fp32"}
    assert find_unused(tmp_path, usage, suite_ran=True, kinds={"softmax"}) == []


def test_two_workers_usage_merged_equals_one_runs(tmp_path):
    """The xdist channel without the processes: each worker's usage, handed over as JSON-able data
    and merged on the controller, finds what one process's usage finds (the slow test above runs
    the real workers)."""
    import json

    for name in ("softmax/t/a/fp32", "softmax/t/b/fp32", "softmax/t/gone/fp32", "tests/test_x/test_y/fp32"):
        (tmp_path / f"{name}.json").parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f"{name}.json").write_text("{}")
    one = BaselineUsage(used={"softmax/t/a/fp32", "softmax/t/b/fp32"}, excused={"softmax/t/a/fp32", "softmax/t/b/fp32"},
                        module_prefixes={"tests/test_x/"})
    halves = [BaselineUsage(used={"softmax/t/a/fp32"}, excused={"softmax/t/a/fp32"}),
              BaselineUsage(used={"softmax/t/b/fp32"}, excused={"softmax/t/b/fp32"}, module_prefixes={"tests/test_x/"})]
    controller = BaselineUsage()
    for half in halves:
        controller.merge(json.loads(json.dumps(half.as_workeroutput())))
    expected = ["softmax/t/gone/fp32", "tests/test_x/test_y/fp32"]
    assert find_unused(tmp_path, one, suite_ran=True, kinds={"softmax"}) == expected
    assert find_unused(tmp_path, controller, suite_ran=True, kinds={"softmax"}) == expected
    # a worker's usage lost (it went down): what only it used is reported, so a lost worker must be named
    lost = BaselineUsage()
    lost.merge(halves[0].as_workeroutput())
    assert "softmax/t/b/fp32" in find_unused(tmp_path, lost, suite_ran=True, kinds={"softmax"})
