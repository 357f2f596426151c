"""Compile every kernel for NVIDIA GPUs on a machine without one: ``python -m pytest_precision.kernels.compile_check``.

Triton's interpreter, which runs the kernels on a CPU, needs no ``tl.constexpr`` annotations,
knows no shared-memory limit and computes ``tl.exp`` and ``/`` exactly, so kernels that pass every
interpreted test can still fail to compile, or fail to launch, on a GPU. This check compiles them
for real targets instead:

- a stand-in triton driver whose current target is ``GPUTarget("cuda", 80 or 90, 32)`` (A100,
  H100), so the CUDA backend compiles for it down to a cubin with the ``ptxas`` triton ships;
- the kernels' own launch wrappers (``softmax_with_lse`` forward and backward,
  ``flash_attention_with_lse`` forward and backward, ``error_stats.launch_statistics``), called on tensors on
  torch's ``meta`` device under ``runtime.compile_only()``, so every launch compiles with the
  arguments, constexprs, warps and stages the wrapper really passes, and nothing runs;
- for each launch: a compile error; shared memory (``metadata.shared``) over the target's
  per-block limit (232448 B on sm_90, 166912 B on sm_80); a grid dimension over CUDA's limits
  (2^31 - 1 on x, 65535 on y and z); spill stores reported by ``ptxas -v``.

The shapes are those of the suites, the kernel tests and ``kernels.bench``: by default a
representative set (every kernel, every dtype, the head dims 16, 64 and 128, the softmax block
sizes of one-block and online rows), ``--full`` adds the rest (head dims 32 and 256, masks and
grouped heads in every dtype, both log modes everywhere), and ``--quick`` keeps of it the launches
nearest each limit (for sm_90 every kernel; the largest tiles of bf16, IEEE fp32 and TF32; bf16
with masks and grouped heads; every softmax block size in bf16, the largest in fp32; the statistics
of fp32, bf16 and fp8 e4m3; for sm_80, whose shared memory per block is smaller, each kernel once,
attention in the tiles that use the most, the one-block softmax), under half its time. Compiled kernels land in triton's cache
(``TRITON_CACHE_DIR``, default ``~/.triton/cache``), and the ``ptxas -v`` figures beside it, so a
second run mostly re-reads them.

It must run in a process whose triton was not imported in interpreter mode (triton fixes its mode
at import): this module refuses otherwise; tests run it in a subprocess.

Measured on a 2-core CPU with triton's compile cache cold: the quick set (48 launches) about 50 s, the
representative set (126 launches) 124 s, warm about 10 s; the full set (348 launches) about 5
minutes more. ``tests/test_kernel_compile.py`` compiles the quick set, the representative one with
``PRECISION_SLOW=1``, the full one with ``PRECISION_COMPILE_FULL=1``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

__all__ = ["ARCHS", "GRID_LIMITS", "Arch", "Case", "Result", "cases", "check", "main"]


@dataclass(frozen=True)
class Arch:
    capability: int  # 80, 90
    card: str
    shared_limit: int  # bytes of shared memory one block may use (the opt-in maximum)


ARCHS = {80: Arch(80, "A100", 166912), 90: Arch(90, "H100", 232448)}
GRID_LIMITS = (2**31 - 1, 65535, 65535)


@dataclass
class Case:
    """One call of a launch wrapper: ``run()`` makes meta tensors and calls it."""

    name: str
    run: object  # () -> None


@dataclass
class Result:
    """One compiled launch (or the compile error of a case) on one target."""

    arch: int
    case: str
    kernel: str = ""
    launch: str = ""  # the constexprs and options the wrapper passed
    grid: list = field(default_factory=list)
    shared: int = 0
    registers: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    seconds: float = 0.0
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


# ---------------------------------------------------------------- the stand-in driver

def _stand_in_driver(capability: int):
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class StandInDriver(DriverBase):
        """A CUDA device of the given compute capability that exists only to compile for: each
        capability is its own device id, so triton keeps one compiled-kernel cache per target."""

        @classmethod
        def is_active(cls):
            return False  # never picked by triton on its own

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError("the stand-in driver compiles; it launches nothing")

        def get_current_target(self):
            return GPUTarget("cuda", capability, 32)

        def get_current_device(self):
            return capability

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("meta")

        def get_benchmarker(self):
            raise NotImplementedError("the stand-in driver compiles; it times nothing")

    return StandInDriver()


# ---------------------------------------------------------------- cases: the wrappers on meta tensors

def _softmax_case(dtype, rows, cols, log):
    def run():
        import torch

        from pytest_precision.kernels.softmax import softmax_with_lse

        x = torch.empty(rows, cols, dtype=dtype, device="meta", requires_grad=True)
        y, _ = softmax_with_lse(x, log=log)
        y.backward(torch.empty_like(y))
    return Case(f"softmax{' log' if log else ''} {_name(dtype)} {rows}x{cols}", run)


def _attention_case(dtype, B, H, H_kv, S_q, S_k, D, *, causal=False, pad=False, tf32=False):
    def run():
        import contextlib

        import torch

        from pytest_precision.kernels.flash_attention import flash_attention_with_lse
        from pytest_precision.numerics.configs import tf32_flags

        q = torch.empty(B, H, S_q, D, dtype=dtype, device="meta", requires_grad=True)
        k, v = (torch.empty(B, H_kv, S_k, D, dtype=dtype, device="meta", requires_grad=True) for _ in range(2))
        mask = torch.empty(B, S_k, dtype=torch.bool, device="meta") if pad else None
        with tf32_flags(True) if tf32 else contextlib.nullcontext():
            out, _ = flash_attention_with_lse(q, k, v, causal, mask)
            out.backward(torch.empty_like(out))
    extra = "".join((" causal" if causal else "", " padded" if pad else "", f" gqa{H // H_kv}" if H != H_kv else ""))
    return Case(f"attention {_name(dtype)}{'+tf32' if tf32 else ''} B{B} H{H} S{S_q}x{S_k} D{D}{extra}", run)


def _statistics_case(dtype, n, *, ref_dtype=None, log_domain=False):
    def run():
        import torch

        from pytest_precision.kernels.error_stats import launch_statistics

        out = torch.empty(n, dtype=dtype, device="meta")
        ref = torch.empty(n, dtype=ref_dtype or torch.float64, device="meta")
        launch_statistics(out, ref, dtype, log_domain=log_domain)
    ref = _name(ref_dtype) if ref_dtype is not None else "float64"
    return Case(f"error statistics {_name(dtype)} vs {ref} n={n}{' log' if log_domain else ''}", run)


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cases(full: bool = False, quick: bool = False, arch: int = 90) -> list[Case]:
    """The launches to compile for sm_``arch``: the shapes of the suites, tests and benchmark (module
    doc); ``quick``: of those, the ones nearest each limit (below)."""
    import torch

    if full and quick:
        raise ValueError("compile_check.cases: full and quick exclude each other")
    f16, b16, f32 = torch.float16, torch.bfloat16, torch.float32
    if quick and arch != 90:
        # quick, for a target other than sm_90: each kernel once, attention in the tiles that use
        # the most shared memory, whose per-block limit is smaller there (166912 B on sm_80 against
        # 232448 B; TF32 and IEEE fp32 at D128 use 98304 B, bf16 51200 B), and the one-block softmax
        # (a whole row of 8192 in registers: where a spill would show). Masked attention and the
        # other tiles compile for sm_80 in the representative set (PRECISION_SLOW=1 in the tests)
        return [_softmax_case(b16, 16, 32768, True), _softmax_case(b16, 16, 8192, False), _statistics_case(f32, 2**28),
                *(_attention_case(dtype, 1, 2, 2, 128, 128, 128, tf32=tf32)
                  for dtype, tf32 in ((b16, False), (f32, False), (f32, True)))]
    out = []
    # softmax: the suites' rows of 256 and 32768 (online, in blocks of 8192), the benchmark's 8192 (one block)
    for dtype in (f16, b16, f32):
        for cols in (256, 8192, 32768):
            for log in ((False, True) if full or cols == 32768 else (False,)):
                if quick and not (dtype == b16 or (dtype == f32 and cols == 32768)):
                    continue  # quick: every block size in bf16, the largest blocks in fp32
                out.append(_softmax_case(dtype, 16, cols, log))
    if full:
        out += [_softmax_case(f32, 16, 1, False), _softmax_case(f32, 8, 1000, True)]
    # attention: head dims of the suites (16, 59 -> 64), the tests (64, 128) and the benchmark (128).
    # Representative: every tile of bf16 (fp16 compiles the same code), the two largest of IEEE fp32
    # (the most registers), TF32 and fp16 at 128; masks and grouped heads at 64. Quick: the largest
    # tile of bf16, IEEE fp32 and TF32 (the most shared memory and registers), bf16 at 64 with masks.
    if full:
        modes = [(dtype, tf32, D) for dtype, tf32 in ((f16, False), (b16, False), (f32, False), (f32, True))
                 for D in (16, 32, 64, 128, 256)]
    elif quick:
        modes = [(b16, False, 64), (b16, False, 128), (f32, False, 128), (f32, True, 128)]
    else:
        modes = [(b16, False, 16), (b16, False, 64), (b16, False, 128), (f16, False, 128), (f32, False, 64),
                 (f32, False, 128), (f32, True, 128)]
    for dtype, tf32, D in modes:
        out.append(_attention_case(dtype, 1, 2, 2, 128, 128, D, tf32=tf32))
        if full or D == 64:
            out.append(_attention_case(dtype, 2, 4, 2, 113, 203, D, causal=True, pad=True, tf32=tf32))
    # the benchmark's shape (not quick: bf16 D128's kernels at other sizes); and more batch x heads
    # than a grid's y or z dimension holds (shaped as the bf16 D64 case above in all but the batch,
    # so it compiles nothing new)
    if not quick:
        out.append(_attention_case(b16, 4, 16, 16, 4096, 4096, 128))
    out.append(_attention_case(b16, 33000, 2, 2, 128, 128, 64))
    # error statistics: every ULP dtype against a float64 oracle, a float32 golden, log-domain outputs
    # (quick: fp32, bf16 and one fp8 format)
    for dtype in (f32, f16, b16, torch.float8_e4m3fn, torch.float8_e5m2):
        if not (quick and dtype in (f16, torch.float8_e5m2)):
            out.append(_statistics_case(dtype, 2**28))
    out.append(_statistics_case(f32, 2**20, ref_dtype=f32, log_domain=True))
    if full:
        out.append(_statistics_case(b16, 2**20, ref_dtype=f32))
        out.append(_statistics_case(f16, 2**20, log_domain=True))
    return out


# ---------------------------------------------------------------- compiling and judging

_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


def _ptxas_report(compiled, capability: int) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from ``ptxas -v`` on the kernel's PTX, with
    the options triton's own ptxas run had (triton keeps the PTX, not that run's log). Kept beside
    triton's cache, by the kernel's hash, so a warm run does not run ptxas again."""
    from triton import knobs
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    ptxas = get_ptxas(capability).path
    fmad = [] if getattr(compiled.metadata, "enable_fp_fusion", True) else ["--fmad=false"]
    cache = os.path.join(knobs.cache.dir, "pytest-precision-ptxas", f"{compiled.hash}-sm{capability}.json")
    try:
        with open(cache, encoding="utf-8") as f:
            saved = json.load(f)
        if saved.get("ptxas") == ptxas:
            return saved["registers"], saved["spill_stores"], saved["spill_loads"]
    except (OSError, ValueError, KeyError):
        pass
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        cmd = [ptxas, "-v", *fmad, "--regAllocOptLevel=2", f"--gpu-name={sm_arch_from_capability(capability)}",
               ptx, "-o", os.path.join(tmp, "kernel.cubin")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = _REGISTERS.search(log)
    spills = _SPILLS.search(log)
    if regs is None or spills is None:
        raise RuntimeError(f"ptxas -v printed no register or spill line:\n{log}")
    report = (int(regs.group(1)), int(spills.group(2)), int(spills.group(3)))
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        with open(cache + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"ptxas": ptxas, "registers": report[0], "spill_stores": report[1], "spill_loads": report[2]}, f)
        os.replace(cache + ".tmp", cache)
    except OSError:
        pass  # a read-only cache: the next run asks ptxas again
    return report


def _launch_text(options: dict) -> str:
    """What sets a launch's resources: its tiles, steps, warps and stages."""
    return " ".join(f"{k}={v}" for k, v in sorted(options.items())
                    if k.startswith(("BLOCK", "num_")) or k == "ITERS")


def _judge(r: Result, arch: Arch) -> None:
    if r.shared > arch.shared_limit:
        r.problems.append(f"shared memory {r.shared} B over the sm_{arch.capability} per-block limit "
                          f"{arch.shared_limit} B ({arch.card})")
    for axis, (n, limit) in enumerate(zip(r.grid, GRID_LIMITS)):
        if n > limit:
            r.problems.append(f"grid dimension {'xyz'[axis]} = {n} over CUDA's limit {limit}")
    if r.spill_stores > 0:
        r.problems.append(f"ptxas spills registers: {r.spill_stores} B of spill stores, {r.spill_loads} B of "
                          f"spill loads per thread ({r.registers} registers)")


def compile_case(case: Case, arch: Arch) -> list[Result]:
    """Compile ``case`` for ``arch``: one Result per launch, or one carrying the compile error."""
    from triton.runtime.driver import driver

    from pytest_precision.kernels.runtime import compile_only

    driver.set_active(_stand_in_driver(arch.capability))  # this process compiles only, so it stays
    start = time.perf_counter()
    try:
        with compile_only() as launches:
            case.run()
    except Exception as e:  # noqa: BLE001 - a compile error of any kind is the finding
        text = f"{type(e).__name__}: {e}".strip()
        lines = [ln for ln in text.splitlines() if ln.strip()]
        return [Result(arch.capability, case.name, seconds=time.perf_counter() - start,
                       problems=["compile error: " + " | ".join(lines[:12])])]
    out = []
    for launch in launches:
        grid = [int(g) for g in launch.grid] + [1] * (3 - len(launch.grid))
        r = Result(arch.capability, case.name, launch.kernel.lstrip("_"), _launch_text(launch.options), grid,
                   int(launch.compiled.metadata.shared))
        r.registers, r.spill_stores, r.spill_loads = _ptxas_report(launch.compiled, arch.capability)
        out.append(r)
    if out:
        out[0].seconds = time.perf_counter() - start
    return out


def check(archs=(80, 90), full: bool = False, selected: list[Case] | None = None, quick: bool = False) -> list[Result]:
    """Compile every case for every arch; a Result per launch (module doc)."""
    if "triton" in sys.modules:
        from pytest_precision.kernels.runtime import interpreting

        if interpreting():
            raise RuntimeError("compile_check: triton was imported in interpreter mode in this process; run "
                               "python -m pytest_precision.kernels.compile_check in a process without TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"  # before triton is imported: compile, do not interpret
    results = []
    for capability in archs:
        arch = ARCHS[capability]
        for case in (selected if selected is not None else cases(full, quick, capability)):
            rs = compile_case(case, arch)
            for r in rs:
                _judge(r, arch)
            results.extend(rs)
    return results


def table(results: list[Result]) -> str:
    from tabulate import tabulate

    rows = [(f"sm_{r.arch}", r.case, r.kernel, r.launch, "x".join(map(str, r.grid)), r.shared,
             r.registers if r.registers >= 0 else "-", r.spill_stores if r.spill_stores >= 0 else "-",
             "ok" if r.ok else "; ".join(r.problems)) for r in results]
    return tabulate(rows, headers=("target", "case", "kernel", "launch", "grid", "shared B", "regs", "spill B",
                                   "verdict"), tablefmt="plain")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pytest_precision.kernels.compile_check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="80,90", help="compute capabilities, comma-separated (default: 80,90)")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--full", action="store_true", help="every head dim, mask and mode, not a representative set")
    scope.add_argument("--quick", action="store_true", help="of the representative set, the launches nearest each "
                       "limit: every kernel, the largest tiles of bf16, fp32 and TF32, masks")
    parser.add_argument("-k", dest="keyword", default=None, help="only cases whose name contains this text")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the results as JSON")
    args = parser.parse_args(argv)
    try:
        archs = tuple(int(a) for a in args.arch.split(","))
    except ValueError:
        parser.error(f"--arch={args.arch}: give compute capabilities such as 80,90")
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        parser.error(f"--arch: no per-block shared-memory limit known for {unknown}; known: {sorted(ARCHS)}")
    start = time.perf_counter()
    if args.keyword is None:
        results = check(archs, args.full, None, args.quick)
    else:  # the cases whose name holds the keyword, per target
        every = {a: cases(args.full, args.quick, a) for a in archs}
        chosen = {a: [c for c in every[a] if args.keyword in c.name] for a in archs}
        for a in archs:  # a target the keyword selects nothing of is named, with what it has
            if not chosen[a]:
                names = sorted({c.name for c in every[a]})
                shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
                print(f"compile_check: -k {args.keyword!r} selects no case for sm_{a}; its cases: {shown}",
                      file=sys.stderr)
        if not any(chosen.values()):  # a check that compiled nothing is not a pass (pytest's exit 5: none collected)
            return 5
        results = [r for a in archs for r in check((a,), args.full, chosen[a])]
    selected = {r.case for r in results}
    print(table(results))
    bad = [r for r in results if not r.ok]
    print(f"{len(results)} launches of {len(selected)} cases compiled for {', '.join(f'sm_{a}' for a in archs)} "
          f"in {time.perf_counter() - start:.1f} s: {len(bad)} with problems")
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
