"""Hypothesis strategies for extreme softmax and attention inputs, for every dtype of the matrix.

Hypothesis draws Python floats (at most 64, 32 or 16 bits wide); bfloat16 and fp8 values are
drawn as float32 and rounded to the dtype, so every value a strategy returns is representable in
the dtype it was asked for. Tensors come back in that dtype, except fp8: torch cannot compute in
fp8, so fp8 draws come back as float32 tensors holding fp8-representable values.

Small rows are drawn element by element, so a failing example shrinks to a short row of simple
values (one row, one logit of 11.1, say). Long rows and attention tensors are filled from a drawn
seed: too many values for Hypothesis to draw one by one, and the shape still shrinks.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import settings, strategies as st

from .platform.devices import interpret_requested
from .numerics.formats import format_of
from .numerics.inputs import seeded_normal

__all__ = [
    "LOGIT_REGIMES", "DEFAULT_LOGIT_REGIMES", "exp_overflow_threshold", "exp_underflow_threshold", "representable", "logits",
    "AttentionInputs", "attention_inputs", "build_attention_inputs", "register_profile", "PROFILE",
]

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
LOGIT_REGIMES = ("normal", "overflow", "underflow", "near-ties", "peak", "flat", "masked", "subnormal", "long")
# "long" is opt-in: its rows are filled from a seed, so a failure found there shrinks in shape only
DEFAULT_LOGIT_REGIMES = tuple(r for r in LOGIT_REGIMES if r != "long")
PROFILE = "pytest-precision"


def exp_overflow_threshold(dtype: torch.dtype) -> float:
    """Largest x whose exp is finite in ``dtype`` (fp16: 11.09)."""
    return math.log(format_of(dtype).max)


def exp_underflow_threshold(dtype: torch.dtype) -> float:
    """x below which exp(x) rounds to 0 in ``dtype`` (fp16: -17.3)."""
    return math.log(format_of(dtype).smallest_subnormal / 2)


def _round_to(dtype: torch.dtype, v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float64).to(dtype).to(torch.float64))


def representable(dtype: torch.dtype, min_value: float | None = None, max_value: float | None = None,
                  *, allow_subnormal: bool = True) -> st.SearchStrategy[float]:
    """Finite floats exactly representable in ``dtype``, within [min_value, max_value] when given
    (rounding to the dtype may land one step outside a bound that is not itself representable)."""
    fmt = format_of(dtype)
    lo = -fmt.max if min_value is None else max(min_value, -fmt.max)
    hi = fmt.max if max_value is None else min(max_value, fmt.max)
    width = {torch.float64: 64, torch.float32: 32, torch.float16: 16}.get(dtype, 32)
    lo, hi = _inside(lo, hi, width)
    tiny = float(torch.finfo({64: torch.float64, 32: torch.float32, 16: torch.float16}[width]).tiny)
    spans_subnormals = lo < tiny and hi > -tiny
    base = st.floats(min_value=lo, max_value=hi, allow_nan=False, allow_infinity=False, width=width,
                     allow_subnormal=allow_subnormal if spans_subnormals else None)
    if width == 32 and dtype != torch.float32:  # bf16 and fp8: round the float32 draw
        base = base.map(lambda v: _round_to(dtype, v))
        if not allow_subnormal:
            base = base.filter(lambda v: v == 0 or abs(v) >= fmt.smallest_normal)
    return base


def _inside(lo: float, hi: float, width: int) -> tuple[float, float]:
    """Bounds rounded inwards to floats of ``width`` bits (Hypothesis needs representable bounds)."""
    if width == 64:
        return lo, hi
    npt = np.float16 if width == 16 else np.float32
    a, b = npt(lo), npt(hi)
    if float(a) < lo:
        a = np.nextafter(a, npt(np.inf))
    if float(b) > hi:
        b = np.nextafter(b, npt(-np.inf))
    return float(a), float(b)


def _carrier(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in FP8 else dtype


@st.composite
def _row(draw, dtype: torch.dtype, regime: str, min_size: int, max_size: int) -> list[float]:
    """One row of ``regime`` with a length in [min_size, max_size]: drawn as a list so that
    shrinking deletes elements (the first row fixes the width; later rows are drawn at it)."""
    fmt = format_of(dtype)
    over = exp_overflow_threshold(dtype)
    under = exp_underflow_threshold(dtype)
    rep = lambda lo, hi: representable(dtype, lo, hi)  # noqa: E731
    sized = lambda elements: st.lists(elements, min_size=min_size, max_size=max_size)  # noqa: E731
    if regime == "normal":
        return draw(sized(rep(-8, 8)))
    if regime == "overflow":  # logits at and past exp's overflow point
        return draw(sized(rep(over - 1, min(over + 4, fmt.max))))
    if regime == "underflow":  # every exp underflows unless the max is subtracted
        return draw(sized(rep(max(under - 50, -fmt.max), under)))
    if regime == "near-ties":  # large magnitude, tiny gaps (10.0 against 10.01)
        base = draw(st.sampled_from([10.0, 100.0, 1000.0]))
        return draw(sized(st.sampled_from([_round_to(dtype, base), _round_to(dtype, base + 0.01)])))
    if regime == "peak":  # one sharp logit over a normal row
        row = draw(sized(rep(-2, 2)))
        row[draw(st.integers(0, len(row) - 1))] = draw(rep(min(over, 30.0), min(2 * over, 60.0)))
        return row
    if regime == "flat":
        v = draw(rep(-100, 100))
        return draw(sized(st.just(v)))
    if regime == "masked":  # some -inf, possibly all (a fully masked row)
        return draw(sized(st.one_of(rep(-8, 8), st.just(-math.inf))))
    if regime == "subnormal":
        return draw(sized(rep(-fmt.smallest_normal, fmt.smallest_normal)))
    raise ValueError(f"unknown logit regime {regime!r}; known: {', '.join(LOGIT_REGIMES)}")


@st.composite
def logits(draw, dtype: torch.dtype = torch.float32, *, rows: tuple[int, int] = (1, 4),
           cols: tuple[int, int] = (1, 16), regimes: tuple[str, ...] = DEFAULT_LOGIT_REGIMES,
           long_cols: tuple[int, int] = (1000, 8192), mixed_scales: bool = True) -> torch.Tensor:
    """A (rows, cols) tensor of logits whose rows each follow one of ``regimes`` (combined freely
    across rows), in ``dtype`` (float32 carrying fp8 values for fp8 dtypes).

    Regimes: ``normal``, ``overflow`` (at and past exp's overflow point of the dtype), ``underflow``
    (every exp underflows without max subtraction), ``near-ties``, ``peak``, ``flat``, ``masked``
    (-inf, fully masked rows included), ``subnormal``; and, only when asked for, ``long``
    (``long_cols`` wide, seeded fill).
    ``mixed_scales`` multiplies rows by different powers of two. ``rows`` and ``cols`` are
    (min, max) sizes; rows are drawn as a list so shrinking can delete any of them.
    """
    unknown = set(regimes) - set(LOGIT_REGIMES)
    if unknown or not regimes:
        raise ValueError(f"logits(): unknown regimes {sorted(unknown)}; known: {', '.join(LOGIT_REGIMES)}")
    short = [r for r in regimes if r != "long"]
    # 1 in 10 when mixed with others; on 9, not 0, so shrinking (toward 0) leaves long rows
    if "long" in regimes and (not short or draw(st.integers(0, 9)) == 9):
        n_rows = draw(st.integers(*rows))
        n_cols = draw(st.integers(*long_cols))
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        x = seeded_normal(g, n_rows, n_cols, scale=draw(st.sampled_from([1.0, 5.0, 20.0])))
        return x.to(dtype).to(_carrier(dtype))
    first = draw(st.sampled_from(short).flatmap(lambda r: _row(dtype, r, cols[0], cols[1])))
    n_cols = len(first)
    row = st.sampled_from(short).flatmap(lambda r: _row(dtype, r, n_cols, n_cols))
    data = [first] + draw(st.lists(row, min_size=max(rows[0] - 1, 0), max_size=rows[1] - 1))
    n_rows = len(data)
    x = torch.tensor(data, dtype=torch.float64)
    if mixed_scales and n_rows > 1 and draw(st.booleans()):
        shifts = torch.tensor([draw(st.integers(-4, 4)) for _ in range(n_rows)], dtype=torch.float64)
        x = x * torch.pow(2.0, shifts)[:, None]
    # rounding to the dtype keeps every value representable (scaled values may leave the range: inf)
    return x.to(dtype).to(_carrier(dtype))


@dataclass
class AttentionInputs:
    """q (B, H, S_q, D); k, v (B, H_kv, S_k, D) with H divisible by H_kv (grouped-query heads);
    ``key_padding_mask`` (B, S_k) bool, True where a key is padding; ``q_scale`` the factor q was
    multiplied by (sharper attention as it grows)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool
    key_padding_mask: torch.Tensor | None
    q_scale: float
    seed: int
    # how ``causal`` aligns the mask when S_q != S_k: top-left (key j masked for query i when j > i,
    # torch's is_causal) or bottom-right (j > i + S_k - S_q, torch's causal_lower_right: a single
    # query attends to every key, as in decoding)
    causal_alignment: str = "top-left"
    # what a query row whose keys are all masked returns, by the target's convention (declared
    # ``fully_masked``): "zero" (torch's SDPA), "nan" or "mean" (suites/attention_masks.py)
    fully_masked: str = "zero"

    @property
    def gqa(self) -> bool:
        return self.k.shape[1] != self.q.shape[1]

    def __repr__(self) -> str:  # what Hypothesis prints for a falsifying example
        return (f"AttentionInputs(q={tuple(self.q.shape)}, k={tuple(self.k.shape)}, dtype={self.q.dtype}, "
                f"causal={self.causal}, padded={self.key_padding_mask is not None}, q_scale={self.q_scale}, "
                f"seed={self.seed})")


@st.composite
def attention_inputs(draw, dtype: torch.dtype = torch.float32, *,
                     batch: st.SearchStrategy[int] = st.integers(1, 2),
                     heads: st.SearchStrategy[int] = st.sampled_from([1, 2, 4]),
                     q_len: st.SearchStrategy[int] = st.sampled_from([1, 7, 16, 113]),
                     k_len: st.SearchStrategy[int] = st.sampled_from([1, 9, 16, 203]),
                     head_dim: st.SearchStrategy[int] = st.sampled_from([16, 32, 59, 64, 111]),
                     gqa: bool = True, causal: st.SearchStrategy[bool] = st.booleans(),
                     padding: st.SearchStrategy[bool] = st.booleans(),
                     q_scale: st.SearchStrategy[float] = st.sampled_from([1.0, 10.0, 40.0]),
                     outliers: st.SearchStrategy[bool] = st.booleans()) -> AttentionInputs:
    """Attention inputs with irregular sizes, grouped-query heads, causal and padding masks, a q
    scale that sets how sharp attention is, and value outliers. Tensors in ``dtype`` (float32
    carrying fp8 values for fp8 dtypes)."""
    b, h, sq, sk, d = draw(batch), draw(heads), draw(q_len), draw(k_len), draw(head_dim)
    h_kv = draw(st.sampled_from([x for x in (1, 2, h) if h % x == 0])) if gqa else h
    a = build_attention_inputs(seed=draw(st.integers(0, 2**31 - 1)), batch=b, heads=h, kv_heads=h_kv, q_len=sq,
                               k_len=sk, head_dim=d, causal=draw(causal), padding=draw(padding),
                               q_scale=draw(q_scale), outliers=draw(outliers))
    carrier = _carrier(dtype)
    a.q, a.k, a.v = (t.to(dtype).to(carrier) for t in (a.q, a.k, a.v))
    return a


def build_attention_inputs(*, seed: "int | torch.Generator", batch: int, heads: int, kv_heads: int, q_len: int, k_len: int,
                           head_dim: int, causal: bool = False, padding: bool | str = False, q_scale: float = 1.0,
                           outliers: bool = False, min_keys: int = 1) -> AttentionInputs:
    """Float32 attention inputs from a CPU generator seed, or a CPU generator seeded with one (the
    same bits on every machine): what ``attention_inputs`` draws from and what the attention
    suite's named regimes are made of. ``padding``: True (or "right") pads the end of each batch
    row's keys, "left" their start (a decoder's padded batch: with ``causal``, the padded query
    positions have every key masked); every batch row keeps at least ``min_keys`` keys."""
    if padding not in (False, True, "right", "left"):
        raise ValueError(f"build_attention_inputs: padding={padding!r}: expected False, True, 'right' or 'left'")
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    seed = g.initial_seed()
    q = seeded_normal(g, batch, heads, q_len, head_dim, scale=q_scale)
    k = seeded_normal(g, batch, kv_heads, k_len, head_dim)
    v = seeded_normal(g, batch, kv_heads, k_len, head_dim)
    if outliers:
        idx = torch.randint(0, k_len, (max(1, k_len // 16),), generator=g)
        v[..., idx, :] *= 100.0
    mask = None
    if padding and k_len > 1:
        keep = torch.randint(min(min_keys, k_len), k_len + 1, (batch,), generator=g)
        mask = torch.arange(k_len)[None, :] >= keep[:, None]
        if padding == "left":
            mask = mask.flip(-1)
    return AttentionInputs(q, k, v, causal, mask, q_scale, seed)


def register_profile(name: str = PROFILE) -> str:
    """Register the Hypothesis profile ``name`` (by default ``"pytest-precision"``, which the
    suites use) and return its name: derandomised under CI (the same examples every run), and no
    deadline where calls are slow for reasons other than the code under test: CUDA (first calls
    compile kernels) and Triton's interpreter (``TRITON_INTERPRET=1``: a kernel launch takes
    seconds there).

    Registering does not load it: a ``@given`` test of your own runs under Hypothesis's current
    profile (a 200 ms deadline by default; none on CI, where Hypothesis loads its own ``ci``
    profile) unless it opts in, with ``settings.load_profile(PROFILE)`` or
    ``@settings(settings.get_profile(PROFILE))``. Called once on import, on top of the profile
    loaded then; call it again if the environment changes afterwards.
    """
    kw: dict = {"derandomize": bool(os.environ.get("CI")), "print_blob": True}
    if torch.cuda.is_available() or interpret_requested():
        kw["deadline"] = None
    settings.register_profile(name, **kw)
    return name


register_profile()
