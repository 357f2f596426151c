"""Report files of a real run: the JSON validates against its schema, the Markdown has the
terminal's table, the plots are PNGs that open."""
import json
import math
import subprocess
import sys
import textwrap

import pytest

from pytest_precision.reporting.report import REPORT_SCHEMA, build_report, json_safe, render_markdown


def _jsonschema():
    return pytest.importorskip("jsonschema", reason="jsonschema is in the test extra: pip install -e '.[test]'")


CONFTEST = textwrap.dedent("""
    import pytest_precision

    @pytest_precision.register("naive", kind="softmax")
    def naive(x):  # no max subtraction: overflows in fp16, so the report has failures and inf ULPs
        e = x.exp()
        return e / e.sum(-1, keepdim=True)
""")
ARGS = ("--precision-suite", "--precision-configs=fp16", "-k", "naive", "--precision-no-speed", "-p", "no:cacheprovider")


def _pytest(cwd, *args):
    return subprocess.run([sys.executable, "-m", "pytest", *ARGS, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One project, its goldens accepted, then a run that writes every report file."""
    d = tmp_path_factory.mktemp("project")
    (d / "conftest.py").write_text(CONFTEST)
    (d / "pytest.ini").write_text("[pytest]\nprecision_baseline_dir = gold\n")
    # not the drawn regime: it keeps no golden, and the naive target's search would shrink a failure
    _pytest(d, "--precision-update-baselines", "-k", "naive and not hypothesis")
    plots = ("--precision-plots=figs",) if _has_matplotlib() else ()
    result = _pytest(d, "--precision-report=out/report.json", "--precision-report-md=out/report.md", *plots)
    assert result.returncode == 1, result.stdout + result.stderr  # the naive target fails some cases
    return d, result.stdout


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_json_report_validates_against_its_schema(run):
    jsonschema = _jsonschema()
    d, _ = run
    text = (d / "out" / "report.json").read_text()
    def refuse(name):  # Infinity, -Infinity and NaN are not JSON: other parsers reject them
        raise ValueError(f"non-standard JSON constant {name}")
    report = json.loads(text, parse_constant=refuse)
    jsonschema.Draft202012Validator.check_schema(REPORT_SCHEMA)
    jsonschema.Draft202012Validator(REPORT_SCHEMA).validate(report)
    assert report["totals"] == {"cases": 13, "passed": 2, "failed": 11, "skipped": 0}  # 11 regimes, drawn, fresh
    cases = {c["regime"]: c for c in report["cases"]}
    peak = cases["sharp-peak"]
    assert peak["verdict"] == "fail" and peak["metrics"]["max_ulp"] == "inf"
    # a failing result was not accepted as its golden: no golden to judge it by either
    assert peak["headline"].startswith("FAIL overflow,nan,accuracy,baseline (oracle: NaN 16 > 0 allowed")
    out = peak["outputs"]["reference"]
    assert out["dtype"] == "float16" and out["shape"] == [16, 256]
    # twice the peer's error plus its floor: 2 ULPs and the rounding of a sum of 256 terms in fp16
    assert out["peer_budget"]["max_ulp"] == pytest.approx(2 * out["peer"]["max_ulp"] + 2 + 0.5 * 16 * 2.0 ** (10 - 23))
    assert out["regression_budget"] is None and out["golden"] is None
    assert sum(out["ulp_histogram"]["counts"]) + out["ulp_histogram"]["nonfinite"] == 16 * 256
    assert cases["unit"]["verdict"] == "pass"
    unit = cases["unit"]["outputs"]["reference"]
    assert unit["regression_budget"] is not None and unit["golden"] is not None
    assert cases["hypothesis"]["golden_note"].startswith("drawn inputs have no golden")


def test_schema_rejects_bare_non_finite_floats():
    jsonschema = _jsonschema()
    record = {"suite": "softmax", "target": "t", "config": "fp16", "regime": "r", "nodeid": "n", "max_ulp": math.inf,
              "max_rel": math.nan, "sqnr_db": -math.inf, "overflow": 1, "underflow": 0, "nan": 0, "passed": False,
              "categories": ["overflow"], "time_s": 2e-5, "speed_status": "no-baseline", "speed_ratio": None,
              "peak_bytes": None}
    report = build_report([record], device="cpu", numerics_key="cpu-x", fingerprint="f", torch_version="t",
                          configs=["fp16"])
    validator = jsonschema.Draft202012Validator(REPORT_SCHEMA)
    validator.validate(report)
    assert report["cases"][0]["metrics"]["max_ulp"] == "inf" and report["cases"][0]["metrics"]["max_rel"] == "nan"
    assert report["cases"][0]["timing"] == {"time_s": 2e-5, "speed_status": "no-baseline", "speed_ratio": None,
                                            "peak_bytes": None}
    report["cases"][0]["metrics"]["max_ulp"] = "Infinity"
    assert not validator.is_valid(report)
    assert json_safe({"a": (math.inf, [-math.inf, 1.5])}) == {"a": ["inf", ["-inf", 1.5]]}


def test_markdown_report_has_the_terminal_table(run):
    d, stdout = run
    md = (d / "out" / "report.md").read_text()
    terminal_table = [line for line in stdout.splitlines() if line.startswith("|")]
    assert len(terminal_table) == 3  # header, rule, the naive x fp16 row
    assert [line for line in md.splitlines() if line.startswith("|")] == terminal_table
    assert md.startswith("## pytest-precision: 11 failed, 2 passed, 0 skipped of 13 cases")
    assert "written to" not in md  # the terminal's notes about files are not part of the report
    failing = md.split("### Failing cases", 1)[1]
    assert failing.count("\n- `precision-suite::softmax[naive-fp16-") == 11  # 10 fixed regimes and fresh
    assert "- `precision-suite::softmax[naive-fp16-sharp-peak]`: FAIL overflow,nan,accuracy" in failing


def test_markdown_of_a_passing_run_lists_no_failures():
    rec = {"target": "t", "config": "fp32", "regime": "r", "max_ulp": 1.0, "max_rel": 0.1, "sqnr_db": 90.0,
           "overflow": 0, "underflow": 0, "nan": 0, "passed": True, "categories": []}
    md = render_markdown([rec], config_order=["fp32"], device="cpu", numerics_key="cpu-x", fingerprint="f")
    assert "Failing cases" not in md and "0 failed, 1 passed" in md


def test_plots_are_written_and_open(run):
    pytest.importorskip("matplotlib", reason="plots need the plots extra (matplotlib)")
    import matplotlib.image

    d, stdout = run
    figs = sorted(p.name for p in (d / "figs").iterdir())
    assert figs == ["error-vs-logit-magnitude.png", "ulp-histogram-fp16.png"]
    for name in figs:
        image = matplotlib.image.imread(d / "figs" / name)
        assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 200
        assert image.std() > 0.01  # something was drawn
    assert "precision plots: 2 PNG file(s) written to" in stdout


def test_plots_without_matplotlib_is_a_usage_error(pytester, monkeypatch):
    import pytest_precision.runner.outputs

    monkeypatch.setattr(pytest_precision.runner.outputs, "plots_available", lambda: False)
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest("--precision-plots=figs", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--precision-plots needs matplotlib*pip install 'pytest-precision?plots?'*"])


TRAINING_CONFTEST = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from torch import nn
    import pytest_precision
    from pytest_precision.numerics.inputs import seeded_normal

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 8)

        def forward(self, x, y):
            return 1e-6 * F.mse_loss(self.fc(x), y)

    def batch(i):
        g = torch.Generator().manual_seed(i)
        return seeded_normal(g, 32, 16), seeded_normal(g, 32, 8)

    pytest_precision.register("net", pytest_precision.TrainSpec(Net, lambda p: torch.optim.SGD(p, lr=0.1), batch,
                                                                steps=2), kind="train_step")
""")


def test_training_cases_in_the_reports(pytester):
    """A training run: the JSON report validates with its training fields, and the Markdown report
    has the terminal's training table."""
    jsonschema = _jsonschema()
    pytester.makeconftest(TRAINING_CONFTEST)
    args = ("--precision-suite", "--precision-configs=fp32,amp-fp16", "-k", "train_step", "-p", "no:cacheprovider")
    pytester.runpytest(*args, "--precision-update-baselines")
    result = pytester.runpytest(*args, "--precision-report=report.json", "--precision-report-md=report.md")
    result.assert_outcomes(passed=3)
    report = json.loads((pytester.path / "report.json").read_text())
    jsonschema.Draft202012Validator(REPORT_SCHEMA).validate(report)
    cases = {c["config"]: c for c in report["cases"]}
    noscale = cases["amp-fp16-noscale"]
    assert noscale["suite"] == "training" and "metrics" not in noscale
    assert noscale["training"]["max_underflow_rate"] == 1.0 and noscale["training"]["underflow_param"].startswith("fc.")
    assert len(noscale["training_detail"]["losses"]) == 2
    md = (pytester.path / "report.md").read_text()
    terminal = [line for line in result.outlines if line.startswith("| net ")]
    assert len(terminal) == 3 and all(line in md.splitlines() for line in terminal)
    assert "### Training (each config against the fp32 run from the same seed)" in md


# ------------------------------------------------------------------ report merge (several machines)

def _merge(cwd, *args):
    import io

    from pytest_precision.__main__ import main

    out = io.StringIO()
    return main(["report", "merge", *map(str, args)], cwd=cwd, out=out), out.getvalue()


def test_reports_of_two_machines_merge_into_one_table(run, tmp_path):
    """A real run's report and the same report as another machine would have written it (an H100
    where one case fails): one row per target, config and machine, the failure on its machine's row."""
    d, _ = run
    a = json.loads((d / "out" / "report.json").read_text())
    b = json.loads(json.dumps(a))
    b.update(device="cuda", numerics_key="cuda-sm90", fingerprint="NVIDIA H100 80GB HBM3, CUDA 12.8, torch 2.13.0")
    unit = next(c for c in b["cases"] if c["regime"] == "unit")
    assert unit["verdict"] == "pass"
    unit.update(verdict="fail", categories=["regression"])
    unit["metrics"]["max_ulp"] = 1234.0
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    code, text = _merge(tmp_path, "a.json", "b.json")
    assert code == 0, text
    rows = [line for line in text.splitlines() if line.startswith("| naive")]
    assert len(rows) == 2
    cpu_row, gpu_row = rows
    assert "| fp16 " in cpu_row and f"| {a['numerics_key']} (" in cpu_row and "FAIL 11/13" in cpu_row
    assert "| cuda-sm90 (NVIDIA H100 80GB HBM3) " in gpu_row and "FAIL 12/13" in gpu_row and "regression" in gpu_row
    assert "| 1.23e+03 " not in cpu_row and "inf" in gpu_row  # each row from its own report
    assert "- cuda-sm90 (NVIDIA H100 80GB HBM3): b.json, device cuda, torch" in text
    code, _ = _merge(tmp_path, "a.json", "b.json", "-o", "merged/table.md")
    assert code == 0 and (tmp_path / "merged" / "table.md").read_text() + "\n" == text  # print adds the newline


def test_a_case_only_one_machine_ran_and_training_cases_show_per_machine(tmp_path):
    tensor = {"suite": "softmax", "target": "t", "config": "fp32", "regime": "r", "max_ulp": 3.0, "max_rel": 1e-7,
              "sqnr_db": 140.0, "overflow": 0, "underflow": 0, "nan": 0, "passed": True, "categories": []}
    training = {"suite": "train_step", "target": "tiny_gpt", "config": "amp-fp16", "regime": "trajectory",
                "passed": False, "categories": ["loss"], "training": {"max_loss_dev": 0.1}}
    a = build_report([tensor, training], device="cpu", numerics_key="cpu-avx512", fingerprint="Xeon, cpu-avx512",
                     torch_version="2.13.0", configs=["fp32", "amp-fp16"])
    b = build_report([training], device="cuda", numerics_key="cuda-sm80", fingerprint="NVIDIA A100, CUDA 12.8",
                     torch_version="2.13.0", configs=["fp32", "amp-fp16"])
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    code, text = _merge(tmp_path, "a.json", "b.json")
    assert code == 0
    rows = [line for line in text.splitlines() if line.startswith("| t ") or line.startswith("| tiny_gpt")]
    assert len(rows) == 4
    assert "cpu-avx512 (Xeon)" in rows[0] and "| pass" in rows[0]
    assert "cuda-sm80 (NVIDIA A100)" in rows[1] and "not run" in rows[1]
    assert "FAIL 1/1: loss" in rows[2] and "FAIL 1/1: loss" in rows[3]


def test_merge_names_the_file_it_cannot_use(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "old.json").write_text(json.dumps({"report_version": 0, "cases": []}))
    for name, words in (("bad.json", "not JSON"), ("old.json", "not a pytest-precision report of version 1"),
                        ("gone.json", "cannot read it")):
        code, _ = _merge(tmp_path, name)
        assert code == 2
        assert f"{name}: {words}" in capsys.readouterr().err
