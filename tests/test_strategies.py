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


def test_profile_drops_the_deadline_under_the_interpreter_and_cuda(monkeypatch):
    """The decision itself (settings are recorded, not registered: the profile inherits the
    profile loaded when it is registered, here the test session's, which has no deadline)."""
    import pytest_precision.strategies as strategies

    class Recorder:
        def __init__(self):
            self.profiles = {}

        def register_profile(self, name, **kw):
            self.profiles[name] = kw

    rec = Recorder()
    monkeypatch.setattr(strategies, "settings", rec)
    for cuda, interpreter in ((False, False), (False, True), (True, False)):
        monkeypatch.setattr(strategies.torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setenv("TRITON_INTERPRET", "1" if interpreter else "0")
        strategies.register_profile(f"p-{cuda}-{interpreter}")
    assert "deadline" not in rec.profiles["p-False-False"]  # Hypothesis's own 200 ms
    assert rec.profiles["p-False-True"]["deadline"] is None
    assert rec.profiles["p-True-False"]["deadline"] is None


def test_profile_reads_triton_interpret_from_the_environment():
    """In a fresh process, from Hypothesis's default profile (on CI Hypothesis loads its own ci
    profile, which has no deadline, and the profile registered on top of it inherits that)."""
    import os
    import subprocess
    import sys

    code = ("import torch; from hypothesis import settings; settings.load_profile('default'); "
            "from pytest_precision.strategies import PROFILE; "
            "print(torch.cuda.is_available(), settings.get_profile(PROFILE).deadline)")
    seen = {}
    for value in ("1", "0"):
        env = {**os.environ, "TRITON_INTERPRET": value}
        seen[value] = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                     check=True).stdout.split()
    assert seen["1"][1] == "None"
    assert seen["0"][1] == ("None" if seen["0"][0] == "True" else "0:00:00.200000")


SLOW_GIVEN_TESTS = """
import time
from hypothesis import given, settings, strategies as st
from pytest_precision.strategies import PROFILE

@given(st.just(0))  # one example, nothing to shrink
def test_plain(i):
    time.sleep(0.3)

@settings(settings.get_profile(PROFILE))
@given(st.just(0))
def test_opted_in(i):
    time.sleep(0.3)
"""


def test_users_given_tests_opt_in_to_the_profile(pytester, monkeypatch):
    """What the README says: importing the strategies registers the profile but does not load it,
    so a user's @given test keeps Hypothesis's 200 ms deadline under the interpreter unless it
    opts in; --hypothesis-profile works once a conftest.py has imported the strategies. The
    conftest loads Hypothesis's default profile first, as off CI (on CI Hypothesis loads its own
    ci profile, which has no deadline)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytester.makeconftest("from hypothesis import settings\nsettings.load_profile('default')\n"
                          "import pytest_precision.strategies  # noqa: E402,F401\n")
    pytester.makepyfile(test_slow=SLOW_GIVEN_TESTS)
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    r.assert_outcomes(passed=1, failed=1)
    r.stdout.fnmatch_lines(["*test_plain*DeadlineExceeded*"])
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--hypothesis-profile=pytest-precision")
    r.assert_outcomes(passed=2)
