"""The callable's contract beyond the values it returns, checked on every case of a tensor kind:

- its inputs are left alone (``InputWatch``): the target is handed copies, compared bit for bit
  with the originals after its forward and after its backward, unless it declared
  ``mutates=(name, ...)`` (a kernel that writes into an input by design; the copies it gets are
  never reused);
- its output is a plain, fresh tensor (``plain_output``, ``aliased_inputs``): not a tensor
  subclass or lazy wrapper, not sharing storage with an input (unless declared ``aliases=``), and
  not the tensor of an earlier call (an output cached by shape or pointer);
- two calls on fresh copies of the same inputs agree (``second_call``): the second runs with
  the memory torch allocates uninitialised filled with NaN (``unwritten_memory_filled``; freed
  blocks of the outputs' sizes filled with NaN before it, ``poison_freed_memory``), so a result
  read from stale or unwritten memory changes; the bits that differ are counted (``Spread``),
  reported, and fail a target declaring ``deterministic=True``;
- the regime can tell a result from nothing (``degenerate``): a case whose every output an
  all-zeros or a constant tensor would pass within budget is refused, so such a target never
  passes (unless zeros are the exact result).

Each breach is a problem of the case (category ``contract``, ``nondeterministic`` or
``degenerate``) saying in one line what the target did.

A mask or labels tensor is watched where the target gets the harness's own tensor: on a CUDA device
the kinds hand it a device copy made for the call, whose changes are not seen.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...numerics.budgets import Budget, violations
from ...numerics.metrics import ComparisonSpec, compare
from ..declarations import Declaration
from ..target import TargetError

if TYPE_CHECKING:
    from .measurement import Measurement

__all__ = ["CONTRACT_DECLARATIONS", "normalise_contract", "InputWatch", "other_tensor_fields", "Spread", "plain_output", "aliased_inputs", "changed_bits", "poison_freed_memory",
           "unwritten_memory_filled", "recall_context", "spread_between", "degenerate", "declared_names"]

# what a tensor kind's target may declare about its contract (TensorKind.declarations)
CONTRACT_DECLARATIONS = {
    "mutates": "names of inputs it changes in place by design (handed copies never reused); any other change fails",
    "aliases": "names of inputs its output may share memory with (an in-place op returning its input)",
    "deterministic": "True: a second call on fresh copies of the same inputs must give the same bits",
    "batch_invariant": "True: each row's result must not depend on the batch around it (kinds with independent rows)",
}

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def changed_bits(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Where ``after`` differs from ``before`` bit for bit, any NaN equal to any NaN: their sign and
    payload say which instruction made them (0 / 0 on x86 is a negative NaN, float("nan") a positive
    one), not a value, and a kernel's vector and scalar paths may differ there."""
    if before.dtype != after.dtype or before.shape != after.shape:
        raise ValueError("changed_bits: tensors of different dtype or shape")
    if before.dtype == torch.bool or before.element_size() not in _INT_OF_SIZE or before.is_complex():
        return before != after
    as_int = _INT_OF_SIZE[before.element_size()]
    changed = before.view(as_int) != after.view(as_int)
    if before.is_floating_point():
        changed &= ~(torch.isnan(before) & torch.isnan(after))
    return changed


def _largest_change(before: torch.Tensor, after: torch.Tensor, changed: torch.Tensor) -> str:
    if not (before.is_floating_point() or after.is_floating_point()):
        return ""
    a, b = after[changed].double(), before[changed].double()
    if bool(torch.isnan(a).any()):
        return ", NaN written"
    diff = (a - b).abs()
    finite = diff[torch.isfinite(diff)]
    top = f"{float(finite.max()):.4g}" if finite.numel() else "inf"
    return f", largest change {top}"


def normalise_contract(name: str, key: str, value: Any) -> Any:
    """A contract declaration's value: input names for ``mutates`` and ``aliases``, a flag otherwise."""
    from ..declarations import declared_flag

    if key in ("deterministic", "batch_invariant"):
        return declared_flag(name, key, value)
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"target {name!r}: {key}={value!r}: expected input names, such as ('x',)")
    return tuple(names)


def declared_names(target_name: str, key: str, declared: tuple[str, ...], known: list[str]) -> set[str]:
    """A ``mutates=`` or ``aliases=`` declaration checked against the inputs the case hands over."""
    unknown = [n for n in declared if n not in known]
    if unknown:
        raise TargetError(f"target {target_name!r}: {key} names {', '.join(map(repr, unknown))}; the inputs it is "
                          f"handed are {', '.join(known)}")
    return set(declared)


def other_tensor_fields(inputs: Any, floating: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensor fields of a dataclass of inputs that are not among ``floating`` (by name)."""
    if not dataclasses.is_dataclass(inputs):
        return {}
    return {f.name: v for f in dataclasses.fields(inputs)
            if isinstance(v := getattr(inputs, f.name), torch.Tensor) and f.name not in floating}


class InputWatch:
    """The inputs one call hands the target: copies of the floating values (``handed``) and the other
    tensors of the inputs (masks, labels, positions), which the target gets as they are, with a
    snapshot of each; compared after the call (``changes``) and put back (``restore``)."""

    def __init__(self, values: dict[str, torch.Tensor], others: dict[str, torch.Tensor], mutates: set[str]):
        self.originals = values
        self.others = others
        self.snapshots = {n: t.clone() for n, t in others.items()}
        self.mutates = mutates
        self.reported: set[str] = set()

    def changes(self, handed: dict[str, torch.Tensor], stage: str) -> list[tuple[str, Declaration]]:
        """A sentence per input the call changed in place (``stage``: "forward" or "backward"), each
        input said once, with the declaration that allows it (``mutates``)."""
        out = []
        pairs = [(n, self.originals[n], handed[n].detach(), False) for n in handed]
        pairs += [(n, self.snapshots[n], self.others[n], True) for n in self.snapshots]
        for name, before, after, shared in pairs:
            if after.shape != before.shape or after.dtype != before.dtype:
                if shared:
                    raise TargetError(f"its {stage} changed input {name} to {after.dtype} {tuple(after.shape)} in place")
                continue
            before = before.to(after.device)
            changed = changed_bits(before, after)
            n = int(changed.sum())
            if n and name not in self.mutates and name not in self.reported:
                self.reported.add(name)
                out.append((f"its {stage} changed input {name} in place ({n} of {changed.numel()} elements"
                            f"{_largest_change(before, after, changed)}); declare mutates=('{name}',) if it does "
                            "so by design", Declaration("mutates", (name,))))
        return out

    def restore(self) -> None:
        """Put back the inputs the target shares with the peer, the oracle and the later calls (masks,
        labels) as they were. Done once the call (forward and backward) is over: a restore between
        them would bump the version of a tensor its graph saved, and its backward would raise."""
        for name, before in self.snapshots.items():
            after = self.others[name]
            # one reshaped in place (reported by ``changes``) is left as it is
            if after.shape == before.shape and after.dtype == before.dtype and bool(
                    changed_bits(before.to(after.device), after).any()):
                after.copy_(before)


def plain_output(out: Any, where: str) -> None:
    """Refuse a tensor subclass or a lazy wrapper where the contract is a plain tensor."""
    if isinstance(out, torch.Tensor) and type(out) is not torch.Tensor:
        raise TargetError(f"{where} returned a {type(out).__module__}.{type(out).__qualname__}, a tensor subclass; "
                          "the contract is a plain torch.Tensor (materialise it: torch.Tensor(out) or out.clone() "
                          "on a plain tensor)")


def _storage_span(t: torch.Tensor) -> tuple[int, int] | None:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    start = storage.data_ptr()
    return (start, start + storage.nbytes()) if storage.nbytes() else None


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` live in overlapping memory (the same tensor, a view, an alias)."""
    if a.device != b.device:
        return False
    sa, sb = _storage_span(a), _storage_span(b)
    return sa is not None and sb is not None and sa[0] < sb[1] and sb[0] < sa[1]


def aliased_inputs(out: torch.Tensor, handed: dict[str, torch.Tensor],
                   allowed: set[str]) -> list[tuple[str, Declaration]]:
    """Sentences for each input ``out`` shares storage with, outside those declared ``aliases=``, with
    the declaration that allows it."""
    return [(f"its output shares memory with input {name} (the input itself, a view or an alias); return a fresh "
             f"tensor, or declare aliases=('{name}',)", Declaration("aliases", (name,)))
            for name, t in handed.items() if name not in allowed and shares_storage(out, t)]


def poison_freed_memory(like: list[torch.Tensor]) -> None:
    """Allocate blocks of the sizes of ``like``, fill them with NaN and free them: the allocator
    (CUDA's caching one; glibc's for blocks below its mmap threshold) hands them to the next
    allocations of those sizes, so an output left partly uninitialised reads NaN there."""
    blocks = [torch.full((max(1, t.numel()),), float("nan"), dtype=torch.float32 if not t.is_floating_point()
                         or t.element_size() > 4 else t.dtype, device=t.device) for t in like]
    del blocks


@contextlib.contextmanager
def unwritten_memory_filled():
    """Inside, every tensor torch allocates without initialising (``torch.empty`` and its kin, in the
    target and in a Triton launcher) is filled with NaN (integers: their largest value), whichever
    block the allocator hands out: torch's deterministic mode with ``fill_uninitialized_memory``,
    warn-only so that no op refuses to run, its warnings dropped. Freed memory poisoned with NaN
    (``poison_freed_memory``) is a guess at which block that is; measured here, a target writing
    only the first row of a torch.empty output of 2 x 32768 float32 got a block holding the right
    values on its second call, and passed. The mode also makes the ops torch runs
    nondeterministically by default (CUDA atomics) run deterministically, which a second call may
    then show as other bits: they are. The previous mode is back on exit."""
    import torch.utils.deterministic as det

    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = det.fill_uninitialized_memory
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*determinis", category=UserWarning)
        torch.use_deterministic_algorithms(True, warn_only=True)
        det.fill_uninitialized_memory = True
        try:
            yield
        finally:
            det.fill_uninitialized_memory = fill
            torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def recall_context(case: Any) -> contextlib.AbstractContextManager:
    """Around a re-call of the target: memory it never writes reads NaN (``unwritten_memory_filled``),
    except for a compiled variant, whose frames dynamo guards on torch's deterministic mode (a
    re-call under it would compile the target again, towards the recompile limit; freed memory
    poisoned with NaN is its only net)."""
    return contextlib.nullcontext() if case.variant.guards_global_state else unwritten_memory_filled()


@dataclass
class Spread:
    """What a second call on fresh copies of the same inputs gave, against the first: per output,
    the elements whose bits differ, the largest difference in ULPs and in absolute terms, and the
    typical ones (what the regression budget is never set below)."""

    differing: dict[str, int]
    numel: dict[str, int]
    comparisons: dict[str, Any]  # numerics.metrics.Comparison of the second call against the first
    same_output_object: bool = False  # the second output is in the first's memory (a cache, a kept buffer)

    @property
    def total(self) -> int:
        return sum(self.differing.values())

    def max_ulp(self) -> float:
        values = [c.max_ulp for n, c in self.comparisons.items() if self.differing.get(n)]
        return max((v for v in values if not math.isnan(v)), default=math.inf if values else 0.0)

    def describe(self, forward: str = "") -> str:
        """``forward``: the forward output's name, said as "output" (gradients keep theirs: dx)."""
        parts = []
        for name, n in self.differing.items():
            if n:
                c = self.comparisons[name]
                ulp = f"max {c.max_ulp:.3g} ULP" if not math.isnan(c.max_ulp) else "non-finite on one call"
                parts.append(f"{'output' if name == forward else name}: {n} of {self.numel[name]} elements differ, {ulp}")
        return "; ".join(parts)


def spread_between(m: "Measurement", second: dict[str, torch.Tensor]) -> Spread:
    """The second call's outputs against the first's (``m.outputs``), counted in the dtypes the case
    judges them in."""
    differing, numel, comparisons = {}, {}, {}
    for name, first in m.outputs.items():
        again = second[name]
        numel[name] = first.numel()
        if again.shape != first.shape or again.dtype != first.dtype:
            differing[name] = first.numel()
            comparisons[name] = compare(torch.full_like(first, float("nan")), first.double().cpu(),
                                        m.results[name].golden.spec.dtype if name in m.results else first.dtype)
            continue
        differing[name] = int(changed_bits(first, again).sum())
        judged = m.results[name].golden.spec if name in m.results else None
        dtype = judged.dtype if judged is not None else first.dtype
        scale = judged.scale if judged is not None else 1.0
        comparisons[name] = compare(again.detach().cpu(), first.detach().cpu().double(), dtype, scale=scale)
    same = shares_storage(m.outputs[next(iter(m.outputs))], second[next(iter(second))])
    return Spread(differing, numel, comparisons, same)


def _candidate_passes(candidate: torch.Tensor, ref: torch.Tensor, spec: ComparisonSpec, budget: Budget) -> bool:
    return not violations(spec.compare(candidate, ref), budget)


def degenerate(goldens: dict, refs: dict[str, torch.Tensor], budgets: dict[str, Budget]) -> str | None:
    """Why every output of the case would pass within its peer budget as all zeros or as one
    constant (the median of the exact result), or None. A one-element output is one constant
    already: only zeros are tried on it. An output whose exact result is 0 everywhere is no
    degenerate one: zeros are its result, and what the regime tells apart is another answer (the
    all-ignored batch of a cross_entropy target declaring ``all_ignored="zero"``: loss and gradient
    0, where NaN fails)."""
    found = []
    for name, ref in refs.items():
        if not bool((ref != 0).any()):
            return None
        golden, budget = goldens[name], budgets[name]
        out = golden.out
        zeros = torch.zeros(out.shape, dtype=out.dtype, device=out.device)
        if _candidate_passes(zeros, ref, golden.spec, budget):
            found.append((name, "an all-zeros output"))
            continue
        finite = ref[torch.isfinite(ref)]
        if ref.numel() > 1 and finite.numel():
            c = float(finite.median())
            constant = torch.full(out.shape, c, dtype=torch.float64).to(out.dtype).to(out.device)
            if _candidate_passes(constant, ref, golden.spec, budget):
                found.append((name, f"the constant {c:.4g} everywhere"))
                continue
        return None
    what = "; ".join(f"{name}: {how}" for name, how in found) if len(found) > 1 else found[0][1]
    return f"the regime cannot tell a result from nothing: {what} would pass within budget"
