"""Kernel benchmark: ``python -m pytest_precision.kernels.bench`` (a script, not a timed test).

On CUDA, with CUDA events, an L2 flush (256 MB zeroed) before every run, medians of many runs:

- softmax GB/s (bytes read + written), its ratio to ``torch.softmax`` and to a device-to-device
  copy of the same tensor; targets on an H100: bf16 8192x8192 and 4096x32768 at >= 85 % of the
  copy's bandwidth and >= 1.0x torch.softmax;
- flash attention forward TFLOP/s (4 B H S^2 D), ratio to SDPA's flash backend; target on an H100:
  B4 H16 S4096 D128 bf16 >= 0.8x;
- error statistics GB/s (both inputs read), ratio to the copy and to the separate torch ops of
  ``error_statistics_torch``; target on an H100: two 2^28-element bf16 tensors at >= 80 % of the
  copy and >= 5x the torch ops.

Without CUDA it runs the same measurements on small shapes under Triton's interpreter with
``perf_counter``, and says so: those figures time Python interpreting the kernels, not a GPU.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __name__ == "__main__" and "triton" not in sys.modules:
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        import torch as _torch

        if not _torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (runtime.py)

import torch


class Timer:
    """Median seconds of ``fn()``: CUDA events with an L2 flush on CUDA, perf_counter on the CPU."""

    def __init__(self, cuda: bool, reps: int):
        self.cuda, self.reps = cuda, reps
        self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda") if cuda else None

    def __call__(self, fn) -> float:
        fn()  # warm-up: compiles the kernel
        times = []
        for _ in range(self.reps):
            if self.cuda:
                self.flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return statistics.median(times)


def _verdict(value: float, target: float, cuda: bool) -> str:
    if not cuda:
        return "(no target on the CPU)"
    return f"(target >= {target:g}: {'met' if value >= target else 'NOT met'})"


def bench_softmax(timer: Timer, shapes, dtype, device):
    from pytest_precision.kernels.softmax import softmax_forward

    for rows, cols in shapes:
        x = torch.randn(rows, cols, device=device, dtype=torch.float32).to(dtype)
        dst = torch.empty_like(x)
        moved = 2 * x.numel() * x.element_size()
        t_kernel = timer(lambda: softmax_forward(x))
        t_torch = timer(lambda: torch.softmax(x, -1))
        t_copy = timer(lambda: dst.copy_(x))
        gbs = moved / t_kernel / 1e9
        print(f"softmax {str(dtype).removeprefix('torch.')} {rows}x{cols}: {gbs:.3g} GB/s; "
              f"{t_copy / t_kernel:.3g} of copy {_verdict(t_copy / t_kernel, 0.85, timer.cuda)}; "
              f"{t_torch / t_kernel:.3g}x torch.softmax {_verdict(t_torch / t_kernel, 1.0, timer.cuda)}")


def bench_attention(timer: Timer, B, H, S, D, dtype, device):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pytest_precision.kernels.flash_attention import flash_attention_with_lse

    q, k, v = (torch.randn(B, H, S, D, device=device, dtype=dtype) for _ in range(3))
    flops = 4 * B * H * S * S * D
    t_kernel = timer(lambda: flash_attention_with_lse(q, k, v))
    line = f"attention fwd {str(dtype).removeprefix('torch.')} B{B} H{H} S{S} D{D}: {flops / t_kernel / 1e12:.3g} TFLOP/s"
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            t_sdpa = timer(lambda: F.scaled_dot_product_attention(q, k, v))
        line += f"; {t_sdpa / t_kernel:.3g}x SDPA flash {_verdict(t_sdpa / t_kernel, 0.8, timer.cuda)}"
    except RuntimeError as e:
        line += f"; SDPA flash backend unavailable here ({str(e).splitlines()[0]})"
    print(line)


def bench_error_statistics(timer: Timer, n, dtype, device, layouts=()):
    """The kernel at its default layout, then at each (block, iters) of ``layouts`` (block: elements
    per loop step of a program, iters: steps per program), to choose the default on a new GPU."""
    from pytest_precision.kernels.error_stats import error_statistics, error_statistics_torch

    ref = torch.randn(n, device=device, dtype=torch.float32).to(dtype)
    out = (ref.float() * (1 + 1e-3 * torch.randn(n, device=device))).to(dtype)
    dst = torch.empty_like(ref)
    moved = 2 * n * ref.element_size()  # both read; the copy moves the same bytes (read + write)
    t_copy = timer(lambda: dst.copy_(ref))
    t_torch = timer(lambda: error_statistics_torch(out, ref, dtype))
    name = f"error statistics {str(dtype).removeprefix('torch.')} 2 x {n}"
    for block, iters in ((None, None), *layouts):
        t_kernel = timer(lambda: error_statistics(out, ref, dtype, block=block, iters=iters))
        layout = "" if block is None else f" (block {block}, iters {iters})"
        print(f"{name}{layout}: {moved / t_kernel / 1e9:.3g} GB/s; "
              f"{t_copy / t_kernel:.3g} of copy {_verdict(t_copy / t_kernel, 0.8, timer.cuda)}; "
              f"{t_torch / t_kernel:.3g}x separate torch ops {_verdict(t_torch / t_kernel, 5.0, timer.cuda)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=None, help="timed runs per figure (median)")
    parser.add_argument("--statistics-layouts", default="", metavar="BLOCKxITERS,...",
                        help="also time the error statistics kernel at these layouts, e.g. 512x16,1024x8,256x31")
    args = parser.parse_args(argv)
    try:
        layouts = [tuple(int(v) for v in item.split("x")) for item in args.statistics_layouts.split(",") if item]
        if any(len(t) != 2 for t in layouts):
            raise ValueError
    except ValueError:
        parser.error(f"--statistics-layouts={args.statistics_layouts}: give BLOCKxITERS pairs such as 512x16,1024x8")
    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    if cuda:
        device = "cuda"
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; CUDA events, L2 flushed, medians")
        timer = Timer(True, args.reps or 50)
        bench_softmax(timer, [(8192, 8192), (4096, 32768)], torch.bfloat16, device)
        bench_attention(timer, 4, 16, 4096, 128, torch.bfloat16, device)
        bench_error_statistics(timer, 2**28, torch.bfloat16, device, layouts)
    else:
        from pytest_precision.kernels.runtime import interpreting

        device = "cpu"
        print("NO CUDA DEVICE: these are NOT GPU figures. The kernels run under Triton's interpreter "
              f"(interpreting: {interpreting()}) on small shapes, timed with perf_counter; they measure "
              "Python interpreting the kernels and say nothing about the targets, which are for an H100.")
        timer = Timer(False, args.reps or 3)
        bench_softmax(timer, [(64, 1024), (8, 8192)], torch.bfloat16, device)
        bench_attention(timer, 1, 2, 64, 64, torch.bfloat16, device)
        bench_error_statistics(timer, 2**16, torch.bfloat16, device, layouts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
