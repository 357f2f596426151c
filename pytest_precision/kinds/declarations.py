"""What a target may declare at registration (``register(name, fn, kind=..., **declared)``) that
every kind reads the same way: dtypes (``declared_dtypes``) and yes/no flags (``declared_flag``).
Each kind lists its own keys in ``Kind.declarations`` and normalises them in
``Kind.normalise_declaration``."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["declared_dtypes", "declared_flag"]

_DTYPE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
                "half": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp64": torch.float64,
                "float64": torch.float64}


def declared_dtypes(name: str, value: Any) -> tuple[torch.dtype, ...]:
    """A ``dtypes`` declaration as torch dtypes (one dtype, or several; torch's or their names)."""
    items = value if isinstance(value, (list, tuple, set, frozenset)) else (value,)
    out = []
    for item in items:
        dtype = _DTYPE_NAMES.get(item.lower().removeprefix("torch.")) if isinstance(item, str) else item
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"target {name!r}: dtypes={value!r}: {item!r} is not a dtype (torch.float16, 'fp16', "
                             f"'bf16', 'fp32')")
        out.append(dtype)
    if not out:
        raise ValueError(f"target {name!r}: dtypes=() leaves nothing to run")
    return tuple(out)


def declared_flag(name: str, key: str, value: Any) -> bool:
    """A yes/no declaration (ini lines spell it true/false)."""
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.lower() in ("true", "yes", "1")
    if not isinstance(value, bool):
        raise ValueError(f"target {name!r}: {key}={value!r}: expected True or False")
    return value
