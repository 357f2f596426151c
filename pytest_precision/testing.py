"""Helpers for testing what you build on pytest-precision: ``check_kind(kind)``, the conformance
check a kind author runs in a test of their own (the project runs it over every built-in kind)::

    from pytest_precision.testing import check_kind
    from logsumexp_kind import KIND

    def test_my_kind_conforms():
        check_kind(KIND)

It raises AssertionError naming the kind and what it gets wrong; it needs no pytest session.
"""
from __future__ import annotations

import torch

from .kinds import registry
from .kinds.cases import NO_VARIANT, Case
from .kinds.kind import Kind
from .kinds.session import RunState
from .kinds.target import Target
from .kinds.tensor import TensorKind
from .numerics.budgets import violations
from .numerics.configs import CONFIGS

__all__ = ["check_kind"]


def _require(ok: bool, kind: Kind, what: str) -> None:
    if not ok:
        raise AssertionError(f"kind {getattr(kind, 'name', '') or kind!r}: {what}")


def _sample_target(kind: Kind) -> Target:
    """A target to run the kind through: a tensor kind's own peer (the trusted implementation must
    pass its checks), else the kind's first built-in target."""
    if isinstance(kind, TensorKind):
        return Target("peer", kind.peer, kind.name)
    defaults = kind.default_targets()
    _require(bool(defaults), kind, "no target to check it with: pass check_kind(kind, target=...)")
    return defaults[0]


def check_kind(kind: Kind, target: Target | None = None, device: str = "cpu") -> None:
    """Check that ``kind`` answers what the runner asks of every kind, and consistently: its
    identity, its targets and its case matrix; and for a :class:`~.kinds.tensor.TensorKind`, that
    its seeded regimes (and its fresh regime, from one seed) give the same bits twice, that
    ``target`` (default: the kind's peer) passes the oracle with the peer budget on its first
    regime in fp32, and that its cases trace.
    ``target``: a target of the kind to run it through (the op kind's peers and regimes are each
    target's own, so it needs one). AssertionError says what the kind gets wrong."""
    _require(isinstance(kind, Kind), kind, f"a {type(kind).__name__}, not a pytest_precision.Kind")
    for attr in ("name", "contract", "suite", "table"):
        _require(bool(getattr(kind, attr, None)), kind, f"no {attr} (Kind.{attr} is part of its identity)")
    if kind.name in registry.kind_names():
        _require(registry.get_kind(kind.name) is kind, kind, "another object is registered under its name")
    sample = target or _sample_target(kind)
    try:
        names = kind.regime_names(sample)
    except Exception as e:
        raise AssertionError(f"kind {kind.name!r}: regime_names({sample.name!r}) raised {type(e).__name__}: {e}") from e
    _require(bool(names) and len(set(names)) == len(names), kind, f"regime names {names!r}: none, or one twice")
    configs = kind.configs(list(CONFIGS.values()))
    _require(bool(configs) and len({c.id for c in configs}) == len(configs), kind,
             f"configs {[c.id for c in configs]!r}: none, or one id twice")
    variants = kind.variants(device)
    _require(bool(variants), kind, f"no variants on {device} (NO_VARIANT at least)")
    try:
        kind.check_target("not-a-target", 42)
    except TypeError:
        pass
    else:
        raise AssertionError(f"kind {kind.name!r}: check_target accepted 42 as a target (it raises TypeError)")
    for default in kind.default_targets():
        _require(default.kind == kind.name, kind, f"its built-in target {default.name!r} is of kind {default.kind!r}")
        kind.check_target(default.name, default.fn)
    case = Case(kind, Target("t", lambda *a: None, kind.name), configs[0], variants[0], names[0], device)
    _require(case.name == f"{kind.name}[t-{configs[0].id}{variants[0].suffix}-{names[0]}]", kind,
             f"its case is named {case.name!r}")
    _require(case.baseline_key == f"{kind.name}/t/{names[0]}", kind, f"its baseline key is {case.baseline_key!r}")
    if isinstance(kind, TensorKind):
        _check_tensor_kind(kind, sample, device)


def _check_tensor_kind(kind: TensorKind, sample: Target, device: str) -> None:
    regimes = kind.regimes_for(sample)
    for regime in regimes.values():  # seeded inputs: the same bits twice
        case = Case(kind, sample, CONFIGS["fp32"], NO_VARIANT, regime.name, device)
        a = kind.floating_inputs(kind.for_target(case, regime.inputs()))
        b = kind.floating_inputs(kind.for_target(case, regime.inputs()))
        _require(a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), kind,
                 f"regime {regime.name!r} gave other inputs on a second call: draw from the generator it is given")
    if kind.fresh in kind.regime_names(sample):  # drawn from the seed: one seed, the same bits (kinds.fresh)
        got = [kind.case_inputs(Case(kind, sample, CONFIGS["fp32"], NO_VARIANT, kind.fresh, device, RunState(1)))
               for _ in range(2)]
        a, b = ({} if g.skipped else kind.floating_inputs(g.inputs) for g in got)
        _require(a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), kind,
                 "its fresh regime gave other inputs from the same seed: draw from the generator it is given")
    if not regimes:
        return
    regime = next(iter(regimes.values()))
    case = Case(kind, sample, CONFIGS["fp32"], NO_VARIANT, regime.name, device)
    inputs = kind.for_target(case, regime.inputs())
    m = kind.measure(case, inputs, grad_seed=regime.seed + 1)
    expected = {kind.forward_output, *(f"d{n}" for n in kind.case_grad_inputs(case, inputs))}
    _require(set(m.results) == expected, kind, f"outputs {sorted(m.results)}, expected {sorted(expected)} (the forward "
                                              "output and a gradient per grad_inputs)")
    over = {n: [s for _, s in violations(r.oracle, r.peer_budget)] for n, r in m.results.items()}
    over = {n: s for n, s in over.items() if s}
    _require(not over, kind, f"target {sample.name!r} fails the oracle with the peer budget in fp32 on regime "
                             f"{regime.name!r}: {over}")
    _require(kind.trace_call(case) is not None, kind, f"no traced call for {case.name}")
