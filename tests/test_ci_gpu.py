"""``.ci/gpu``, the one command for a lent GPU machine, made ready without one: its dry run lists and
checks every step, a step that names a missing module, file or option is caught, the budgets it
packs are the goldens the main job added a key to, and the project runs from the source tree with
its plugin declared where it is not installed (the GPU machine installs nothing)."""
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "gpu"


@pytest.fixture(scope="module")
def gpu():
    loader = importlib.machinery.SourceFileLoader("ci_gpu", str(SCRIPT))
    spec = importlib.util.spec_from_loader("ci_gpu", loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules["ci_gpu"] = module  # its dataclasses look their module up
    loader.exec_module(module)
    yield module
    sys.modules.pop("ci_gpu", None)


def test_the_dry_run_lists_every_step_with_its_command_and_limit_and_checks_them():
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for step in ("device (30 s)", "main job (200 s)", "kernel bench (60 s)", "speed gate (70 s)", "clients (80 s)",
                 "budgets (20 s"):
        assert any(line.startswith(f"  {step}") for line in lines), (step, done.stdout)
    assert "--precision-add-machine" in done.stdout and "--precision-device=cuda" in done.stdout
    assert lines[0] == "6 steps, at most 480 s in all (limits: 460 s):"
    assert "(merged into $OUT/main.json and $OUT/main.md)" in done.stdout  # the main job in three sessions
    assert lines[-1] == "dry run: every step checked"


def test_a_step_that_names_what_does_not_exist_fails_the_dry_run(gpu, monkeypatch, capsys):
    broken = [gpu.Step("missing module", 10, [sys.executable, "-m", "no_such_module"], module="no_such_module"),
              gpu.Step("missing file", 10, [sys.executable, "-m", "pytest", "tests/nope.py"], paths=["tests/nope.py"]),
              gpu.Step("unknown option", 10, [sys.executable, "-m", "pytest", "--precision-nope"],
                       options=["--precision-nope"]),
              gpu.Step("option its module lacks", 10, [sys.executable, "-m", "pytest_precision.kernels.bench", "--nope"],
                       module="pytest_precision.kernels.bench"),
              gpu.Step("too long", gpu.TOTAL_S, [sys.executable, "-c", "pass"])]
    monkeypatch.setattr(gpu, "STEPS", broken)
    assert gpu.dry_run() == 1
    out = capsys.readouterr().out
    for problem in ("missing module: module no_such_module not found", "missing file: tests/nope.py not found",
                    "unknown option: --precision-nope is not a pytest-precision option",
                    "option its module lacks: --nope is not an option of pytest_precision.kernels.bench",
                    "the steps' limits add up to more than 480 s"):
        assert f"PROBLEM: {problem}" in out, (problem, out)


def test_the_budgets_packed_are_the_goldens_that_gained_the_machines_key(gpu, monkeypatch, tmp_path):
    for name, keys in (("fp32", ["cpu-avx2"]), ("bf16", ["cpu-avx2", "cuda-sm90"]), ("fp16", ["cpu-avx2"])):
        path = tmp_path / "baselines" / "softmax/mine/unit" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"budgets": {k: {} for k in keys}}))
    (tmp_path / "baselines/softmax/mine/unit/fp16.npz").write_bytes(b"not json")
    monkeypatch.setattr(gpu, "ROOT", tmp_path)
    before = gpu.keyed("cuda-sm90")
    assert before == {"baselines/softmax/mine/unit/bf16.json"}  # held it already: not packed
    # the main job adds the key to fp32's; fp16's is rewritten (its mtime moves) without it
    (tmp_path / "baselines/softmax/mine/unit/fp32.json").write_text(json.dumps(
        {"budgets": {"cpu-avx2": {}, "cuda-sm90": {}}}))
    (tmp_path / "baselines/softmax/mine/unit/fp16.json").write_text(json.dumps({"budgets": {"cpu-avx2": {}}}))
    added = sorted(gpu.keyed("cuda-sm90") - before)
    assert added == ["baselines/softmax/mine/unit/fp32.json"]
    out = tmp_path / "out"
    out.mkdir()
    gpu.pack_budgets(out, added, "gpu NVIDIA H100 80GB HBM3 capability 9.0")
    with tarfile.open(out / "cuda-budgets.tar.gz") as tar:
        assert tar.getnames() == ["baselines/softmax/mine/unit/fp32.json", "FINGERPRINT"]
        assert b"NVIDIA H100" in tar.extractfile("FINGERPRINT").read()


def test_the_project_runs_from_its_source_tree_with_the_plugin_declared(gpu, monkeypatch):
    """Without site's .pth files (the editable install's finder), the package finds its suites and
    kernels beside it; the shim's distribution record declares the pytest11 entry point."""
    site_packages = next(p for p in sys.path if p.endswith("site-packages"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), site_packages])}
    done = subprocess.run([sys.executable, "-S", "-c", "import pytest_precision.suites as s, pytest_precision.kernels "
                           "as k; print(s.__file__); print(k.__file__)"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)
    assert done.stdout.split() == [str(ROOT / "suites" / "__init__.py"), str(ROOT / "kernels" / "__init__.py")], done.stderr

    from importlib import metadata
    monkeypatch.setattr(metadata, "entry_points", lambda group: [])  # as where it is not installed
    shim_env = gpu.plugin_shim()
    shim = shim_env["PYTHONPATH"].split(os.pathsep)[0]
    found = metadata.distributions(path=[shim])
    eps = [(ep.group, ep.name, ep.value) for dist in found for ep in dist.entry_points]
    assert eps == [("pytest11", "precision", "pytest_precision.plugin")]
    assert "TRITON_INTERPRET" not in shim_env


def test_a_step_past_its_limit_is_interrupted_and_its_shards_reports_merged(gpu, monkeypatch, tmp_path):
    monkeypatch.setattr(gpu, "GRACE_S", 1)
    sleeper = gpu.Step("sleeper", 12, [sys.executable, "-c", "import time; print('started', flush=True); "
                                                             "time.sleep(60)"])
    ran = gpu.run_step(sleeper, tmp_path, dict(os.environ), 600, tmp_path)
    assert ran.rc == 124 and ran.seconds < 15 and "started" in ran.tail and "interrupted at its limit" in ran.tail

    work = tmp_path / "work"
    work.mkdir()
    for i, (target, verdict) in enumerate((("a", "pass"), ("b", "fail"))):
        (work / f"main-{i}.json").write_text(json.dumps({"totals": {"cases": 1, "passed": int(verdict == "pass")},
                                                         "cases": [{"target": target, "verdict": verdict}]}))
        (work / f"main-{i}.md").write_text(f"report {i}")
    gpu.merge_reports(work, tmp_path, 2)
    merged = json.loads((tmp_path / "main.json").read_text())
    assert [c["target"] for c in merged["cases"]] == ["a", "b"] and merged["totals"] == {"cases": 2, "passed": 1}
    assert (tmp_path / "main.md").read_text() == "report 0\n\nreport 1"
    counts, failed = gpu._report_counts(tmp_path / "main.json")
    assert counts == {"pass": 1, "fail": 1} and len(failed) == 1
