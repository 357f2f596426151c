"""The norm kinds' inputs: :class:`NormInputs`, the seeded regimes of layer_norm and rms_norm (the
same bits on every machine; small, their goldens are committed) and the fresh regime."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pytest_precision.kinds import Plan, Regime, seeded_normal

__all__ = ["NormInputs", "BASE_SEED", "EPS", "ROWS", "COLS", "affine_parameters", "norm_regimes", "fresh_norm_regime"]

BASE_SEED = 20261124
EPS = 1e-5  # torch.nn.LayerNorm's default
ROWS, COLS = 8, 256  # small: goldens (y and two or three gradients per case) are committed


@dataclass
class NormInputs:
    """One case's inputs: ``bias`` is None for rms_norm; ``eps`` is not rounded by configs."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    eps: float = EPS
    # how the target is called: fn(x, weight, bias, eps), or, declared weight=False, fn(x) (with eps= if it
    # takes the keyword); its weight ones and its bias zeros then, for the oracle and the peer
    affine: bool = True
    eps_keyword: bool = False

    def __repr__(self) -> str:  # what Hypothesis prints for a falsifying example
        row = self.x[0, :8].tolist()
        return (f"NormInputs(x={tuple(self.x.shape)}, dtype={self.x.dtype}, eps={self.eps}, "
                f"first row starts {[float(f'{v:.6g}') for v in row]})")


def affine_parameters(g: torch.Generator, n: int, rms: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    # weights near 1 and a small bias, as trained norms have; drawn after x so x's bits do not
    # depend on the kind
    weight = seeded_normal(g, n, scale=0.1, shift=1.0)
    bias = None if rms else seeded_normal(g, n, scale=0.1)
    return weight, bias


def _near_eps_rows(g: torch.Generator, rows: int = ROWS, cols: int = COLS) -> torch.Tensor:
    """Rows centred on 0 whose variance (and mean square) runs from 0.03 eps to 10 eps, and a row
    of zeros, where a norm without eps divides 0 by 0 (the eight spreads in turn, for other
    counts of rows). Centred on 0 so that this regime is about eps alone; the offset regime is
    about cancellation."""
    spread = torch.tensor([0.03, 0.1, 0.3, 1.0, 1.0, 3.0, 10.0, 0.0], dtype=torch.float64).repeat(rows)[:rows, None]
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64) * (spread * EPS).sqrt()
    return x.to(torch.float32)


# The fresh regime (kinds.fresh): one of the fixed regimes' families, on rows and lengths drawn anew
# every run, never the fixed ones (8 or 2 rows; rows of 256 or 8192). Not the offset family: fp8's
# rounding leaves each of its rows constant, so that y and the gradients of x are the bias and 0,
# and on a few rows or columns the weight's and the bias's gradients are within their fp8 budgets of
# a constant too (3 rows of 17: kinds.tensor.contract.degenerate refused the case); nor rows shorter than
# 16 (3 rows of 2 were refused the same way)
FRESH_FAMILIES: dict[str, Callable[[torch.Generator, int, int], torch.Tensor]] = {
    "unit": lambda g, rows, cols: seeded_normal(g, rows, cols),
    "near-eps": _near_eps_rows,
    "scale300": lambda g, rows, cols: seeded_normal(g, rows, cols, scale=300.0),
}


def fresh_norm_regime(seed: int, rms: bool) -> Regime:
    """The fresh regime drawn from ``seed`` (the comment above)."""
    plan = Plan(seed)
    rows, cols = plan.integer(1, 12, avoid=(ROWS, 2)), plan.length(16, 2048, avoid=(COLS, 1000))
    family = plan.choice(tuple(FRESH_FAMILIES))

    def make(g: torch.Generator) -> NormInputs:
        return NormInputs(FRESH_FAMILIES[family](g, rows, cols), *affine_parameters(g, cols, rms))
    return plan.regime(f"{rows} rows of {cols}, valued as the {family} regime's", make, rows=rows, cols=cols,
                       family=family)


def norm_regimes(rms: bool) -> dict[str, Regime]:
    """The seeded regimes of layer_norm (``rms`` False) or rms_norm."""
    def regime(name: str, description: str, make_x: Callable[[torch.Generator], torch.Tensor]) -> Regime:
        def make(g: torch.Generator) -> NormInputs:
            x = make_x(g)
            return NormInputs(x, *affine_parameters(g, x.shape[-1], rms))
        return Regime.from_generator(name, description, make, BASE_SEED)

    return {r.name: r for r in (
        regime("unit", "N(0, 1), 8 x 256", lambda g: seeded_normal(g, ROWS, COLS)),
        # fp32 spacing at 1e4 is 2^-10: E[x^2] - E[x]^2 loses all of the variance 1
        regime("offset", "N(1e4, 1): a mean far above the spread", lambda g: seeded_normal(g, ROWS, COLS, shift=1e4)),
        regime("near-eps", "N(0, s^2), s^2 from 0.03 eps to 10 eps, and a row of zeros", _near_eps_rows),
        regime("long", "rows of 8192", lambda g: seeded_normal(g, 2, 8192)),
        # a row length that is no power of two, as the fresh regime draws: met by a seeded regime first
        regime("len1000", "rows of 1000 (no power of two)", lambda g: seeded_normal(g, ROWS, 1000)),
        # 300^2 = 9e4 > 65504: squares and sums of squares overflow fp16
        regime("scale300", "N(0, 300^2): squares past fp16's max", lambda g: seeded_normal(g, ROWS, COLS, scale=300.0)),
    )}
