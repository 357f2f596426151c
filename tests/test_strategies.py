"""strategies: every drawn value is representable in its dtype, regimes do what they say."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_precision.strategies import (
    LOGIT_REGIMES, attention_inputs, exp_overflow_threshold, exp_underflow_threshold, logits, representable)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
IDS = ["fp32", "fp16", "bf16", "e4m3", "e5m2"]


def _representable(x: torch.Tensor, dtype) -> bool:
    finite = x[torch.isfinite(x)].to(torch.float64)
    return bool((finite.to(dtype).to(torch.float64) == finite).all())


def test_thresholds():
    assert exp_overflow_threshold(torch.float16) == pytest.approx(11.09, abs=0.01)
    t = exp_overflow_threshold(torch.float16)
    assert torch.tensor(t - 0.001).exp().half().isfinite() and torch.tensor(t + 0.01).exp().half().isinf()
    assert torch.tensor(exp_underflow_threshold(torch.float16) - 0.01).exp().half() == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_logits_are_representable(dtype):
    @settings(max_examples=60)
    @given(logits(dtype))
    def check(x):
        assert x.dtype == (torch.float32 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else dtype)
        assert x.dim() == 2 and x.numel() >= 1
        assert _representable(x, dtype)
        assert not torch.isnan(x).any()

    check()


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_representable_floats(dtype):
    @settings(max_examples=200)
    @given(representable(dtype, -1000, 1000))
    def check(v):
        assert float(torch.tensor(v, dtype=torch.float64).to(dtype).double()) == v

    check()


@pytest.mark.parametrize("regime", [r for r in LOGIT_REGIMES if r != "long"])
def test_each_regime(regime):
    @settings(max_examples=30)
    @given(logits(torch.float16, regimes=(regime,), mixed_scales=False))
    def check(x):
        if regime == "overflow":
            assert (x >= exp_overflow_threshold(torch.float16) - 1.01).all()
        elif regime == "underflow":
            assert (x.float().exp().half() == 0).all()
        elif regime == "flat":
            assert (x == x[:, :1]).all()
        elif regime == "subnormal":
            assert (x.abs() <= 2**-14).all()

    check()


def test_fully_masked_rows_and_long_rows_are_drawn():
    seen = {"fully_masked": False, "long": False}

    @settings(max_examples=200)
    @given(logits(torch.float32, regimes=("masked", "long")))
    def check(x):
        if x.shape[1] >= 1000:
            seen["long"] = True
        elif torch.isinf(x).all(dim=-1).any():
            seen["fully_masked"] = True

    check()
    assert all(seen.values()), seen


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn], ids=["fp16", "bf16", "e4m3"])
def test_attention_inputs(dtype):
    @settings(max_examples=25)
    @given(attention_inputs(dtype))
    def check(a):
        b, h, sq, d = a.q.shape
        assert a.k.shape == a.v.shape and a.k.shape[0] == b and a.k.shape[3] == d
        assert h % a.k.shape[1] == 0
        for t in (a.q, a.k, a.v):
            assert _representable(t, dtype)
        if a.key_padding_mask is not None:
            assert a.key_padding_mask.shape == (b, a.k.shape[2])
            assert (~a.key_padding_mask).any(dim=-1).all()  # at least one key kept per batch

    check()


def test_attention_inputs_irregular_sizes_reachable():
    sizes = set()

    @settings(max_examples=150)
    @given(attention_inputs(torch.float32, gqa=True))
    def check(a):
        sizes.add(a.q.shape[-1])
        sizes.add(("gqa", a.gqa))

    check()
    assert {59, 111, ("gqa", True)} <= sizes
