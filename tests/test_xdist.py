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
