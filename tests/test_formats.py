"""formats: format facts, and ulp_distance proven against a bit-level step count."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from pytest_precision.numerics.formats import FORMATS, format_of, ordinal, ulp, ulp_distance

PAIRS = 100_000  # per dtype, as Hypothesis examples of up to 1000 pairs
BYTES_PER_DRAW = 2000  # two draws per example stay well inside Hypothesis's 8 KiB buffer
EXAMPLES = 100

INT_OF = {8: (np.uint8, torch.uint8), 16: (np.uint16, torch.int16), 32: (np.uint32, torch.int32), 64: (np.uint64, torch.int64)}
DTYPES = list(FORMATS)


def test_format_facts():
    f16, bf16, e4m3, e5m2 = (FORMATS[d] for d in (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2))
    assert (f16.max, f16.smallest_normal, f16.smallest_subnormal, f16.mantissa_bits) == (65504.0, 2**-14, 2**-24, 10)
    assert (bf16.mantissa_bits, bf16.max) == (7, float(torch.finfo(torch.float32).max) * (1 - 2**-8) / (1 - 2**-24))
    assert (e4m3.max, e4m3.smallest_normal, e4m3.smallest_subnormal, e4m3.mantissa_bits, e4m3.has_inf) == (448.0, 2**-6, 2**-9, 3, False)
    assert (e5m2.max, e5m2.mantissa_bits) == (57344.0, 2)
    assert FORMATS[torch.float64].smallest_subnormal == 5e-324
    with pytest.raises(ValueError, match="no floating-point format facts for torch.int32"):
        format_of(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES, ids=[FORMATS[d].name for d in DTYPES])
def test_ulp_at_value(dtype):
    f = FORMATS[dtype]
    x = torch.tensor([1.0, 1.5, 0.0, f.smallest_subnormal, f.smallest_normal, f.max, -2.0], dtype=torch.float64)
    want = [2.0**-f.mantissa_bits, 2.0**-f.mantissa_bits, f.smallest_subnormal, f.smallest_subnormal,
            f.smallest_subnormal, 2.0 ** (f.emax - f.mantissa_bits), 2.0 ** (1 - f.mantissa_bits)]
    assert ulp(x, dtype).tolist() == want
    assert math.isnan(float(ulp(torch.tensor([math.inf]), dtype)[0]))


def _bits_tensor(raw: bytes, fmt) -> torch.Tensor:
    """Hypothesis-drawn bytes viewed as bit patterns of the format (unsigned, in int64)."""
    np_int, _ = INT_OF[fmt.bits]
    arr = np.frombuffer(raw, dtype=np_int)
    return arr


def _finite_mask(bits: np.ndarray, fmt) -> np.ndarray:
    nbits = fmt.bits
    mag = bits & np.array((1 << (nbits - 1)) - 1, dtype=bits.dtype)
    if fmt.has_inf:
        return (mag >> np.array(fmt.mantissa_bits, dtype=bits.dtype)) != (1 << (nbits - 1 - fmt.mantissa_bits)) - 1
    return mag != (1 << (nbits - 1)) - 1  # e4m3fn: only S.1111.111 is NaN


def _keys(bits: np.ndarray, fmt) -> list[int]:
    """Bit-level ordinal: sign-magnitude integer, so adjacent representable values differ by 1."""
    return [_key(int(b), fmt.bits) for b in bits]


def _key(b: int, nbits: int) -> int:
    mag = b & ((1 << (nbits - 1)) - 1)
    return -mag if b >> (nbits - 1) else mag


def _as_tensor(bits, fmt) -> torch.Tensor:
    np_int, t_int = INT_OF[fmt.bits]
    arr = np.ascontiguousarray(np.asarray(bits, dtype=np_int))
    return torch.from_numpy(arr.view(np.int8 if fmt.bits == 8 else arr.dtype.str.replace("u", "i"))).view(fmt.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=[FORMATS[d].name for d in DTYPES])
def test_ulp_distance_matches_bit_count(dtype):
    fmt = FORMATS[dtype]
    per_example = min(1000, BYTES_PER_DRAW * 8 // fmt.bits)
    examples = PAIRS // per_example
    nbytes = per_example * fmt.bits // 8
    raw = st.binary(min_size=nbytes, max_size=nbytes)
    seen = []

    @settings(max_examples=examples)
    @given(a=raw, b=raw)
    def check(a, b):
        ba, bb = _bits_tensor(a, fmt), _bits_tensor(b, fmt)
        keep = _finite_mask(ba, fmt) & _finite_mask(bb, fmt)
        ba, bb = ba[keep], bb[keep]
        want = [abs(x - y) for x, y in zip(_keys(ba, fmt), _keys(bb, fmt))]
        got = ulp_distance(_as_tensor(ba, fmt), _as_tensor(bb, fmt), dtype).tolist()
        seen.append(len(want))
        for g, w in zip(got, want):
            # exact wherever float64 holds the count (all but float64's own widest gaps)
            assert (g == w) if w < 2**53 else math.isclose(g, w, rel_tol=2**-52), (g, w)

    check()
    assert sum(seen) >= 0.9 * PAIRS, sum(seen)  # NaN/inf patterns dropped, the rest checked


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float64], ids=lambda d: FORMATS[d].name)
def test_ulp_distance_fractional_reference(dtype):
    """A float64 reference between two neighbours counts fractional steps from each side."""
    fmt = FORMATS[dtype]
    max_bits = _key(int(_bits_of(fmt.max, fmt)), fmt.bits)

    # 200 pairs per example from a drawn seed (drawing 800 integers one by one took 8 s a dtype),
    # the first four at the edges: the smallest and largest magnitudes, both signs, fractions 0 and 1023/1024
    @settings(max_examples=EXAMPLES)
    @given(seed=st.integers(0, 2**32 - 1))
    def check(seed):
        rng = np.random.default_rng(seed)
        a = [0, 0, max_bits - 1, max_bits - 1, *rng.integers(0, max_bits, 196).tolist()]
        out = [-max_bits, max_bits, 0, -max_bits, *rng.integers(-max_bits, max_bits + 1, 196).tolist()]
        t = [0, 1023, 0, 1023, *rng.integers(0, 1024, 196).tolist()]
        neg = [False, True, True, False, *(rng.integers(0, 2, 196) == 1).tolist()]
        lo = _as_tensor(a, fmt).to(torch.float64)
        hi = _as_tensor([x + 1 for x in a], fmt).to(torch.float64)
        frac = torch.tensor(t, dtype=torch.float64) / 1024
        sign = torch.tensor([-1.0 if n else 1.0 for n in neg], dtype=torch.float64)
        ref = sign * (lo + frac * (hi - lo))
        out_bits = [(1 << (fmt.bits - 1)) | -k if k < 0 else k for k in out]
        want = [abs(o - s * (x + f)) for o, s, x, f in zip(out, sign.tolist(), a, frac.tolist())]
        got = ulp_distance(_as_tensor(out_bits, fmt), ref, dtype).tolist()
        # the first difference only: pytest's diff of two 200-element lists, on every failing call
        # while Hypothesis shrinks, took minutes
        bad = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
        assert bad is None, f"pair {bad}: out bits {out_bits[bad]:#x}, ref {ref[bad].item()!r}: {got[bad]} ULP, want {want[bad]}"

    check()


def _bits_of(value: float, fmt) -> int:
    np_int, t_int = INT_OF[fmt.bits]
    t = torch.tensor([value], dtype=torch.float64).to(fmt.dtype)
    return int(t.view(t_int if fmt.bits != 8 else torch.uint8).to(torch.int64)[0]) & ((1 << fmt.bits) - 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=[FORMATS[d].name for d in DTYPES])
def test_ulp_distance_special_values(dtype):
    f = FORMATS[dtype]
    s = f.smallest_subnormal
    inf, nan = math.inf, math.nan
    out = torch.tensor([0.0, -0.0, s, -s, s, inf, -inf, nan, nan, 1.0, inf, f.max], dtype=torch.float64)
    ref = torch.tensor([-0.0, 0.0, 0.0, s, 2 * s, inf, inf, nan, 1.0, nan, f.max, -f.max], dtype=torch.float64)
    steps = ordinal(torch.tensor([f.max], dtype=torch.float64), dtype).item()
    want = [0, 0, 1, 2, 1, 0, inf, 0, inf, inf, inf, 2 * steps]
    assert ulp_distance(out, ref, dtype).tolist() == want


def test_ulp_distance_runs_on_the_inputs_device_and_checks_shapes():
    d = ulp_distance(torch.ones(3, dtype=torch.float16), torch.ones(3, dtype=torch.float64))
    assert d.device == torch.ones(1).device and d.dtype == torch.float64
    with pytest.raises(ValueError, match=r"shape mismatch, out \(3,\) vs ref \(4,\)"):
        ulp_distance(torch.ones(3), torch.ones(4))
