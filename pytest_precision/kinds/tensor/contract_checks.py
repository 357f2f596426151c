"""The contract checks a fixed-regime case of a tensor kind runs after its measurement
(``check_contract``): a second call on fresh copies of the same inputs (determinism, and an
output cached across calls), batch invariance where the kind has independent rows
(``kinds.tensor.batch``), and the refusal of a degenerate regime. What each finds goes into the
measurement (``Measurement.contract``, ``.spread``, ``.batch``), which the outcome reads.

Their cost, measured: one to four more calls per case took the main job from 59.4 s to 74.1 s on
fp32's cases (133 s when run in every config)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ...platform.launches import watch_launches
from .contract import degenerate, poison_freed_memory, recall_context, spread_between

if TYPE_CHECKING:
    from ..cases import Case
    from .measurement import Measurement

__all__ = ["check_contract", "second_call"]


def second_call(kind, case: "Case", inputs: Any, m: "Measurement", grad_seed: int) -> None:
    """Call the target again on fresh copies of the same inputs (from the same random state: every
    call restores torch's generators, ``guarded``), with memory it never writes reading NaN
    (``recall_context``), and keep what differs (``m.spread``); the regression budget is never set
    below that spread (``TensorOutput.spread``). A target declaring ``deterministic=True`` fails on
    any difference, and any target whose second output is in its first's memory fails (an output
    cached by shape, a buffer kept across calls)."""
    poison_freed_memory(list(m.outputs.values()))
    with watch_launches(), recall_context(case):
        again = kind.call(case, case.target.fn, m.values, inputs, grad_seed)
    spread = m.spread = spread_between(m, again)
    for name, cmp in spread.comparisons.items():
        if spread.differing.get(name) and name in m.results:
            m.results[name].golden.spread = cmp
    who = case.target.name
    if spread.same_output_object:
        m.contract.append(("contract", f"{who}: its second call returned the memory of its first call's output, "
                                       "which the caller still held (an output cached by shape or pointer, a buffer "
                                       "kept across calls): return a fresh tensor from every call"))
    elif spread.total:
        lost = [n for n, t in again.items() if n in m.outputs and t.shape == m.outputs[n].shape
                and bool((torch.isnan(t) & ~torch.isnan(m.outputs[n])).any())]
        why = (" (NaN on the second call where the first had values: it reads memory it never wrote, such as "
               "an output from torch.empty left partly unfilled)") if lost else ""
        sentence = (f"a second call on fresh copies of the same inputs gave other bits: "
                    f"{spread.describe(kind.forward_output)}{why}")
        if case.target.declared.get("deterministic") or lost:
            m.contract.append(("nondeterministic", f"{who}: {sentence}"))
        else:
            m.notes.append(f"{sentence} (not judged: declare deterministic=True to require the same bits)")


def rechecked(case: "Case", key: str) -> bool:
    """Whether ``case`` runs the re-calls of ``key`` (``deterministic``: the second call;
    ``batch_invariant``: the batch probes): every case of a target declaring it, else the plain
    float32 cases (each variant's). They cost one to four more calls of the target per case, which
    doubled the main job when run under every config; the cheats they catch (a cached output, a
    read of unwritten memory, a result split by batch size) show in float32 as well, and the fresh
    regime attacks every config."""
    return bool(case.target.declared.get(key)) or case.config.id == "fp32"


def check_contract(kind, case: "Case", inputs: Any, m: "Measurement", grad_seed: int) -> None:
    """The checks beyond the values of a fixed-regime case (module docstring), into ``m``."""
    if rechecked(case, "deterministic"):
        second_call(kind, case, inputs, m, grad_seed)
    if rechecked(case, "batch_invariant"):
        from .batch import batch_invariance

        batch_invariance(kind, case, inputs, m, grad_seed)
    why = degenerate(m.goldens(), {n: r.golden.reference for n, r in m.results.items()},
                     {n: r.peer_budget for n, r in m.results.items()})
    if why:
        m.contract.append(("degenerate", f"regime {case.regime} under {case.config_id}: {why}; it judges nothing "
                                         f"({_why_wide(m)}): the harness refuses it"))


def _why_wide(m: "Measurement") -> str:
    """What set the forward output's budget so wide: the peer's own error (its overflow or NaN named),
    or the floors (the exact result's spread is within them)."""
    forward = next(iter(m.results.values()))
    peer, budget = forward.peer, forward.peer_budget
    lost = ", ".join(f"{n} {w}" for n, w in ((peer.overflow, "overflowed"), (peer.nan, "NaN"),
                                              (peer.underflow, "underflowed")) if n)
    error = peer.max_abs if budget.max_abs is not None else peer.max_ulp
    unit = "max abs" if budget.max_abs is not None else "max ULP"
    if lost or (error == error and budget.describe() and error > 0.25 * (budget.max_abs or budget.max_ulp or 0)):
        what = f"{m.peer_name} in this config: {unit} {error:.4g}" + (f", {lost} elements" if lost else "")
        return f"its budget, {budget.describe()}, is set by the peer's own error ({what})"
    return "its exact result's spread is within the budget's floor"
