"""Nothing is unused because it crashed: a case that was collected but raised, or was skipped
inside the suite, keeps its golden (never listed unused, never pruned), and the table and the
reports show it with its reason, with totals that match pytest's."""
import json
import textwrap

import pytest

from pytest_precision.reporting.report import REPORT_SCHEMA

pytest_plugins = ["pytester"]

# raises on one regime (rows of length 1), correct on the others
CONFTEST = textwrap.dedent("""
    import os
    import torch
    import pytest_precision

    @pytest_precision.register("mine", kind="softmax")
    def mine(x):
        if x.shape[-1] == 1 and os.environ.get("BREAK_LEN1"):
            raise RuntimeError("no kernel for rows of length 1")
        return torch.softmax(x.float(), -1).to(x.dtype)

    def attention(q, k, v, causal):  # no key_padding_mask: the padding regimes are skipped inside the suite
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])

    pytest_precision.register("mine_attention", attention, kind="attention")
""")
USER_TEST = textwrap.dedent("""
    import os
    import torch

    def test_golden(precision_config, golden):
        if os.environ.get("BREAK_USER"):
            raise RuntimeError("broken before the golden lookup")
        x = torch.linspace(-3, 3, 64).reshape(4, 16)
        inp = precision_config.prepare(x)
        with precision_config:
            out = inp.value.softmax(-1)
        golden.check(out, torch.softmax(inp.exact, -1), inputs=x)
""")
ARGS = ("--precision-suite", "--precision-configs=fp32", "--precision-no-speed",
        "-k", "mine-fp32-unit or mine-fp32-len1] or mine_attention-fp32+math or test_golden")


@pytest.fixture
def project(pytester):
    """The project, its goldens accepted; its sessions run in this process (a pytest process each
    took 5 to 10 s)."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_user=USER_TEST)
    pytester.makeini("[pytest]\nprecision_baseline_dir = gold\n")
    r = pytester.runpytest(*ARGS, "--precision-update-baselines")
    assert r.ret == 0, r.stdout.str()[-3000:]
    return pytester


def test_a_crashed_case_keeps_its_golden(project, monkeypatch):
    import io

    from pytest_precision.__main__ import main

    monkeypatch.setenv("BREAK_LEN1", "1")
    monkeypatch.setenv("BREAK_USER", "1")
    result = project.runpytest(*ARGS, "--precision-report=report.json", "--precision-report-md=report.md")
    stdout = result.stdout.str()
    assert result.ret == 1, stdout[-3000:]
    result.assert_outcomes(failed=2, passed=16, skipped=3)  # padded, padded-mha, causal-leftpad
    assert "unused baseline" not in stdout  # softmax/mine/len1/fp32 and the user test's were not looked up
    out = io.StringIO()
    assert main(["baselines", "prune", "--dir", "gold", "--dry-run"], cwd=project.path, out=out) == 0
    assert "would remove 0 file(s)" in out.getvalue(), out.getvalue()

    # the table: the crashed case counted and failed, its reason and the skip's below the table
    lines = stdout.splitlines()
    row = next(line for line in lines if line.startswith("| mine ") and "| fp32 " in line)
    assert "FAIL 1/2: crash" in row
    assert any("crashed: precision-suite::softmax[mine-fp32-len1]: target 'mine' (softmax) under config fp32 on "
               "regime len1 raised RuntimeError: no kernel for rows of length 1" in line for line in lines)
    assert any(line.startswith("1 case(s) skipped: mine_attention: the padded regime needs a key_padding_mask")
               for line in lines)

    # the JSON report: every suite case, its totals as pytest's for the suite's items
    report = json.loads((project.path / "report.json").read_text())
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator(REPORT_SCHEMA).validate(report)
    assert report["totals"] == {"cases": 20, "passed": 16, "failed": 1, "skipped": 3}
    cases = {c["nodeid"]: c for c in report["cases"]}
    crashed = cases["precision-suite::softmax[mine-fp32-len1]"]
    assert crashed["verdict"] == "fail" and crashed["categories"] == ["crash"]
    assert crashed["crash_reason"].endswith("raised RuntimeError: no kernel for rows of length 1")
    skipped = cases["precision-suite::attention[mine_attention-fp32+math-padded]"]
    assert skipped["verdict"] == "skip" and "key_padding_mask" in skipped["skip_reason"]

    md = (project.path / "report.md").read_text()
    assert md.startswith("## pytest-precision: 1 failed, 16 passed, 3 skipped of 20 cases")
    assert "- `precision-suite::softmax[mine-fp32-len1]`: FAIL crash (target 'mine'" in md
    assert "1 case(s) skipped: mine_attention: the padded regime needs a key_padding_mask" in md


def test_a_worker_that_goes_down_leaves_nothing_to_prune():
    from pytest_precision.baselines.usage import BaselineUsage, incomplete_reason

    usage = BaselineUsage(workers_down=["gw1"])
    assert incomplete_reason(usage, pytest.ExitCode.TESTS_FAILED, 1, 0) == "a worker went down (gw1)"
