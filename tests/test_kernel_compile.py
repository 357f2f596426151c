"""The kernels compiled for sm_80 (A100) and sm_90 (H100) on this GPU-less machine, through their real
launch wrappers (pytest_precision.kernels.compile_check): no compile error, shared memory within
each card's per-block limit, grids within CUDA's limits, no register spills. And the check itself
catches each of those defects when one is planted.

Triton fixes its mode when it is imported, and this test process's triton interprets (conftest.py),
so the check runs in a subprocess whose triton compiles. Compiled kernels stay in triton's cache
(~/.triton/cache, or TRITON_CACHE_DIR), so a second run of this file mostly re-reads them. The
quick set by default (the launches nearest each limit), the representative set with
PRECISION_SLOW=1, and every head dim, mask and mode with PRECISION_COMPILE_FULL=1."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

triton = pytest.importorskip("triton")

if not sys.platform.startswith("linux"):
    pytest.skip("triton's CUDA backend (and its ptxas) ships for Linux only", allow_module_level=True)
try:
    from triton.backends.nvidia.compiler import get_ptxas

    PTXAS = get_ptxas(90).path
except Exception as e:  # noqa: BLE001 - any failure to find ptxas is a reason to skip, with its text
    pytest.skip(f"triton's ptxas is not available here: {e}", allow_module_level=True)

KERNELS = {"softmax_forward_kernel", "softmax_backward_kernel", "attention_forward_kernel",
           "attention_backward_dkdv_kernel", "attention_backward_dq_kernel", "error_statistics_kernel"}


def _compile_env():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the subprocess must compile, not interpret
    return env


def _run(args, tmp_path, timeout=900):
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=_compile_env(), capture_output=True,
                          text=True, timeout=timeout)


# on 2 cores with a cold cache: quick about 50 s, representative about 2 minutes, full about 5 more
FULL = os.environ.get("PRECISION_COMPILE_FULL", "") not in ("", "0")
REPRESENTATIVE = os.environ.get("PRECISION_SLOW", "") not in ("", "0")
SCOPE = ["--full"] if FULL else [] if REPRESENTATIVE else ["--quick"]


def test_every_kernel_compiles_for_a100_and_h100(tmp_path):
    out = tmp_path / "compile.json"
    args = ["-m", "pytest_precision.kernels.compile_check", "--json", str(out), *SCOPE]
    r = _run(args, tmp_path, timeout=1800 if FULL else 900)
    results = json.loads(out.read_text()) if out.exists() else []
    problems = [f"sm_{x['arch']} {x['case']} {x['kernel']}: {'; '.join(x['problems'])}" for x in results if x["problems"]]
    assert r.returncode == 0 and not problems, "\n".join(problems) or (r.stdout + r.stderr)[-4000:]
    # the check cannot pass by compiling nothing: every kernel, for both targets
    for arch in (80, 90):
        assert {x["kernel"] for x in results if x["arch"] == arch} == KERNELS, arch
    assert all(x["shared"] > 0 and x["registers"] > 0 and x["spill_stores"] == 0 for x in results)
    # the grid of the case with more batch x heads than a grid's y dimension holds is one-dimensional
    big = [x for x in results if "B33000" in x["case"]]
    assert big and all(x["grid"][1] == x["grid"][2] == 1 and x["grid"][0] > 65535 for x in big)


PLANTED = textwrap.dedent('''
    import json, sys
    from pytest_precision.kernels import compile_check as cc

    def tiny_kernel_case(name, *, annotated=True, grid=(1,)):
        def run():
            import torch
            import triton.language as tl
            from pytest_precision.kernels.runtime import LazyKernel

            if annotated:
                def fill(x_ptr, BLOCK: tl.constexpr):
                    tl.store(x_ptr + tl.arange(0, BLOCK), tl.zeros([BLOCK], tl.float32))
            else:  # the defect that passed every interpreted test: no tl.constexpr annotation
                def fill(x_ptr, BLOCK):
                    tl.store(x_ptr + tl.arange(0, BLOCK), tl.zeros([BLOCK], tl.float32))
            LazyKernel(fill)[grid](torch.empty(64, device="meta"), BLOCK=64)
        return cc.Case(name, run)

    def spilling_statistics_case():
        def run():
            import torch
            from pytest_precision.kernels import error_stats

            x = torch.empty(2**20, dtype=torch.bfloat16, device="meta")
            # 8 elements per thread at 8 warps (19 live registers each, and their temporaries):
            # more than ptxas keeps in registers
            error_stats.launch_statistics(x, x, block=8 * 32 * 8, iters=16)
        return cc.Case("statistics, 8 elements per thread", run)

    def reduction_case(name):
        def run():
            import torch
            import triton.language as tl
            from pytest_precision.kernels.runtime import LazyKernel

            def total(x_ptr, BLOCK: tl.constexpr):  # 4 warps reduce through shared memory
                tl.store(x_ptr, tl.sum(tl.load(x_ptr + tl.arange(0, BLOCK)), 0))
            LazyKernel(total)[(1,)](torch.empty(1024, device="meta"), BLOCK=1024, num_warps=4)
        return cc.Case(name, run)

    cases = [tiny_kernel_case("correct"), reduction_case("correct reduction"),
             tiny_kernel_case("no constexpr", annotated=False), tiny_kernel_case("grid y 70000", grid=(1, 70000)),
             spilling_statistics_case()]
    results = cc.check(archs=(80,), selected=cases)
    # a card with 8 B of shared memory per block: the reduction's own use is over it
    cc.ARCHS[80] = cc.Arch(80, "a card with 8 B", 8)
    results += cc.check(archs=(80,), selected=[reduction_case("small card")])
    json.dump([[r.case, r.problems] for r in results], sys.stdout)
''')


def test_the_check_catches_each_planted_defect(tmp_path):
    script = tmp_path / "planted.py"
    script.write_text(PLANTED)
    r = _run([str(script)], tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    found = dict(json.loads(r.stdout.strip().splitlines()[-1]))
    assert found["correct"] == [] and found["correct reduction"] == []
    assert "arange's arguments must be of type tl.constexpr" in found["no constexpr"][0]
    assert found["no constexpr"][0].startswith("compile error: ")
    assert found["grid y 70000"] == ["grid dimension y = 70000 over CUDA's limit 65535"]
    (spill,) = found["statistics, 8 elements per thread"]
    assert spill.startswith("ptxas spills registers: ")
    (shared,) = found["small card"]
    assert shared.startswith("shared memory ") and "over the sm_80 per-block limit 8 B (a card with 8 B)" in shared


def test_the_check_refuses_a_process_whose_triton_interprets():
    from pytest_precision.kernels import compile_check
    from pytest_precision.kernels.runtime import compile_only, interpreting

    if not interpreting():
        pytest.skip("this process's triton compiles (a CUDA machine): nothing to refuse")
    with pytest.raises(RuntimeError, match="interpreter mode"):
        compile_check.check(archs=(80,), selected=[])
    with pytest.raises(RuntimeError, match="interpreter mode"):
        with compile_only():
            pass


def test_a_keyword_that_selects_nothing_fails_and_names_each_targets_cases(capsys):
    """A check that compiled nothing is not a pass (pytest's exit 5), and it says what each target
    has; a keyword that selects cases for some targets compiles those and names the others
    (test_every_kernel_compiles_for_a100_and_h100 runs the compiling path)."""
    from pytest_precision.kernels import compile_check

    assert compile_check.main(["--quick", "--arch", "80,90", "-k", "no such kernel"]) == 5
    err = capsys.readouterr().err
    assert "-k 'no such kernel' selects no case for sm_80; its cases: attention bfloat16 B1 H2 S128x128 D128" in err
    assert "selects no case for sm_90; its cases: " in err and " more" in err  # 16 cases, 8 named
    # sm_80's quick set has no causal attention: named, and sm_90's causal cases go on to compile
    # (here they reach the check that refuses this interpreting process)
    from pytest_precision.kernels.runtime import interpreting

    if interpreting():
        with pytest.raises(RuntimeError, match="interpreter mode"):
            compile_check.main(["--quick", "--arch", "80,90", "-k", "causal"])
        err = capsys.readouterr().err
        assert "-k 'causal' selects no case for sm_80" in err and "sm_90" not in err
