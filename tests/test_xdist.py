"""Under pytest-xdist, baselines written by two workers equal a serial run's, and the controller
prints one merged summary table."""
import json

import numpy as np
import pytest
from machine import NOT_KERNELS, ON_CPU

pytest_plugins = ["pytester"]
pytest.importorskip("xdist")


def _snapshot(root):
    files = {}
    for p in sorted(root.rglob("*")):
        if p.suffix == ".npz":
            with np.load(p, allow_pickle=False) as z:
                files[str(p.relative_to(root))] = {name: z[name].tobytes() for name in z.files}
        elif p.suffix == ".json":
            files[str(p.relative_to(root))] = json.loads(p.read_text())
        elif p.is_file():
            files[str(p.relative_to(root))] = "unexpected file"
    return files


@pytest.mark.slow(reason="two sessions of every kind (35 s); test_an_interrupted_parallel_update_lists_every_golden_it_"
                         "wrote runs a parallel update and checks what it wrote")
def test_parallel_update_writes_what_serial_writes(pytester):
    pytester.makeini("[pytest]\n")
    args = ("--precision-suite", "--precision-update-baselines", "--precision-configs=fp32,bf16", "-p", "no:cacheprovider",
            "--precision-no-speed",  # speed records hold timings, which differ run to run
            # the same cases on every machine; the norm and cross_entropy suites add time and nothing here.
            # Every kind and SDPA backend, two configs (fp8's goldens are written by the same code; CI's
            # time), but not every regime: one plain, the NaN and -inf rows
            # of the masked ones, the drawn one (no golden) and attention's padded one (its
            # key_padding_mask input); the other regimes write the same files the same way. Training:
            # fp32 and bf16; the spawned ranks' configs (DDP, FSDP2), fp8 and stochastic rounding write
            # their goldens through the same code (ranks spawned from xdist workers: the main job, under -n 2)
            *ON_CPU, "-k", f"{NOT_KERNELS} and not norm and not cross_entropy "
                           "and (unit or masked or hypothesis or causal-leftpad or train_step) "
                           "and not (train_step and (ddp or fsdp or fp8 or bf16-sr))")
    serial = pytester.runpytest_subprocess(*args, "--override-ini=precision_baseline_dir=serial")
    # softmax 2 targets x 2 configs x (unit, masked, fully-masked, hypothesis), attention 2 configs x
    # 2 backends x (unit, causal-leftpad), training fp32, bf16
    serial.assert_outcomes(passed=16 + 8 + 2)
    parallel = pytester.runpytest_subprocess(*args, "-n", "2", "--override-ini=precision_baseline_dir=parallel")
    parallel.assert_outcomes(passed=16 + 8 + 2)
    a, b = _snapshot(pytester.path / "serial"), _snapshot(pytester.path / "parallel")
    assert len(a) == 2 * 22  # the hypothesis regime keeps no golden  # one .npz and one .json per case, none lost
    assert a == b
    # one table from the controller, with every row
    out = parallel.stdout.str()
    assert out.count("precision summary (device cpu, budgets keyed cpu-") == 1
    assert out.count("| torch.softmax ") == 2 and out.count("| torch.log_softmax ") == 2
    assert out.count("| torch.sdpa ") == 4
    assert "precision baselines written: 22" in out
    assert out.count("precision training summary") == 1 and out.count("| tiny_gpt ") == 2


# a softmax that takes a moment per call, so a run can be interrupted halfway through its goldens
SLOW_SOFTMAX = """
import time
import torch
import pytest_precision


@pytest_precision.register("slow", kind="softmax")
def slow(x):
    time.sleep(0.05)
    xf = x.float()
    e = (xf - xf.amax(-1, keepdim=True)).exp()
    return (e / e.sum(-1, keepdim=True)).to(x.dtype)
"""


def test_an_interrupted_parallel_update_lists_every_golden_it_wrote(pytester):
    """Before, Ctrl-C once some goldens were written under -n 2 ended with no "precision baselines
    written" section (the workers never handed their records over); each golden now travels with its
    case's report, and the section lists every file written, as a serial run's does."""
    import signal
    import subprocess
    import sys
    import time

    pytester.makeini("[pytest]\n")
    pytester.makeconftest(SLOW_SOFTMAX)
    root = pytester.path / "precision_baselines"
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "--precision-suite", "--precision-update-baselines",
                             "--precision-no-speed", *ON_CPU, "-p", "no:cacheprovider", "-n", "2", "-k", "softmax"],
                            cwd=pytester.path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            # an xdist worker of this run ignores SIGINT, and a child inherits that: Ctrl-C as a user's
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(root.rglob("*.npz"))) < 4 and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    written = sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.npz"))
    assert len(written) >= 4, out[-3000:]
    assert "Interrupted" in out or "KeyboardInterrupt" in out, out[-3000:]
    heading = next((line for line in out.splitlines() if "precision baselines written:" in line), None)
    assert heading is not None, out[-3000:]
    listed = sorted({line.split(" [")[0] + "/" + line.split(" [")[1].split("]")[0] for line in out.splitlines()
                     if line.startswith("softmax/slow/") and (" new: " in line or " written; " in line)})
    assert listed == written, (written, listed)  # each golden on disk, once
    assert f"precision baselines written: {len(written)} " in heading
