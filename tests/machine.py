"""The machine the tests run on, for the tests whose outcomes depend on it.

The test suite passes on a CPU machine and on a CUDA machine. A test about the harness's logic
pins its pytest sessions to the CPU (``ON_CPU``), where the outcome is the same on every machine;
a test about what a device runs (TF32, the device option, the configs a machine skips) branches
on ``DEVICE`` or counts with ``configs_run``. ``NOT_KERNELS`` deselects the Triton kernel targets
that the suites list by default on a CUDA machine (on a CPU machine without TRITON_INTERPRET they
are not listed, so it deselects nothing there)."""
import torch

from pytest_precision.numerics.configs import CONFIGS

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
ON_CPU = ("--precision-device=cpu",)
NOT_KERNELS = "not triton"


def configs_run(device: str = DEVICE, ids=tuple(CONFIGS)) -> list[str]:
    """The configs of ``ids`` that ``device`` runs (the others its cases skip, with the reason)."""
    return [c for c in ids if CONFIGS[c].skip_reason(device) is None]
