"""Which machine a result came from, as far as its numerics are concerned.

Accepted error budgets are keyed by a *numerics key*: the device type plus what picks the kernels
that run. On the CPU that is ATen's vector ISA, because the SIMD width sets the reduction order:
measured with torch 2.13, fp32 ``torch.softmax`` on rows of 32768 logits is 72 ULP off on an
AVX512 machine, 113 on AVX2 and 111 with ``ATEN_CPU_CAPABILITY=default``, a spread wider than
the regression slack. On CUDA it is the compute capability (sm90 for H100 and H200), which picks
the SDPA and GEMM kernels.
"""
from __future__ import annotations

import platform

import torch

__all__ = ["numerics_key", "device_class", "machine_name", "fingerprint"]


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
