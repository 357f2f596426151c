"""Op-level tracing: every aten op a call runs, forward and backward, what dtypes it ran in and
what its output holds.

A ``TorchDispatchMode`` sees each op after autocast has chosen its dtypes, so the trace shows what
really ran, not what the autocast lists say. Backward ops are attributed to the
autograd node running them and, with anomaly mode on, to the user's line that built that node in
the forward pass. Tracing costs a Python call and a few reductions per op: it runs for failing
cases (to name the first fault), with ``--precision-trace`` and with ``--precision-audit``, never
on the passing path.

Measured on a 2-core CPU: tracing every case of the default suite adds 1.1 s to its 8.7 s, 1 s of it
the ``torch._dynamo`` import that any dispatch mode costs once.
"""
from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass, field

import torch
from tabulate import tabulate
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..platform.launches import as_harness, current_kernel, harness_ops, watch_launches
from ..platform.user_code import is_user_file, user_frame

__all__ = ["OpRecord", "OpTracer", "trace", "tracing", "render_trace", "user_frame"]

# ops that only re-label a tensor: left out of traces, they say nothing about precision
_BOOKKEEPING = {"detach", "alias", "lift_fresh", "lift_fresh_copy", "_has_compatible_shallow_copy_type"}
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
# ops that overwrite their first argument without reading its values (its old contents, perhaps an
# uninitialised buffer's, are no input of theirs)
_OVERWRITES = {"copy_", "fill_", "zero_", "set_", "uniform_", "normal_", "bernoulli_", "random_", "exponential_",
               "geometric_", "cauchy_", "log_normal_", "resize_"}
# ops that read only the shape, dtype and device of their tensor arguments, never their values
_SHAPE_ONLY = {"full_like", "zeros_like", "ones_like", "empty_like", "new_full", "new_zeros", "new_ones", "new_empty",
               "new_empty_strided", "rand_like", "randn_like", "randint_like"}


def _forward_frame(node) -> str:
    """The user's line that created an autograd node (recorded by anomaly mode), or ``?``."""
    stack = node.metadata.get("traceback_") if hasattr(node, "metadata") else None
    for entry in reversed(stack or []):
        m = _FRAME.search(entry)
        if m and is_user_file(m.group(1)):
            return f"{os.path.basename(m.group(1))}:{m.group(2)}"
    return "?"


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


@dataclass
class OpRecord:
    index: int
    op: str  # "aten::exp"
    phase: str  # "forward", or "backward (ExpBackward0)"
    in_dtypes: tuple[str, ...]
    out_dtypes: tuple[str, ...]
    numel: int  # elements of the floating-point outputs
    nonfinite: int
    zeros: int
    max_abs: float  # over the finite output elements
    where: str  # user's source line; for backward ops, the forward line that built the node
    inputs_finite: bool
    inputs_zero: bool  # some floating input element is exactly 0
    inputs_floating: bool = True  # it read some floating value (False: a constant, an allocation, a draw)
    output: torch.Tensor | None = field(default=None, repr=False)  # first floating output (kept on request)
    kernel: str | None = None  # the interpreted Triton kernel this op ran inside (its internals), if any
    launch: bool = False  # the record of a whole interpreted launch: its inputs and what it wrote

    @property
    def name(self) -> str:
        return self.op.split("::", 1)[-1]

    def row(self) -> tuple:
        where = self.where if self.kernel is None or self.launch else f"{self.where} (in Triton kernel {self.kernel})"
        return (self.index, self.op, self.phase, ",".join(self.in_dtypes) or "-", ",".join(self.out_dtypes) or "-",
                self.numel, self.nonfinite, self.zeros, f"{self.max_abs:.3g}", where)


HEADERS = ("#", "op", "phase", "in", "out", "elements", "non-finite", "zeros", "max |out|", "where")


class OpTracer(TorchDispatchMode):
    """Records an ``OpRecord`` per aten op run inside it (``records``)."""

    def __init__(self, keep_outputs: bool = False):
        super().__init__()
        self.records: list[OpRecord] = []
        self.keep_outputs = keep_outputs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        if name in _BOOKKEEPING or harness_ops():
            return out
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        read = _read_inputs(func, name, args, kwargs or {})
        self._append(f"aten::{name}", ins, outs, read, current_kernel())
        return out

    def _append(self, op: str, ins: list, outs: list, read: list, kernel: str | None, launch: bool = False) -> None:
        fins = [t for t in read if t.is_floating_point()]
        fouts = [t for t in outs if t.is_floating_point()]
        node = torch._C._current_autograd_node()
        if node is None:
            phase, where = "forward", user_frame()
        else:
            phase, where = f"backward ({node.name().split('::')[-1]})", _forward_frame(node)
        nonfinite = zeros = numel = 0
        top = 0.0
        for t in fouts:
            finite = torch.isfinite(t)
            numel += t.numel()
            nonfinite += int((~finite).sum())
            zeros += int((t == 0).sum())
            if bool(finite.any()):
                top = max(top, float(t[finite].abs().max()))
        self.records.append(OpRecord(
            len(self.records), op, phase, tuple(_dtype(t) for t in ins), tuple(_dtype(t) for t in outs),
            numel, nonfinite, zeros, top, where,
            inputs_finite=all(bool(torch.isfinite(t).all()) for t in fins),
            inputs_zero=any(bool((t == 0).any()) for t in fins), inputs_floating=bool(fins),
            output=fouts[0].detach().clone() if self.keep_outputs and fouts and launch else
            fouts[0].detach() if self.keep_outputs and fouts else None, kernel=kernel, launch=launch))

    def launched(self, kernel: str, tensors: list[torch.Tensor], before: list[torch.Tensor]) -> None:
        """One record for a whole interpreted launch (``watch_launches``' observer): its inputs are
        the tensors it left as they were, its outputs those it wrote. The interpreter computes in
        numpy, out of the dispatcher's sight: this is where a value the kernel lost shows. A launch
        the harness's own code makes (``as_harness``: a step replayed before the one traced) is not."""
        if harness_ops():
            return
        with as_harness():  # the comparisons and statistics below are the harness's ops
            wrote = [not _same_bits(t, b) for t, b in zip(tensors, before)]
            # what it wrote, a tensor holding a non-finite value first (the one a fault is read from)
            outs = sorted((t for t, w in zip(tensors, wrote) if w),
                          key=lambda t: not t.is_floating_point() or bool(torch.isfinite(t).all()))
            read = [t for t, w in zip(tensors, wrote) if not w]
            self._append(f"triton::{kernel}", tensors, outs, read, kernel, launch=True)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return torch.equal(a.detach().contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    return torch.equal(a.detach(), b)


def _read_inputs(func, name: str, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an op reads: every tensor argument but those it only writes (an ``out=``
    argument, the destination of ``copy_`` or ``fill_``), whose old contents are no input, and
    none for an op that reads only shapes (``full_like``)."""
    if name in _SHAPE_ONLY:
        return []
    written = set()
    for i, arg in enumerate(func._schema.arguments):
        only_written = arg.kwarg_only and arg.name == "out" or (i == 0 and name in _OVERWRITES)
        if only_written and arg.alias_info is not None and arg.alias_info.is_write:
            written.add(arg.name)
    values = [*zip((a.name for a in func._schema.arguments), args), *kwargs.items()]
    return [t for n, v in values if n not in written for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor)]


@contextlib.contextmanager
def tracing(tracer: OpTracer):
    """The ops run inside the block recorded into ``tracer``: anomaly mode on (without its NaN check)
    so backward ops can name the forward line that built them, interpreted Triton launches recorded."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autograd.set_detect_anomaly(True, check_nan=False))
        # ops inside an interpreted Triton kernel are marked as its; each launch gets a record of its own
        stack.enter_context(watch_launches(observe=tracer.launched))
        stack.enter_context(tracer)
        yield tracer


def trace(fn, *args, keep_outputs: bool = False, **kwargs) -> list[OpRecord]:
    """Run ``fn(*args, **kwargs)`` traced and return its ops in order (``tracing``). Exceptions from
    ``fn`` propagate."""
    with tracing(OpTracer(keep_outputs)) as tracer:
        fn(*args, **kwargs)
    return tracer.records


def render_trace(records: list[OpRecord], limit: int | None = None) -> str:
    """The trace as a table; with ``limit``, the first ``limit`` rows and a count of the rest."""
    shown = records if limit is None or len(records) <= limit else records[:limit]
    table = tabulate([r.row() for r in shown], headers=HEADERS, tablefmt="github")
    if len(shown) < len(records):
        table += f"\n... {len(records) - len(shown)} more op(s)"
    return table

