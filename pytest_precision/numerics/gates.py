"""Inputs for gated activations (SiLU, SwiGLU, GeGLU): gates drawn across sigmoid's transition
band and where it saturates in each format, for an ``op`` target's ``inputs=``.

A gate drawn as ``randn`` stays within |x| < 4, where ``sigmoid`` is far from 0 and 1 in every
format. What breaks a gated op in 16 bits sits further out: ``sigmoid(x)`` rounds to 1 above
``(mantissa_bits + 2) ln 2`` (bf16 6.2, fp16 8.3, fp32 17.3), where ``1 - sigmoid(x)`` and so
SiLU's derivative ``s (1 + x (1 - s))`` keep no digit of ``e^-x``; below ``ln`` of the smallest
normal it goes subnormal (fp16 -9.7, bf16 and fp32 -87.3), and below ``ln`` of half the smallest
subnormal it flushes to 0 (fp16 -17.3, bf16 -92.9, fp32 -104.0). ``sigmoid_edges`` gives those
points; the regimes draw gates there (``saturated``: every edge mixed; ``fp16-flush`` and the
like: one edge alone, where the gradient's largest value is itself tiny and a digit lost in it
shows against the budget) or across the band between (``band``), with the ``up`` projection
``randn``. Measured (CPU, SwiGLU of (32, 64), no reference declared: the peer is the exact result
rounded): a SiLU backward that keeps sigmoid and its derivative in 16 bits is 11.3 x over the
max-abs budget in fp16 on ``fp16-flush`` (and found by the drawn regime), at most 0.93 of it
elsewhere; in bf16 (fp32's range) at most 0.71. A declared reference written with ``sigmoid``
(``lambda g, u: g * torch.sigmoid(g) * u``) is run in the config as the peer, and its fp16 sigmoid
flushes as the defect's does: that peer does not see it (0.33).

    from pytest_precision.numerics.gates import gate_regimes, gate_strategy

    swiglu = lambda gate, up: F.silu(gate) * up
    pytest_precision.register("swiglu", swiglu, kind="op",
                              inputs={**gate_regimes(64, 256), "drawn": gate_strategy(8, 64)})

Draws are made in float64 and rounded once (the same bits on every CPU), from the generator the
op kind passes (``gated``, ``gate_regimes``) or from a seed Hypothesis draws (``gate_strategy``).

On that SwiGLU the drawn regime finds the 16-bit SiLU backward too (1.07 x over its RMS budget).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .formats import format_of
from .inputs import seeded_normal

__all__ = ["SigmoidEdges", "sigmoid_edges", "GATE_FORMATS", "GATE_REGIMES", "DEFAULT_GATE_REGIMES", "BAND",
           "gate_values", "gated", "gate_regimes", "gate_strategy"]

GATE_FORMATS = (torch.float16, torch.bfloat16, torch.float32)
_SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_EDGES = ("one", "subnormal", "flush")
# band, every edge mixed, and each format's edge alone ("fp16-flush": every gate near where fp16's
# sigmoid flushes, so the gradient's largest value is tiny and a lost digit of it shows)
# bf16 keeps fp32's exponent range: its subnormal edge is fp32's, one regime ("bf16-subnormal")
GATE_REGIMES = ("band", "saturated", *(f"{_SHORT[d]}-{e}" for d in GATE_FORMATS for e in _EDGES
                                       if (d, e) != (torch.float32, "subnormal")))
DEFAULT_GATE_REGIMES = ("band", "saturated", "fp16-flush")
BAND = 6.0  # |x| within which sigmoid rounds to neither 0 nor 1 in any of GATE_FORMATS (bf16 rounds to 1 at 6.24)
SPREAD = 1.0  # the saturated regime's gates lie within this of an edge, on both sides of it


@dataclass(frozen=True)
class SigmoidEdges:
    """Where ``sigmoid`` stops being a number of ``dtype`` away from 0 and 1: it rounds to 1 above
    ``rounds_to_one``, is subnormal below ``subnormal_below`` and flushes to 0 below ``flushes_below``."""

    dtype: torch.dtype
    rounds_to_one: float
    subnormal_below: float
    flushes_below: float

    def points(self) -> tuple[float, float, float]:
        return self.rounds_to_one, self.subnormal_below, self.flushes_below


def sigmoid_edges(dtype: torch.dtype) -> SigmoidEdges:
    """``dtype``'s edges of ``sigmoid``: 1 - sigmoid(x) ~ e^-x falls below half the spacing under 1
    (2^-(mantissa_bits + 2)), and sigmoid(x) ~ e^x below the smallest normal and below half the
    smallest subnormal."""
    fmt = format_of(dtype)
    return SigmoidEdges(dtype, (fmt.mantissa_bits + 2) * math.log(2.0), math.log(fmt.smallest_normal),
                        math.log(fmt.smallest_subnormal / 2))


def _edge_points() -> list[float]:
    """Every edge of every format once (bf16's and fp32's subnormal edges are one point), fp16's first."""
    points: list[float] = []
    for dtype in GATE_FORMATS:
        points += [p for p in sigmoid_edges(dtype).points() if p not in points]
    return points


def _uniform(g: torch.Generator, shape: tuple, low: float, high: float) -> torch.Tensor:
    return low + (high - low) * torch.rand(shape, generator=g, dtype=torch.float64)


def gate_values(g: torch.Generator, *shape: int, regime: str = "band") -> torch.Tensor:
    """float32 gates of ``shape`` from ``g``: ``band``, uniform in [-BAND, BAND]; ``saturated``,
    each within SPREAD of one of GATE_FORMATS' sigmoid edges (every edge about as often, in a
    random order); ``fp16-one``, ``bf16-flush``, ...: all within SPREAD of that edge."""
    if regime not in GATE_REGIMES:
        raise ValueError(f"gate regime {regime!r}: expected one of {', '.join(GATE_REGIMES)}")
    shape = tuple(shape)
    if regime == "band":
        return _uniform(g, shape, -BAND, BAND).to(torch.float32)
    if regime != "saturated":
        fmt, edge = regime.split("-")
        dtype = next(d for d, n in _SHORT.items() if n == fmt)
        centre = sigmoid_edges(dtype).points()[_EDGES.index(edge)]
        return (centre + _uniform(g, shape, -SPREAD, SPREAD)).to(torch.float32)
    points = torch.tensor(_edge_points(), dtype=torch.float64)
    n = math.prod(shape)
    which = torch.randperm(n, generator=g) % len(points)
    return (points[which].reshape(shape) + _uniform(g, shape, -SPREAD, SPREAD)).to(torch.float32)


def gated(*shape: int, regime: str = "band", up: bool = True) -> Callable[[torch.Generator], object]:
    """A generator for ``inputs=``: ``(gate, up)`` of ``shape`` (``up`` drawn N(0, 1) after the
    gate), or the gate alone with ``up=False`` (a plain SiLU)."""
    if regime not in GATE_REGIMES:
        raise ValueError(f"gate regime {regime!r}: expected one of {', '.join(GATE_REGIMES)}")

    def inputs(g: torch.Generator):
        gate = gate_values(g, *shape, regime=regime)
        return (gate, seeded_normal(g, *shape)) if up else gate
    return inputs


def gate_regimes(*shape: int, up: bool = True, regimes=DEFAULT_GATE_REGIMES) -> dict[str, Callable]:
    """``{"gate-band": ..., "gate-saturated": ..., "gate-fp16-flush": ...}``: ``regimes`` as
    generators, to merge into ``inputs=``."""
    return {f"gate-{regime}": gated(*shape, regime=regime, up=up) for regime in regimes}


def gate_strategy(*shape: int, up: bool = True):
    """A Hypothesis strategy for the op kind's drawn regime: one edge of one format (or the band)
    and a seed, giving ``(gate, up)`` of ``shape`` (the gate alone with ``up=False``) whose gates
    lie within SPREAD of that edge. It shrinks toward the band, then fp16's edges."""
    from hypothesis import strategies as st

    centres = [None, *_edge_points()]

    def build(centre, seed: int):
        g = torch.Generator().manual_seed(seed)
        if centre is None:
            gate = gate_values(g, *shape, regime="band")
        else:
            gate = (centre + _uniform(g, tuple(shape), -SPREAD, SPREAD)).to(torch.float32)
        return (gate, seeded_normal(g, *shape)) if up else gate
    return st.builds(build, st.sampled_from(centres), st.integers(0, 2 ** 32 - 1))
