"""Which machine a result came from, as far as its numerics are concerned.

Accepted error budgets are keyed by a *numerics key*: the device type plus what picks the kernels
that run. On the CPU that is ATen's vector ISA, because the SIMD width sets the reduction order:
measured with torch 2.13, fp32 ``torch.softmax`` on rows of 32768 logits is 72 ULP off on an
AVX512 machine, 113 on AVX2 and 111 with ``ATEN_CPU_CAPABILITY=default``, a spread wider than
the regression slack. On CUDA it is the compute capability (sm90 for H100 and H200), which picks
the SDPA and GEMM kernels.

Numpy's SIMD level and OpenBLAS's kernel set the order for Triton kernels under the interpreter (the
interpreted flash attention in fp32 at q scale 40 is 1.6e-6 or 4.9e-6 off by ``OPENBLAS_CORETYPE``).
The project's own goldens (``baselines/``) hold budgets for ``cpu-avx512``, ``cpu-avx2`` (recorded
on an AVX512 machine with ``ATEN_CPU_CAPABILITY=avx2 OPENBLAS_CORETYPE=Haswell
NPY_DISABLE_CPU_FEATURES=X86_V4,AVX512_ICL``) and ``cpu-default``.
"""
from __future__ import annotations

import os
import platform
import re

import torch

__all__ = ["numerics_key", "device_class", "machine_name", "fingerprint", "xdist_worker_device", "pin_xdist_worker",
           "interpret_requested"]


def numerics_key(device: str) -> str:
    """``cpu-avx2``, ``cpu-avx512``, ``cpu-default``, ``cuda-sm90``; the device type otherwise."""
    if device == "cpu":
        return f"cpu-{torch.backends.cpu.get_cpu_capability().lower()}"
    if device.startswith("cuda") and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda-sm{major}{minor}"
    return device


def device_class(key: str) -> str:
    """The device type a numerics key belongs to (``cpu-avx2`` -> ``cpu``)."""
    return key.split("-", 1)[0]


def machine_name(device: str) -> str:
    """A human-readable name stored beside the budgets: the GPU's name, else the CPU's."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return _cpu_model() or platform.processor() or platform.machine()


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def fingerprint(device: str) -> str:
    """What speed baselines are keyed by: the machine, the threads or GPU, and the software that
    sets the kernels. Timings from another fingerprint are never compared."""
    parts = [machine_name(device)]
    if device.startswith("cuda") and torch.cuda.is_available():
        parts.append(f"CUDA {torch.version.cuda}")
    else:
        parts += [numerics_key(device), "timed on 1 thread"]  # see timing.py
    parts.append(f"torch {torch.__version__}")
    return ", ".join(parts)


def xdist_worker_device(worker_id: str | None, device_count: int) -> int | None:
    """The CUDA device index pytest-xdist worker ``worker_id`` (``gw0``, ``gw1``, ...) runs on:
    worker N on device N mod ``device_count``, so N workers on N GPUs get one each and more workers
    share them evenly. None outside xdist (no worker id) or without a device."""
    if not worker_id or device_count < 1:
        return None
    match = re.fullmatch(r"gw(\d+)", worker_id)
    if match is None:
        raise ValueError(f"PYTEST_XDIST_WORKER={worker_id!r}: not an xdist worker id (gw0, gw1, ...)")
    return int(match.group(1)) % device_count


def pin_xdist_worker(device: str) -> int | None:
    """In an xdist worker running on CUDA, make its own GPU the current device (every "cuda"
    tensor, timing, memory figure and fingerprint then refers to it), before anything else touches
    CUDA; without it every worker queues on cuda:0 and the speed gate times the contention.
    Returns the device index, or None where nothing was pinned."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    index = xdist_worker_device(os.environ.get("PYTEST_XDIST_WORKER"), torch.cuda.device_count())
    if index is not None:
        torch.cuda.set_device(index)
    return index


def interpret_requested() -> bool:
    """Whether TRITON_INTERPRET is set in the environment, as triton reads it (Triton kernels then
    run on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
