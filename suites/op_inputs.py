"""The op kind's inputs declaration (``register(..., kind="op", inputs={...})``): regime name ->
generator (drawn portably: the same bits on every CPU) or one Hypothesis strategy, normalised into
:class:`OpInputs`, with the errors that name the target and the regime."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from pytest_precision.kinds import Regime, TargetError, file_component, name_problem, portable_normal_draws

__all__ = ["BASE_SEED", "OpInputs", "declared_inputs", "declared_callable"]

BASE_SEED = 20261124


@dataclass(frozen=True)
class OpInputs:
    """A target's ``inputs=`` declaration, normalised: its seeded regimes and, if one was a
    Hypothesis strategy, the drawn regime's name and strategy."""

    regimes: dict
    drawn: str | None = None
    strategy: Any = None


def declared_callable(name: str, key: str, value: Any) -> Callable:
    """A declared callable (``peer=``, ``reference=``), or the error naming the target and key."""
    if not callable(value):
        raise TypeError(f"target {name!r} (op): {key}={value!r} is not callable")
    return value


def declared_inputs(name: str, value: Any) -> OpInputs:
    """A target's ``inputs=`` declaration normalised (``OpInputs``), or the error that says what is wrong."""
    from hypothesis.strategies import SearchStrategy

    if not isinstance(value, dict) or not value:
        raise TypeError(f"target {name!r} (op): inputs={value!r}: expected a dict of regime name -> generator "
                        "(a function of a torch.Generator returning a tensor, a tuple or a dict of inputs) or "
                        "Hypothesis strategy")
    regimes, drawn, strategy, folded = {}, None, None, {}
    for regime, make in value.items():
        problem = name_problem(regime) if isinstance(regime, str) else f"{regime!r} is not a string"
        if problem:
            raise ValueError(f"target {name!r} (op): regime name {problem}")
        other = folded.setdefault(file_component(regime), regime)
        if other != regime:
            raise ValueError(f"target {name!r} (op): regime names {other!r} and {regime!r} would share baseline files")
        if isinstance(make, SearchStrategy):
            if drawn is not None:
                raise ValueError(f"target {name!r} (op): inputs {drawn!r} and {regime!r} are both Hypothesis "
                                 "strategies; one drawn regime per target")
            drawn, strategy = regime, make
        elif callable(make):
            regimes[regime] = Regime.from_generator(regime, f"inputs[{regime!r}] of {name}", _portable(name, regime, make),
                                                    BASE_SEED)
        else:
            raise TypeError(f"target {name!r} (op): inputs[{regime!r}]={make!r} is neither a generator (a function "
                            "of a torch.Generator) nor a Hypothesis strategy")
    return OpInputs(regimes, drawn, strategy)


def _portable(name: str, regime: str, make: Callable) -> Callable[[torch.Generator], Any]:
    def inputs(g: torch.Generator):
        try:
            # torch's float32 randn draws other bits under another vector ISA: drawn portably, a
            # golden's inputs are the same on every CPU
            with portable_normal_draws():
                return make(g)
        except Exception as e:
            raise TargetError(f"target {name!r} (op): the generator of inputs regime {regime!r} raised "
                              f"{type(e).__name__}: {e}") from e
    return inputs
