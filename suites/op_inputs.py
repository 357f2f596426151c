"""The op kind's inputs declaration (``register(..., kind="op", inputs={...})``): regime name ->
generator (drawn portably: the same bits on every CPU) or one Hypothesis strategy, normalised into
:class:`OpInputs`, with the errors that name the target and the regime; and the inputs as a config's
arithmetic may move them (``moved_inputs``), which the oracle's budgets are drawn from."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from pytest_precision.kinds import Regime, TargetError, file_component, name_problem, portable_normal_draws

__all__ = ["BASE_SEED", "OpInputs", "declared_inputs", "declared_callable", "round_to_tf32", "moved_inputs",
           "FLOAT32_MOVE_ULPS", "FLOAT32_GRAD_MOVE_ULPS"]

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


# the backward error granted to float32 arithmetic, in ULPs per input (see moved_inputs): a reduction of
# n terms has one of up to n ULPs; measured in fp32 against the exact result, torch.matmul over
# 4096 terms and an MLP of width 1024 (forward and gradients) stay under 40 % of the budget with 4,
# and an MLP of width 512 failed its RMS limit with 1
FLOAT32_MOVE_ULPS = 4.0
# the same for the gradients judged against the exact result rounded (no peer runs float32 arithmetic):
# an elementwise op's backward evaluates terms larger than its result (GELU-tanh's 1 - tanh^2 cancels
# ones ~10 x it), and torch's float32 backwards of tanh-GELU, SiLU and softplus err by up to 7.7 ULPs
# of the gradient's largest value, 1.1 x the budget with 4 ULPs of move (see README, op kind)
FLOAT32_GRAD_MOVE_ULPS = 16.0


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded (to nearest, ties to even) to TF32's 10 fraction bits in float32's range, as a
    TF32 matmul reads its operands."""
    x32 = x.to(torch.float32)
    bits = x32.view(torch.int32)
    rounded = ((bits + 0x0FFF + ((bits >> 13) & 1)) & ~0x1FFF).view(torch.float32)
    return torch.where(torch.isfinite(x32), rounded, x32).to(x.dtype)


def moved_inputs(config, seed: int, ulps: float = FLOAT32_MOVE_ULPS) -> Callable[[torch.Tensor], torch.Tensor]:
    """The inputs (exact, float64) as a correct implementation under ``config`` may as well have
    seen them: rounded to the dtype autocast computes in, or to TF32; elsewhere each moved by a
    random +-``ulps`` ULPs of float32 (seeded), the backward error of float32 arithmetic inside
    (negligible next to a 16-bit output's rounding)."""
    if getattr(config, "autocast_dtype", None) is not None:
        dtype = config.autocast_dtype
        return lambda t: t.to(dtype).to(torch.float64)
    if getattr(config, "tf32", False):
        return lambda t: round_to_tf32(t.to(torch.float32)).to(torch.float64)
    g = torch.Generator().manual_seed(seed)
    spread = ulps * 2.0 ** -23
    return lambda t: t * (1 + spread * (2 * torch.rand(t.shape, generator=g, dtype=torch.float64) - 1))
