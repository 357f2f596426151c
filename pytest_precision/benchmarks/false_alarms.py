"""How often the speed gate fails correct code, and how often it catches a slowdown, under load:
``python -m pytest_precision.benchmarks.false_alarms``.

It records the speed of a softmax target on this machine (serial, idle), then runs real pytest
sessions of the suite against those records and counts each case's speed verdict:

- correct code, serial, idle: every failure is a false alarm;
- correct code, serial, next to neighbours keeping 1, 2 and 3 cores busy (processes multiplying
  matrices, one core each; on a 2-core machine 2 and 3 oversubscribe it);
- correct code under ``pytest -n 2`` (the workers share the CPU with each other);
- the target planted 1.5 x slower (it computes its softmax three times where it did twice),
  serial, idle: every case that does not fail is a missed slowdown;
- planted 3 x slower, serial, idle, and next to one busy neighbour;
- planted 3 x slower under ``-n 2``: reported, never failed.

``--set gpu`` runs a GPU's pair instead (``.ci/gpu``): correct code five times over, timed against
its own records (every failure a false alarm), and the same target planted 1.2 x slower (six
softmaxes where the correct one computes five), serial; on CUDA the gate times with CUDA events.

Each scenario is one pytest session over the softmax suite's regimes in the configs given; it
prints a table of the counts. Speed figures depend on the machine: quote the rates with the
machine they were measured on. It takes a few minutes (``--configs fp32`` is faster).

Measured on the 2-core CI machine (``--rounds 3``, 99 case timings per scenario): 0 false alarms idle,
0 next to 1, 2 and 3 busy cores, 0 under ``-n 2``; 3 x planted on the idle machine (2.6 to 2.8 x in
the median case: the harness's own call overhead is not slowed) caught in 99 of 99; 1.5 x planted
(1.42 to 1.44 x measured) caught in 88 of 99, 27 to 33 of the 33 in every run; 3 x next to one busy
core caught in 84 of 99 (the rest noisy, or oversubscribed); 3 x under ``-n 2`` reported in 99 of 99
and failed in none. Judged on the calibrated ratio alone (an earlier gate) it gave 3 false alarms idle.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

TARGET = """
import os
import torch
import pytest_precision

# the planted slowdown: the same softmax computed REPEATS times (the correct target: twice)
REPEATS = int(os.environ.get("FALSE_ALARMS_REPEATS", "2"))


@pytest_precision.register("bench_softmax", kind="softmax")
def bench_softmax(x):
    for _ in range(REPEATS - 1):
        torch.softmax(x, -1)
    return torch.softmax(x, -1)
"""

NEIGHBOUR = """
import torch
torch.set_num_threads(1)
a = torch.randn(512, 512)
while True:
    a = torch.tanh(a @ a)
"""

# (name, repeats, load, expected): load is "idle", "busy<N>" (N neighbour processes, a core each)
# or "xdist" (-n 2)
SCENARIOS = [
    ("correct, idle, serial", 2, "idle", "pass"),
    ("correct, 1 busy core beside, serial", 2, "busy1", "pass"),
    ("correct, 2 busy cores beside, serial", 2, "busy2", "pass"),
    ("correct, 3 busy cores beside, serial", 2, "busy3", "pass"),
    ("correct, pytest -n 2", 2, "xdist", "pass"),
    ("1.5 x slower, idle, serial", 3, "idle", "fail"),
    ("3 x slower, idle, serial", 6, "idle", "fail"),
    ("3 x slower, 1 busy core beside, serial", 6, "busy1", "fail"),
    ("3 x slower, pytest -n 2", 6, "xdist", "report"),
]

# a GPU's pair: correct code (5 softmaxes) timed repeatedly, and a 1.2 x slowdown (6); its records
# are written with 5
GPU_SCENARIOS = [
    ("correct, idle, serial", 5, "idle", "pass"),
    ("correct again, idle, serial", 5, "idle", "pass"),
    ("1.2 x slower, idle, serial", 6, "idle", "fail"),
]
SETS = {"cpu": (SCENARIOS, 2), "gpu": (GPU_SCENARIOS, 5)}  # name -> (scenarios, the correct target's repeats)


@contextmanager
def _neighbours(load: str):
    count = int(load[len("busy"):]) if load.startswith("busy") else 0
    procs = [subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) for _ in range(count)]
    if procs:
        time.sleep(2.0)  # their load shows in the gate's one-second window
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _session(project: Path, configs: str, repeats: int, *extra: str) -> dict:
    report = project / f"report-{time.monotonic_ns()}.json"
    env = {**os.environ, "FALSE_ALARMS_REPEATS": str(repeats)}
    env.pop("CI", None)
    cmd = [sys.executable, "-m", "pytest", "--precision-suite", "-p", "no:cacheprovider", "-q", "-k", "softmax and not log_softmax",
           f"--precision-configs={configs}", f"--precision-report={report}", *extra]
    done = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
    if not report.exists():
        raise SystemExit(f"the pytest session wrote no report ({' '.join(cmd)}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(report.read_text())


def _speed_statuses(report: dict) -> list[tuple[str, float | None, str]]:
    return [(c["timing"]["speed_status"], c["timing"]["speed_ratio"], f"{c['config']}-{c['regime']}") for c in report["cases"]
            if c.get("timing") and c["timing"].get("speed_status")]


def run(configs: str, scenarios=SCENARIOS, correct_repeats: int = 2) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="false-alarms-") as tmp:
        project = Path(tmp)
        (project / "conftest.py").write_text(TARGET)
        (project / "pytest.ini").write_text("[pytest]\n")
        _session(project, configs, correct_repeats, "--precision-update-baselines")
        for name, repeats, load, expected in scenarios:
            extra = ("-n", "2") if load == "xdist" else ()
            started = time.monotonic()
            with _neighbours(load):
                statuses = _speed_statuses(_session(project, configs, repeats, *extra))
            count = {s: sum(1 for t, _, _ in statuses if t == s) for s in ("pass", "noisy", "shared", "slower")}
            ratios = sorted(r for _, r, _ in statuses if r is not None)
            # the cases whose verdict is not the scenario's: false alarms, or slowdowns missed
            wrong = [f"{case} {t} {r:.2f} x" for t, r, case in statuses
                     if (t == "slower") != (expected == "fail") and r is not None]
            rows.append({"scenario": name, "expected": expected, "timed": len(statuses), **count,
                         "median_ratio": ratios[len(ratios) // 2] if ratios else None, "wrong": wrong,
                         "seconds": time.monotonic() - started})
    return rows


def _rate(row: dict) -> str:
    n = row["timed"] or 1
    if row["expected"] == "pass":
        return f"false alarms {row['slower']}/{row['timed']} ({100 * row['slower'] / n:.1f} %)"
    if row["expected"] == "fail":
        return f"caught {row['slower']}/{row['timed']} ({100 * row['slower'] / n:.1f} %)"
    return f"reported {row['shared'] + row['noisy']}/{row['timed']}, failed {row['slower']}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pytest_precision.benchmarks.false_alarms", description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="fp32,bf16,fp16", help="configs of the softmax suite to time (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--rounds", type=int, default=1, help="run the scenarios this many times (default: %(default)s)")
    parser.add_argument("--only", metavar="TEXT", help="only the scenarios whose name contains TEXT")
    parser.add_argument("--set", choices=sorted(SETS), default="cpu",
                        help="the CPU's scenarios (loads, 1.5 x and 3 x slowdowns) or a GPU's pair (1.2 x; default: %(default)s)")
    args = parser.parse_args(argv)
    from tabulate import tabulate
    chosen, correct_repeats = SETS[args.set]
    scenarios = [s for s in chosen if not args.only or args.only in s[0]]
    rows = [row for _ in range(args.rounds) for row in run(args.configs, scenarios, correct_repeats)]
    print(tabulate([[r["scenario"], r["timed"], r["pass"], r["noisy"], r["shared"], r["slower"],
                     "-" if r["median_ratio"] is None else f"{r['median_ratio']:.2f}", _rate(r)] for r in rows],
                   headers=["scenario", "timed", "pass", "noisy", "shared", "failed", "median x", "verdict"], tablefmt="github"))
    for r in rows:
        if r["wrong"] and r["expected"] != "report":
            print(f"{r['scenario']}: {'failed' if r['expected'] == 'pass' else 'not failed'}: {', '.join(r['wrong'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
