"""One regime's inputs of an op target as the target is called with them (the op kind's
``OpCall``): what a generator returned, normalised to named slots, and the floating tensors a
config rounds; and the words for what a call returned wrong (one tensor expected, values lost)."""
from __future__ import annotations

from typing import Any

import torch

from pytest_precision.kinds import Target, TargetError

__all__ = ["OpCall", "batch_dims", "lost_where_finite", "one_tensor_rule", "dtypes_of"]


class OpCall:
    """One regime's inputs as the target is called with them: the slots (name, value) in call
    order, positional or keyword, and the floating tensors among them by name."""

    def __init__(self, target: Target, raw: Any, where: str):
        self.target = target
        self.keyword = isinstance(raw, dict)
        if self.keyword:
            items = list(raw.items())
        elif isinstance(raw, (tuple, list)):
            items = [(f"arg{i}", v) for i, v in enumerate(raw)]
        elif isinstance(raw, torch.Tensor):
            items = [("arg0", raw)]
        else:
            raise TargetError(f"{where}: the generator returned {type(raw).__name__}; expected a tensor, a tuple of "
                              "positional arguments or a dict of keyword arguments")
        self.slots = [(str(n), v.detach() if isinstance(v, torch.Tensor) else v) for n, v in items]
        self.floating = {n: v for n, v in self.slots if isinstance(v, torch.Tensor) and v.is_floating_point()}
        if not self.floating:
            raise TargetError(f"{where}: no floating tensor among the inputs ({', '.join(n for n, _ in self.slots)}): "
                              "nothing for a config to round")
        # the reference's output shape, once it ran (a fact of these inputs, whatever the case)
        self.shape: tuple | None = None

    def arguments(self, values: dict[str, torch.Tensor], device: str) -> tuple[tuple, dict]:
        """The call's arguments: ``values`` for the floating inputs, the rest on ``device``."""
        def value(name, v):
            if name in values:
                return values[name]
            return v.to(device) if isinstance(v, torch.Tensor) else v
        filled = [(n, value(n, v)) for n, v in self.slots]
        return ((), dict(filled)) if self.keyword else (tuple(v for _, v in filled), {})

    def others(self) -> dict[str, torch.Tensor]:
        """The tensors among the inputs that are not floating (positions, masks), by name."""
        return {n: v for n, v in self.slots if isinstance(v, torch.Tensor) and n not in self.floating}

    def batch(self, dims: dict[str, int], where: str) -> int | None:
        """The batch size along the declared ``batch_dim`` s (``batch_dims``), checked the same for each."""
        sizes = {}
        for name, v in self.slots:
            if name in dims and isinstance(v, torch.Tensor):
                if not -v.dim() <= dims[name] < v.dim():
                    raise TargetError(f"{where}: batch_dim {dims[name]} is no dimension of input {name} of shape "
                                      f"{tuple(v.shape)}")
                sizes[name] = v.shape[dims[name]]
        unknown = [n for n in dims if n != "out" and n not in dict(self.slots)]
        if unknown:
            raise TargetError(f"{where}: batch_dim names {', '.join(map(repr, unknown))}; the inputs are "
                              f"{', '.join(n for n, _ in self.slots)}")
        if len(set(sizes.values())) > 1:
            raise TargetError(f"{where}: the declared batch dimensions differ in size: {sizes}")
        return next(iter(sizes.values()), None)

    def with_rows(self, dims: dict[str, int], rows: torch.Tensor) -> "OpCall":
        """These inputs with only ``rows`` along the declared batch dimensions."""
        sub = OpCall.__new__(OpCall)
        sub.target, sub.keyword, sub.shape = self.target, self.keyword, None
        sub.slots = [(n, v.index_select(dims[n], rows.to(v.device)) if n in dims and isinstance(v, torch.Tensor)
                      else v) for n, v in self.slots]
        sub.floating = {n: v for n, v in sub.slots if n in self.floating}
        return sub

    def same_as(self, other: "OpCall") -> bool:
        """Bit for bit the same inputs (NaN included)."""
        def same(a, b) -> bool:
            if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
                return False
            if not isinstance(a, torch.Tensor):
                return a == b
            # compared as bytes on the tensors (a Python list of every byte cost seconds per large input)
            return (a.dtype == b.dtype and a.shape == b.shape
                    and torch.equal(a.cpu().contiguous().flatten().view(torch.uint8),
                                    b.cpu().contiguous().flatten().view(torch.uint8)))
        return ([n for n, _ in self.slots] == [n for n, _ in other.slots]
                and all(same(a, b) for (_, a), (_, b) in zip(self.slots, other.slots)))

    def describe(self) -> list[str]:
        lines = []
        for name, v in self.slots:
            if isinstance(v, torch.Tensor):
                shown = f": {v.tolist()!r}" if v.numel() <= 64 else ""
                lines.append(f"{name}: {str(v.dtype).removeprefix('torch.')} {tuple(v.shape)}{shown}")
            else:
                lines.append(f"{name}: {v!r}")
        return lines


def batch_dims(call: OpCall, declared: int | dict) -> dict[str, int]:
    """A ``batch_dim`` declaration as the dimension of each batched input and of the output
    ("out"): an int is that dimension of the output and of every tensor input."""
    if isinstance(declared, dict):
        return dict(declared)
    return {"out": declared, **{n: declared for n, v in call.slots if isinstance(v, torch.Tensor)}}


def lost_where_finite(peer: torch.Tensor, ref: torch.Tensor) -> str | None:
    """What a peer lost where the exact result is finite (inf, NaN, or 0 where the exact value is a normal
    number of the peer's dtype: an intermediate that overflowed, as rsqrt(inf)), in a few words; None if
    nothing."""
    finite = torch.isfinite(ref)
    p = peer.detach().to(ref.device)
    tiny = torch.finfo(p.dtype).tiny if p.is_floating_point() else 0.0
    inf, nan = int((torch.isinf(p) & finite).sum()), int((torch.isnan(p) & finite).sum())
    zero = int(((p == 0) & finite & (ref.abs() >= tiny)).sum())
    if not inf and not nan and not zero:
        return None
    return ", ".join(f"{n} {w}" for n, w in ((inf, "overflowed to inf"), (nan, "NaN"), (zero, "lost to 0")) if n) + \
        f" of {ref.numel()} elements where the exact result is finite"


def one_tensor_rule(out: Any) -> str:
    """What a call returned instead of one tensor, and the rule."""
    what = f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__
    return f"{what}: an op target returns one tensor (register one target per output)"


def dtypes_of(values: dict[str, torch.Tensor]) -> list[str]:
    return list(dict.fromkeys(str(v.dtype).removeprefix("torch.") for v in values.values()))
