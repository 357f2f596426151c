"""Batch invariance: whether row i of a batched result depends on the other rows. Where a kind has
independent rows (``TensorKind.rows_of``: softmax and log_softmax rows, norm rows, attention's
batch elements, an op target's declared ``batch_dim``, cross_entropy's rows through their
gradients), the target is run again on the first row alone, on the first half of the batch, and
inside a batch twice as large (the batch repeated), and each result's rows
(``TensorKind.row_results``) are compared bit for bit with the same rows of the full call.

Differences are counted and reported (``BatchSpread``); a target declaring
``batch_invariant=True`` fails on any (category ``batch_variant``): batch-invariant kernels are how
inference stacks make outputs reproducible across batch sizes, and a kernel that picks another
reduction split for another batch size is not one. Configs with per-tensor fp8 scales are not
probed (a row alone has another scale by design)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .contract import changed_bits, recall_context

if TYPE_CHECKING:
    from ..cases import Case
    from .measurement import Measurement

__all__ = ["BatchSpread", "batch_invariance", "probes"]


@dataclass
class BatchSpread:
    """Per probe ("row 0 alone", "rows 0-7 of 16", "inside a batch of 32"), the elements of the
    forward output whose bits differ from the full call's, out of how many were compared."""

    differing: dict[str, int] = field(default_factory=dict)
    compared: dict[str, int] = field(default_factory=dict)
    unwritten: list[str] = field(default_factory=list)  # probes NaN where the full call had values

    @property
    def total(self) -> int:
        return sum(self.differing.values())

    def describe(self) -> str:
        return "; ".join(f"{probe}: {n} of {self.compared[probe]} elements differ"
                         for probe, n in self.differing.items() if n)


def probes(n: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, the rows of the probe's batch, the rows of the full batch its output rows are compared
    with) for a batch of ``n``: the first row alone, the first half, the batch twice over."""
    out = [("row 0 alone", torch.tensor([0]), torch.tensor([0]))]
    if n > 2:
        half = torch.arange(n // 2)
        out.append((f"rows 0-{n // 2 - 1} of {n} alone", half, half))
    full = torch.arange(n)
    out.append((f"inside a batch of {2 * n} (the batch twice)", torch.cat([full, full]), torch.cat([full, full])))
    return out


def batch_invariance(kind, case: "Case", inputs: Any, m: "Measurement", grad_seed: int = 0) -> None:
    """Run the probes of ``case`` (module docstring) into ``m.batch``, and fail a target that
    declared ``batch_invariant=True`` on any difference."""
    if getattr(case.config, "fp8", None) is not None:
        return
    n = kind.batch_size(case, inputs, m.values)
    if not n:
        return
    spread = BatchSpread()
    full = kind.row_results(case, inputs, m.outputs)
    if full is None:
        return
    for name, rows, compared_rows in probes(n):
        sub_inputs, sub_values = kind.rows_of(case, inputs, m.values, rows)
        with recall_context(case):
            got = kind.row_results(case, sub_inputs, kind.call(case, case.target.fn, sub_values, sub_inputs,
                                                               grad_seed, forward_only=not kind.batch_gradients))
        if got is None:  # the probe's rows say nothing exact about these (cross_entropy: a count not a power of two)
            continue
        want = kind.output_rows(case, inputs, full, compared_rows)
        if got.shape != want.shape or got.dtype != want.dtype:
            spread.differing[name], spread.compared[name] = want.numel(), want.numel()
            continue
        spread.differing[name] = int(changed_bits(want, got).sum())
        spread.compared[name] = want.numel()
        if bool((torch.isnan(got) & ~torch.isnan(want)).any()):
            spread.unwritten.append(name)
    m.batch = spread
    if spread.unwritten:  # whatever was declared: rows a launch sized for another batch never wrote
        m.contract.append(("batch_variant", f"{case.target.name}: NaN in rows the full batch gave values for "
                                            f"({', '.join(spread.unwritten)}): it reads memory it never wrote, such "
                                            "as rows of a torch.empty output its launch did not cover"))
    elif spread.total and case.target.declared.get("batch_invariant"):
        m.contract.append(("batch_variant", f"{case.target.name}: declared batch_invariant=True, and its rows depend "
                                            f"on the batch around them: {spread.describe()}"))
