"""Benchmark: how long a model repository's precision run takes, and where the time goes.

    python -m pytest_precision.benchmarks.model_repo [--workdir DIR] [--plant] [--keep]

Writes a repository of the size a model repo has (two attention adapters: an eager one and one
through SDPA; a Triton row-softmax kernel; a small GPT as a TrainSpec), then runs, each in a fresh
process as a user would (``TRITON_INTERPRET=1`` on a CPU machine):

1. ``pytest --precision-suite --precision-update-baselines`` (the goldens are written),
2. ``pytest --precision-suite`` (the check),
3. with ``--plant``: the check again with a planted defect (the eager adapter's softmax in the
   inputs' dtype), to show the verdicts are the same ones in the time bound.

It prints the wall time of each run, the time per kind, target, config, regime and case (each
case's set-up, call and teardown together, from pytest's own per-test durations in a JUnit XML
report), largest first, and the failed cases by target and category.

Measured on a 2-core CPU (``CI=true``), two runs: update 41 and 48 s, check 43 and 46 s, planted 50
and 43 s (41 and 25 failed cases, all of the planted target: 23 on the accuracy regression, the rest
on speed, since the 16-bit softmax is also slower on a CPU); the largest single case is the Triton
kernel's bf16 hypothesis case (17 to 18 s), held to its 20 CPU seconds.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

CONFTEST = '''
import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import pytest_precision
from pytest_precision.suites import tiny_gpt

PLANT = os.environ.get("PLANT_SOFTMAX_IN_DTYPE")


def _causal_scores(q, k, causal):
    s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril().logical_not(),
                          float("-inf"))
    return s


@pytest_precision.register("gpt_eager_attention", kind="attention", grouped_query=False, padding=False)
def gpt_eager_attention(q, k, v, causal=False):
    s = _causal_scores(q, k, causal)
    if PLANT:  # the defect: exp, sum and divide in the inputs' dtype
        e = (s - s.amax(-1, keepdim=True)).exp()
        return (e / e.sum(-1, keepdim=True)) @ v
    return F.softmax(s.float(), dim=-1).to(q.dtype) @ v


@pytest_precision.register("gpt_sdpa_attention", kind="attention", grouped_query=False, padding=False)
def gpt_sdpa_attention(q, k, v, causal=False):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


@triton.jit
def _row_softmax(X, Y, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + row * N + offs, mask=offs < N, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, 0))
    tl.store(Y + row * N + offs, (e / tl.sum(e, 0)).to(Y.dtype.element_ty), mask=offs < N)


@pytest_precision.register("fused_softmax", kind="softmax")
@pytest_precision.needs_triton
def fused_softmax(x):
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty_like(x2)
    _row_softmax[(x2.shape[0],)](x2, y, x2.shape[-1], BLOCK=triton.next_power_of_2(x2.shape[-1]))
    return y.view_as(x)


pytest_precision.register("small_gpt", tiny_gpt.SPEC, kind="train_step")
'''


def _write_repo(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "conftest.py").write_text(textwrap.dedent(CONFTEST).lstrip())
    (root / "pytest.ini").write_text("[pytest]\n")


def _run(root: Path, args: list[str], env: dict, label: str) -> tuple[float, str, Path, Path]:
    junit, report = root / f"{label}.xml", root / f"{label}.json"
    cmd = [sys.executable, "-m", "pytest", "--precision-suite", "-p", "no:cacheprovider", "-q",
           f"--junitxml={junit}", f"--precision-report={report}", *args]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    summary = next((line for line in reversed(proc.stdout.splitlines()) if re.search(r"\d+ (passed|failed)", line)),
                   proc.stdout[-500:])
    return wall, summary.strip("= "), junit, report


def _where(junit: Path, report: Path) -> dict[str, collections.Counter]:
    """Seconds per kind, target, config and regime: pytest's per-test times (set-up, call and
    teardown; the JUnit report) joined to each case's coordinates (the precision report)."""
    seconds = {case.get("name", ""): float(case.get("time", 0)) for case in ET.parse(junit).getroot().iter("testcase")}
    out = {what: collections.Counter() for what in ("kind", "target", "config", "regime", "case")}
    for case in json.loads(report.read_text())["cases"]:
        name = case["nodeid"].split("::", 1)[-1]
        t, kind = seconds.get(name, 0.0), name.split("[", 1)[0]
        out["kind"][kind] += t
        out["target"][case["target"]] += t
        out["config"][case["config"]] += t
        out["regime"][f"{kind}:{case['regime']}"] += t
        out["case"][name] += t
    return out


def _failures(report: Path) -> str:
    """The failed cases by target and by the categories they failed on: whether a planted defect
    is caught, and caught only where it was planted."""
    by_target: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for case in json.loads(report.read_text())["cases"]:
        if case.get("categories"):
            by_target[case["target"]].update(["cases"] + list(case["categories"]))
    return "; ".join(f"{t}: {c.pop('cases')} cases (" + ", ".join(f"{k} {v}" for k, v in sorted(c.items())) + ")"
                     for t, c in sorted(by_target.items())) or "none"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", help="where to write the repository (default: a temporary directory)")
    parser.add_argument("--plant", action="store_true", help="also run the check with a planted defect")
    parser.add_argument("--keep", action="store_true", help="keep the repository")
    parser.add_argument("--top", type=int, default=8, help="rows per breakdown")
    args = parser.parse_args(argv)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="precision-model-repo-"))
    _write_repo(root)
    env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    env.pop("PLANT_SOFTMAX_IN_DTYPE", None)
    print(f"model repo at {root} (cores: {os.cpu_count()}, CI={env.get('CI', '')!r})")
    runs = [("update", ["--precision-update-baselines"], env), ("check", [], env)]
    if args.plant:
        runs.append(("planted", [], {**env, "PLANT_SOFTMAX_IN_DTYPE": "1"}))
    for label, extra, run_env in runs:
        wall, summary, junit, report = _run(root, extra, run_env, label)
        print(f"\n{label}: {wall:.1f} s wall ({summary})")
        print(f"  failed: {_failures(report)}")
        for what, counter in _where(junit, report).items():
            total = sum(counter.values())
            rows = ", ".join(f"{k} {v:.1f} s" for k, v in counter.most_common(args.top))
            print(f"  by {what} ({total:.1f} s in tests): {rows}")
    if not args.keep and args.workdir is None:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
