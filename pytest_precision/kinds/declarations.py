"""What a target may declare at registration (``register(name, fn, kind=..., **declared)``) that
every kind reads the same way: dtypes (``declared_dtypes``) and yes/no flags (``declared_flag``);
and a :class:`Declaration` a run found that a target needs (its cases' problems carry them, and the
summary gathers them into one block to paste).
Each kind lists its own keys in ``Kind.declarations`` and normalises them in
``Kind.normalise_declaration``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["declared_dtypes", "declared_flag", "Declaration", "NAME_LISTS", "spell"]

_DTYPE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
                "half": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp64": torch.float64,
                "float64": torch.float64}


def declared_dtypes(name: str, value: Any, key: str = "dtypes") -> tuple[torch.dtype, ...]:
    """A ``dtypes`` declaration (or ``key``'s) as torch dtypes (one dtype, or several; torch's or their names)."""
    items = value if isinstance(value, (list, tuple, set, frozenset)) else (value,)
    out = []
    for item in items:
        dtype = _DTYPE_NAMES.get(item.lower().removeprefix("torch.")) if isinstance(item, str) else item
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"target {name!r}: {key}={value!r}: {item!r} is not a dtype (torch.float16, 'fp16', "
                             f"'bf16', 'fp32')")
        out.append(dtype)
    if not out:
        raise ValueError(f"target {name!r}: {key}=() leaves nothing to run")
    return tuple(out)


def declared_flag(name: str, key: str, value: Any) -> bool:
    """A yes/no declaration (ini lines spell it true/false)."""
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.lower() in ("true", "yes", "1")
    if not isinstance(value, bool):
        raise ValueError(f"target {name!r}: {key}={value!r}: expected True or False")
    return value


# declarations whose values are input names: the ones found in several cases add up
NAME_LISTS = ("mutates", "aliases")


@dataclass(frozen=True)
class Declaration:
    """A declaration a run found that a target needs: ``key=value`` as ``register``'s keyword
    (what a case of it failed on is what the target does by design, or does not support). It
    travels in case records (``as_plain``, ``from_plain``) and is printed as Python and as an ini
    line's ``key=value``."""

    key: str
    value: Any

    def python(self) -> str:
        return f"{self.key}={spell(self.value)}"

    def ini(self) -> str:
        value = self.value
        if isinstance(value, (tuple, list)):
            text = ",".join(str(v) for v in value)
        elif isinstance(value, torch.dtype):
            text = str(value).removeprefix("torch.")
        elif value is None:
            text = "none"
        else:
            text = str(value).lower() if isinstance(value, bool) else str(value)
        return f"{self.key}={text}"

    def as_plain(self) -> list:
        """[key, value] in plain types (a dtype as its name, a tuple as a list)."""
        value = self.value
        if isinstance(value, torch.dtype):
            value = {"dtype": str(value).removeprefix("torch.")}
        elif isinstance(value, tuple):
            value = list(value)
        return [self.key, value]

    @classmethod
    def from_plain(cls, plain: list) -> "Declaration":
        key, value = plain
        if isinstance(value, dict) and "dtype" in value:
            value = getattr(torch, value["dtype"])
        elif isinstance(value, list):
            value = tuple(value)
        return cls(key, value)


def spell(value: Any) -> str:
    """``value`` as Python source (strings in double quotes, as a registration is written)."""
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, tuple):
        inner = ", ".join(spell(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return repr(value)  # True, None, ints, torch.float32
