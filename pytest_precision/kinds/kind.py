"""The seam every kind goes through: a :class:`Kind` is one object, and the runner asks it three
things of a case (``run``, ``bench_call``, ``trace_call``), which each kind implements.

A kind has

- an identity: ``name`` (the ``kind=`` of ``register``), a ``contract`` line shown in errors and
  docs, a ``suite`` (the report group: softmax and log_softmax share one) and a summary ``table``;
- targets: ``check_target`` (at registration), ``default_targets`` (the built-in ones), and what a
  target may declare it supports (``declarations``, ``declare``, ``normalise_declaration``);
- the case matrix: ``configs``, ``variants`` and ``target_variants`` (such as SDPA backends),
  ``regimes_for`` and ``drawn_for`` (named, seeded :class:`~.cases.Regime` s and a drawn one),
  ``fresh_regime`` (inputs from a seed of each target's own, for kinds that set ``fresh``), ``regime_names``,
  and why a case does not run here (``skip_reason``, ``unsupported``, ``why_skipped``);
- the case itself: ``run`` (its :class:`~.outcome.Outcome`), ``bench_call`` (what the speed gate
  times, or None), ``trace_call`` (what --precision-trace and --precision-audit run, or None).

Kinds whose targets return tensors subclass :class:`~.tensor.TensorKind`, the template that
implements the three from small hooks (inputs, the call, the float64 reference, a peer); the
training kind implements them itself. ``pytest_precision.testing.check_kind`` checks a kind
against what the runner expects of it.
"""
from __future__ import annotations

import dataclasses

import sys
from abc import ABC, abstractmethod
from typing import Any, Callable

from ..baselines.lifecycle import BaselineCheck
from ..numerics.configs import Config
from ..platform.triton import skip_reason as triton_skip_reason
from ..speed.timing import Bench
from .cases import NO_VARIANT, Case, DrawnRegime, Regime, Variant
from .declarations import declared_dtypes, declared_flag
from .fresh import reseeded
from .outcome import Outcome
from .tables import TENSOR_TABLE, SummaryTable
from .target import Target

__all__ = ["Kind", "TENSOR_HOOKS", "skip", "xfail"]

# the hooks of the tensor template (TensorKind): a Kind subclass that writes them and leaves run,
# bench_call and trace_call to the seam meant to subclass TensorKind
TENSOR_HOOKS = ("floating_inputs", "invoke", "expected_shape", "reference", "peer", "output_rule", "draw")


def skip(reason: str):
    """Skip the running case with ``reason`` (pytest's skip, imported only when needed)."""
    import pytest

    pytest.skip(reason)


def xfail(reason: str):
    """Mark the running case as failing for a reason that is not the target's (pytest's xfail)."""
    import pytest

    pytest.xfail(reason)


class Kind(ABC):
    """One kind of target (module docstring). Subclasses set the identity and implement ``run``,
    ``bench_call`` and ``trace_call``; tensor kinds subclass ``TensorKind`` instead."""

    # identity
    name: str = ""
    contract: str = ""
    suite: str = ""  # the report group; defaults to the name
    table: SummaryTable = TENSOR_TABLE  # the summary table its records go to
    # inputs
    regimes: dict[str, Regime] = {}
    drawn: DrawnRegime | None = None
    fresh: str | None = None  # the name of the regime drawn from each target's own seed (``fresh_regime``), if any
    audit_regime: str | None = "unit"  # --precision-audit looks at one regime per target and config
    compiles = False  # --precision-compile adds a compiled variant of each (kinds whose cases go through a call)
    # what a target may declare it supports at registration (register(..., **declared)): name ->
    # meaning, for errors and docs; the kind normalises each (``declare``) and skips the cases
    # outside (``unsupported``)
    declarations: dict[str, str] = {
        "dtypes": "the input dtypes it takes (torch dtypes, or 'fp32', 'fp16', 'bf16'); configs feeding another are "
                  "skipped",
        "forward_only": "True: it has no backward; only the forward output is judged",
    }

    def __new__(cls, *args, **kwargs):
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        if missing and getattr(cls, "tensor_template", False):
            raise TypeError(f"{cls.__name__} leaves TensorKind's required hook{'s' if len(missing) > 1 else ''} "
                            f"{', '.join(missing)} unwritten (the core a tensor kind implements)")
        hooks = [h for h in TENSOR_HOOKS if any(h in vars(k) for k in cls.__mro__[:cls.__mro__.index(Kind)])]
        if missing and hooks:  # silently half a kind otherwise: the hooks would never run
            raise TypeError(f"{cls.__name__} writes the tensor kind's hooks ({', '.join(hooks)}) on "
                            f"pytest_precision.Kind, the seam, which leaves {', '.join(missing)} to it: subclass "
                            "pytest_precision.TensorKind, the template that runs those hooks")
        return super().__new__(cls)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # where the kind is defined, for pytest's report lines (pytester sessions drop modules
        # from sys.modules, so it is read now, while the module is importing)
        cls.source_file = getattr(sys.modules.get(cls.__module__), "__file__", None) or "<unknown>"

    def __init__(self):
        if not self.suite:
            self.suite = self.name

    # ---- targets -------------------------------------------------------------------------------

    def check_target(self, name: str, fn: Any) -> None:
        """Raise TypeError when ``fn`` cannot be a target of this kind (at registration)."""
        if not callable(fn):
            raise TypeError(f"target {name!r}: {fn!r} is not callable")

    def default_targets(self) -> list[Target]:
        """The built-in targets: run when nothing is registered, or with --precision-builtins."""
        return []

    def declare(self, name: str, declared: dict) -> dict:
        """What target ``name`` declared at registration, checked and normalised; TypeError or
        ValueError naming the target and what it may declare."""
        unknown = sorted(set(declared) - set(self.declarations))
        if unknown:
            known = ", ".join(self.declarations) or "nothing"
            raise TypeError(f"target {name!r} ({self.name}): unknown declaration {', '.join(map(repr, unknown))}; a "
                            f"{self.name} target may declare {known}")
        return {key: self.normalise_declaration(name, key, value) for key, value in declared.items()}

    def declaring(self, target: Target, declarations) -> Target:
        """``target`` as if it had also declared ``declarations`` (kinds.declarations.Declaration)."""
        added = {d.key: self.normalise_declaration(target.name, d.key, d.value) for d in declarations}
        return dataclasses.replace(target, declared={**target.declared, **added})

    def normalise_declaration(self, name: str, key: str, value: Any) -> Any:
        """One declaration's value, normalised (kinds override it for their own keys)."""
        if key == "dtypes":
            return declared_dtypes(name, value)
        if key == "forward_only":
            return declared_flag(name, key, value)
        return value

    # ---- the matrix ----------------------------------------------------------------------------

    def configs(self, selected: list[Config]) -> list:
        """The configs this kind runs, given the ones the run selected."""
        return list(selected)

    def target_configs(self, target: Target, configs: list) -> list:
        """Of ``configs``, those ``target`` has cases in (default: all); a config only some targets
        declare (a training spec's own fp8 recipe) has no case, not a skip, in the others."""
        return configs

    def variants(self, device: str) -> list[Variant]:
        return [NO_VARIANT]

    def target_variants(self, target: Target, device: str) -> list[Variant]:
        """The variants that apply to ``target`` (a target no variant reaches runs once, unsuffixed)."""
        return self.variants(device)

    def regimes_for(self, target: Target) -> dict[str, Regime]:
        """The seeded regimes ``target`` runs on: the kind's (the op kind's targets declare their own)."""
        return self.regimes

    def drawn_for(self, target: Target) -> DrawnRegime | None:
        """The drawn regime ``target`` runs on, if any."""
        return self.drawn

    def fresh_regime(self, target: Target, seed: int) -> Regime | None:
        """The fresh regime of ``target`` from the session's fresh ``seed`` (``kinds.fresh``): named
        ``self.fresh``, its inputs (and, where the kind draws them, its sizes) drawn from the seed,
        judged with no golden; None where the kind has none for ``target``. Called once per case,
        it builds no inputs (a Regime makes them when the case runs). The default: the target's
        first seeded regime, its generator seeded from the fresh seed (its shapes are its own)."""
        first = next(iter(self.regimes_for(target).values()), None)
        return None if first is None else reseeded(first, seed)

    def session_target(self, target: Target, state) -> Target:
        """``target`` as this session runs it: the run's options a kind reads from ``state`` (a
        ``RunState``) may change it (the training kind's ``--precision-train-seeds``); default as it is."""
        return target

    def regime_names(self, target: Target | None = None) -> tuple[str, ...]:
        """The regimes' names: the kind's, or ``target``'s (the fresh regime's last, where there is one)."""
        regimes, drawn = (self.regimes, self.drawn) if target is None else (self.regimes_for(target),
                                                                            self.drawn_for(target))
        names = (*regimes, *((drawn.name,) if drawn else ()))
        if self.fresh is None or (target is not None and self.fresh_regime(target, 0) is None):
            return names
        if self.fresh in names:
            raise ValueError(f"kind {self.name!r}: regime name {self.fresh!r} is the fresh regime's (inputs drawn "
                             "anew every run): name the regime otherwise")
        return (*names, self.fresh)

    def skip_reason(self, case: Case) -> str | None:
        """Why ``case`` cannot run here (checked when it runs): Triton code that cannot run on this
        machine (one rule for every kind), a variant that does not apply to the target."""
        reason = triton_skip_reason(case.target.fn, case.device)
        if reason:
            return f"{case.target.name}: {reason}"
        reason = case.variant.skip_reason(case.target)
        return f"{case.target.name}: {reason}" if reason else None

    def unsupported(self, case: Case, inputs: Any = None) -> str | None:
        """Why ``case`` lies outside what its target declared (``inputs``: the regime's, or None
        for what the config alone decides), or None."""
        dtypes = case.target.declared.get("dtypes")
        fed = getattr(case.config, "input_dtype", None)
        if dtypes is not None and fed is not None and fed not in dtypes:
            return (f"declares dtypes {', '.join(str(d).removeprefix('torch.') for d in dtypes)}; "
                    f"{case.config.id} feeds it {str(fed).removeprefix('torch.')}")
        return None

    def why_skipped(self, case: Case) -> str | None:
        """Why ``case`` is skipped without calling its target (the config, or what the target
        declared about it), or None: the runner asks it where a case cannot run (a hung variant
        probe), so the skips stay what they would be."""
        reason = self.skip_reason(case)
        if reason:
            return reason
        reason = self.unsupported(case)
        return f"{case.target.name}: {reason}" if reason else None

    # ---- the case ------------------------------------------------------------------------------

    @abstractmethod
    def run(self, case: Case, baseline: BaselineCheck) -> Outcome:
        """Run and judge ``case`` (``baseline``: its golden); skip it (``skip``) where it cannot run."""

    @abstractmethod
    def bench_call(self, case: Case) -> Bench | None:
        """The timed call of ``case`` for the speed gate, or None where it has nothing to time."""

    @abstractmethod
    def trace_call(self, case: Case) -> Callable | None:
        """The call --precision-trace and --precision-audit run traced, or None."""

    def __repr__(self) -> str:
        return f"<kind {self.name}>"
