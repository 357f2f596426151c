"""Seeded random inputs with the same bits on every machine.

torch's float32 ``randn`` is not one stream across CPUs: ATen fills float32 tensors of 16 or more
elements with a vectorised Box-Muller whose results depend on the vector ISA (measured with torch
2.13: seed 123 gives different bits under ``ATEN_CPU_CAPABILITY=default`` and ``avx2``), so a
golden's input checksum would change with the CI runner. The float64 path is scalar on every ISA;
drawing there and rounding once to the target dtype gives the same tensor everywhere. Uniform
draws (``rand``, ``randint``, ``randperm``) were measured identical across ISAs and need no help.
"""
from __future__ import annotations

import torch

__all__ = ["seeded_normal"]


def seeded_normal(generator: torch.Generator, *shape: int, scale: float = 1.0, shift: float = 0.0,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """N(shift, scale^2) samples from a CPU generator, computed in float64, rounded once to ``dtype``."""
    x = torch.randn(*shape, generator=generator, dtype=torch.float64)
    return (x * scale + shift).to(dtype)
