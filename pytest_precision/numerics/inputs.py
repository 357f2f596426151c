"""Seeded random inputs with the same bits on every machine.

torch's float32 ``randn`` is not one stream across CPUs: ATen fills float32 tensors of 16 or more
elements with a vectorised Box-Muller whose results depend on the vector ISA (measured with torch
2.13: seed 123 gives different bits under ``ATEN_CPU_CAPABILITY=default`` and ``avx2``), so a
golden's input checksum would change with the CI runner. The float64 path is scalar on every ISA;
drawing there and rounding once to the target dtype gives the same tensor everywhere. Uniform
draws (``rand``, ``randint``, ``randperm``) were measured identical across ISAs and need no help,
and so were the elementwise ops a generator applies to them (exp, tanh, sin, GELU; AVX512, AVX2 and
the default ISA). ``portable_normal_draws`` makes a user's own ``torch.randn(..., generator=g)`` in
float32 draw that way (the op kind runs its input generators in it).
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["seeded_normal", "portable_normal_draws"]


def seeded_normal(generator: torch.Generator, *shape: int, scale: float = 1.0, shift: float = 0.0,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """N(shift, scale^2) samples from a CPU generator, computed in float64, rounded once to ``dtype``."""
    x = torch.randn(*shape, generator=generator, dtype=torch.float64)
    return (x * scale + shift).to(dtype)


_SHORT_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class _PortableNormals(TorchFunctionMode):
    """Normal draws in float32 or 16 bits made in float64 and rounded once, as ``seeded_normal``
    does: ``torch.randn``, ``randn_like``, ``normal`` with float arguments and ``Tensor.normal_``
    (``nn.init.normal_`` too). Everything else runs as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.randn or func is torch.normal and not any(isinstance(a, torch.Tensor) for a in args):
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            if dtype in _SHORT_FLOATS:
                grad = kwargs.pop("requires_grad", False)
                return func(*args, **{**kwargs, "dtype": torch.float64}).to(dtype).requires_grad_(grad)
        elif func is torch.randn_like:
            dtype = kwargs.get("dtype") or args[0].dtype
            if dtype in _SHORT_FLOATS:
                return func(*args, **{**kwargs, "dtype": torch.float64}).to(dtype)
        elif func is torch.Tensor.normal_ and args[0].dtype in _SHORT_FLOATS:
            wide = torch.empty(args[0].shape, dtype=torch.float64, device=args[0].device)
            with torch.no_grad():
                return args[0].copy_(wide.normal_(*args[1:], **kwargs))
        return func(*args, **kwargs)


def portable_normal_draws():
    """A context in which normal draws have the same bits on every CPU (see the module docstring):
    what a user's input generator draws with ``torch.randn(..., generator=g)`` in float32 then
    repeats on every machine, where torch's own float32 draw would not."""
    return _PortableNormals()
