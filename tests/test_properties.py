"""Property helpers: each holds for a correct implementation and catches a planted defect; calls
with swapped arguments raise; the sum-to-one bound is measured against correct softmaxes and the
issue's defects; and a Hypothesis test written only with the public API finds and shrinks the
fp16 overflow."""
import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, find, given, settings

from pytest_precision.kinds.outcome import PrecisionFailure
from pytest_precision.numerics.inputs import seeded_normal
from pytest_precision.properties import (
    attention_causal_ignores_future, attention_key_permutation_equivariant, attention_output_in_value_range,
    softmax_in_unit_interval, softmax_masked_positions_zero, softmax_order_preserved, softmax_rows_sum_to_one,
    softmax_shift_invariant)
from pytest_precision.strategies import LOGIT_REGIMES, logits

pytest_plugins = ["pytester"]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]
DRAWN = settings(max_examples=40, derandomize=True, database=None, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def good_softmax(x):
    return torch.softmax(x, -1)


def via_fp32(x):
    return torch.softmax(x.float(), -1).to(x.dtype)


def naive_softmax(x):
    e = x.exp()
    return e / e.sum(-1, keepdim=True)


def ops_in_dtype(x):
    """Max-subtracting, but the exps and their sum are rounded to x's dtype on the way."""
    e = (x - x.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


def clamped_softmax(x):
    """Clamps logits at 80 before the softmax (an fp32 overflow guard that changes the result)."""
    return torch.softmax(x.clamp(max=80.0), -1)


def scaled(x, factor):
    """The exact softmax times ``factor``, rounded once to x's dtype: rows summing to ``factor``."""
    return (torch.softmax(x.double(), -1) * factor).to(x.dtype)


def normal(rows, cols, scale, dtype, seed=0):
    return seeded_normal(torch.Generator().manual_seed(seed), rows, cols, scale=scale, dtype=dtype)


def sdpa(q, k, v, causal=False):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])


def off_by_one_causal(q, k, v, causal=False):
    s = q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).tril(1).logical_not(), -math.inf)  # sees key i+1
    return (s.softmax(-1) @ v.float()).to(q.dtype)


# ---- sum to one ------------------------------------------------------------------------------

def test_rows_sum_to_one():
    x = normal(8, 100, 5.0, torch.float32)
    assert softmax_rows_sum_to_one(good_softmax(x), x)
    v = softmax_rows_sum_to_one(good_softmax(x) * 1.01, x)
    assert not v and "worst row sums to" in v.message()
    with pytest.raises(PrecisionFailure, match="softmax rows sum to 1: VIOLATED"):
        v.assert_ok()


@pytest.mark.parametrize("with_logits", [True, False], ids=["logits", "no-logits"])
def test_sum_bound_catches_the_issue_examples(with_logits):
    """The old budget (1 + n/2 ULPs) passed both."""
    x16 = normal(8, 1000, 3.0, torch.float16)
    v = softmax_rows_sum_to_one(scaled(x16, 1.2), x16 if with_logits else None)
    assert not v and v.error > 200 > v.budget  # 0.2 is 205 fp16 ULPs at 1.0
    x32 = normal(8, 8192, 3.0, torch.float32)
    v = softmax_rows_sum_to_one((good_softmax(x32).double() * 1.0004).float(), x32 if with_logits else None)
    assert not v and v.error > 3300 and v.budget < 1100  # 4e-4 is 3356 fp32 ULPs; the bound 1036


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_sum_bound_catches_one_part_in_a_thousand(dtype):
    """Every row of 1000 N(0, 1) logits summing to 1 + 1e-3 fails in every dtype when the logits
    are given, and its correct twin passes. Without the logits the worst-case bound still catches
    it in fp32 and fp16, not in bf16, whose rounding alone may move such a row by 2e-3."""
    x = normal(8, 1000, 1.0, dtype, seed=7)
    eps = torch.finfo(dtype).eps  # the spacing at 1.0
    for i in range(8):
        row = x[i:i + 1]
        good = softmax_rows_sum_to_one(scaled(row, 1.0), row)
        bad = softmax_rows_sum_to_one(scaled(row, 1.001), row)
        assert good and not bad, (good.message(), bad.message())
        assert bad.budget * eps < 3e-4  # in absolute terms
    free = softmax_rows_sum_to_one(scaled(x, 1.001))
    if dtype == torch.bfloat16:
        assert free and free.budget * eps > 2e-3
    else:
        assert not free


def test_sum_bound_with_logits_where_few_probabilities_carry_the_row():
    """Logits of scale 3: a few probabilities near 0.3 carry each row, and their own bf16 rounding
    moves a row by up to 1.7e-3, so the bound follows; the planted 1e-3 still shows in some rows."""
    x = normal(8, 1000, 3.0, torch.bfloat16, seed=7)
    assert softmax_rows_sum_to_one(scaled(x, 1.0), x)
    assert not softmax_rows_sum_to_one(scaled(x, 1.001), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("n", [8192, 32768])
@pytest.mark.parametrize("impl", [good_softmax, via_fp32], ids=["torch", "fp32-then-round"])
def test_sum_bound_holds_for_correct_softmax_on_long_rows(dtype, n, impl):
    for scale in (1.0, 5.0, 20.0):
        x = normal(4, n, scale, dtype, seed=n)
        p = impl(x)
        for lg in (x, None):
            v = softmax_rows_sum_to_one(p, lg)
            assert v, v.message()


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_sum_bound_holds_on_drawn_logits(dtype):
    """Every regime, long rows included; Hypothesis climbs the worst ratio of error to bound."""
    @DRAWN
    @given(logits(dtype, regimes=LOGIT_REGIMES))
    def check(x):
        for impl in (good_softmax, via_fp32):
            v = softmax_rows_sum_to_one(impl(x), x)
            assert v, v.message()

    check()


def test_sum_bound_working_dtype():
    """A softmax that rounds its exps and their sum to fp16 is off by more than one rounding:
    the default bound (fp32 arithmetic inside) fails it, working_dtype=float16 judges it as what
    it is; the planted 1.2 fails either way."""
    x = normal(16, 100, 5.0, torch.float16, seed=3)
    assert not softmax_rows_sum_to_one(ops_in_dtype(x), x)
    assert softmax_rows_sum_to_one(ops_in_dtype(x), x, working_dtype=torch.float16)
    assert softmax_rows_sum_to_one(ops_in_dtype(x), working_dtype=torch.float16)
    assert not softmax_rows_sum_to_one(scaled(x, 1.2), x, working_dtype=torch.float16)


def test_sum_bound_fixed_budget_and_skipped_rows():
    x = normal(2, 64, 1.0, torch.float32)
    p = good_softmax(x).double()
    p[0] *= 1 + 50 * 2.0 ** -23  # 50 ULPs at 1.0
    p = p.float()
    assert softmax_rows_sum_to_one(p, x, ulp_budget=60)
    assert not softmax_rows_sum_to_one(p, x, ulp_budget=40)
    x[1, 3] = math.inf  # softmax of a row holding +inf is NaN (inf - inf): skipped, as fully masked rows
    q = good_softmax(x)
    assert torch.isnan(q[1]).all() and softmax_rows_sum_to_one(q, x) and softmax_in_unit_interval(q, x)
    assert not softmax_rows_sum_to_one(q)  # without the logits nothing says the row is undefined


def test_same_helper_twice_in_one_example():
    """Hypothesis refuses a target label twice in one example; the helpers number their calls."""
    @settings(max_examples=5, database=None)
    @given(logits(torch.float16))
    def check(x):
        softmax_in_unit_interval(good_softmax(x), x)
        softmax_in_unit_interval(via_fp32(x), x)

    check()


# ---- shift invariance ------------------------------------------------------------------------

def test_shift_invariance_with_explicit_c():
    x = (torch.randint(-32, 32, (4, 64), generator=torch.Generator().manual_seed(0)) / 4).to(torch.float16)
    assert softmax_shift_invariant(good_softmax, x, 8.0)  # quarter steps: x + 8 stays exact
    assert not softmax_shift_invariant(naive_softmax, x, 8.0)  # exp(x + 8) overflows fp16
    with pytest.raises(ValueError, match=r"not exact in torch.float32 at 1 element\(s\), first at \(1,\).*c=None"):
        softmax_shift_invariant(good_softmax, torch.tensor([1.0, 2.0 ** -20]), 1000.0)


def test_shift_invariance_picks_exact_shifts_itself():
    x32 = torch.tensor([[3.0, 1.0, -2.5, 0.0], [79.0, 78.0, 70.0, 75.5]])
    v = softmax_shift_invariant(good_softmax, x32)
    assert v and v.error == 0 and "up 128, down 128" in v.detail, v.message()
    assert not softmax_shift_invariant(naive_softmax, x32)  # exp(3 + 128) overflows
    caught = softmax_shift_invariant(clamped_softmax, x32)  # row 2 + 128 is clamped
    assert not caught and caught.error > 1000
    x16 = (torch.randint(-32, 32, (4, 64), generator=torch.Generator().manual_seed(0)) / 4).to(torch.float16)
    assert softmax_shift_invariant(good_softmax, x16)
    assert not softmax_shift_invariant(naive_softmax, x16)  # shifted by 16: exp overflows fp16


def test_shift_invariance_leaves_out_rows_without_an_exact_shift():
    x = torch.tensor([[1e4, 1e-30, 0.5], [1.0, 2.0, 3.0]])
    v = softmax_shift_invariant(good_softmax, x)
    assert v and "2 of 4 row shifts impossible" in v.detail, v.message()
    assert not softmax_shift_invariant(clamped_softmax, x * 20)  # the second row still moves


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_shift_invariance_on_drawn_logits(dtype):
    """No filtering, so no health check; Hypothesis's own checks are left on here."""
    @settings(max_examples=60, derandomize=True, database=None, deadline=None, suppress_health_check=())
    @given(logits(dtype))
    def check(x):
        v = softmax_shift_invariant(good_softmax, x)
        assert v, v.message()

    check()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_shift_invariance_finds_defects_in_drawn_logits(dtype):
    cfg = settings(max_examples=200, database=None, derandomize=True)
    defects = [naive_softmax] + ([clamped_softmax] if dtype == torch.float32 else [])
    for defect in defects:
        x = find(logits(dtype), lambda x: not softmax_shift_invariant(defect, x), settings=cfg)
        assert x.numel() <= 2, x  # shrunk
        assert softmax_shift_invariant(good_softmax, x), x  # the input is fair: a correct softmax holds


# ---- order, masks, unit interval, argument checks ---------------------------------------------

def test_order_preserved():
    x = normal(4, 64, 1.0, torch.float32)
    assert softmax_order_preserved(good_softmax(x), x)
    assert not softmax_order_preserved(good_softmax(-x), x)


def test_masked_positions_and_unit_interval():
    x = normal(4, 16, 1.0, torch.float32)
    x[:, ::3] = -math.inf
    x[2] = -math.inf  # fully masked: NaN by rule, skipped
    p = good_softmax(x)
    assert softmax_masked_positions_zero(p, x) and softmax_in_unit_interval(p, x)
    leaky = torch.where(torch.isneginf(x), torch.full_like(p, 1e-9), p)
    assert not softmax_masked_positions_zero(leaky, x)
    assert not softmax_in_unit_interval(p * 5, x)
    assert not softmax_in_unit_interval(naive_softmax(torch.full((1, 4), 12.0, dtype=torch.float16)))


@pytest.mark.parametrize("helper", [softmax_order_preserved, softmax_masked_positions_zero, softmax_in_unit_interval,
                                    softmax_rows_sum_to_one])
def test_swapped_arguments_raise(helper):
    x = normal(4, 16, 3.0, torch.float32)
    x[:, 1] = -math.inf
    x[3] = -math.inf  # a fully masked row: its softmax is NaN, which must not hide the swap
    p = good_softmax(x)
    assert helper(p, x)
    with pytest.raises(ValueError, match=rf"{helper.__name__}: `probs` has values outside \[0, 1\] .*"
                                         "pass the softmax output first, then the logits"):
        helper(x, p)
    with pytest.raises(ValueError, match=rf"{helper.__name__}: `probs` looks like log-probabilities"):
        helper(torch.log_softmax(x[:3], -1), x[:3])
    with pytest.raises(ValueError, match="shape"):
        helper(p, x[:, :8])


def test_swap_check_does_not_hide_a_violation():
    """Negative outputs on ordinary logits are the property's violation, not an argument error."""
    x = normal(4, 16, 3.0, torch.float32)
    broken = good_softmax(x) - 0.01
    assert not softmax_in_unit_interval(broken, x)
    assert not softmax_order_preserved(good_softmax(-x) - 0.5, x)


def test_callables_first():
    x = normal(2, 8, 1.0, torch.float32)
    with pytest.raises(TypeError, match="softmax_shift_invariant: `softmax` must be the function.*look swapped"):
        softmax_shift_invariant(x, good_softmax)
    q = k = v = normal(1, 8, 1.0, torch.float32).reshape(1, 1, 2, 4)
    with pytest.raises(TypeError, match="attention_key_permutation_equivariant: `attention` must be the function"):
        attention_key_permutation_equivariant(q, k, v, sdpa)
    with pytest.raises(TypeError, match="attention_causal_ignores_future: `attention` must be the function"):
        attention_causal_ignores_future(q, k, v, sdpa)


def test_attention_properties_hold_for_sdpa_and_catch_defects():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 32, generator=g) for _ in range(3))
    assert attention_key_permutation_equivariant(sdpa, q, k, v)
    assert not attention_key_permutation_equivariant(lambda q, k, v, causal: sdpa(q, k, v.flip(-2)), q, k, v)
    assert attention_output_in_value_range(sdpa(q, k, v), v)
    assert attention_output_in_value_range(sdpa(q, k, v, causal=True), v, causal=True)
    assert not attention_output_in_value_range(sdpa(q, k, v * 2), v)
    assert attention_causal_ignores_future(sdpa, q, k, v)
    v_ = attention_causal_ignores_future(off_by_one_causal, q, k, v)
    assert not v_ and "query rows changed by future keys: [7]" in v_.message()
    v_long = torch.randn(1, 2, 24, 32, generator=g)
    with pytest.raises(ValueError, match="attention_output_in_value_range: key_padding_mask"):
        attention_output_in_value_range(sdpa(q, k, v), v, key_padding_mask=torch.zeros(1, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="pass the attention output first"):
        attention_output_in_value_range(v_long[:, :1], sdpa(q, k, v))


# ---- Hypothesis, end to end ------------------------------------------------------------------

def test_public_api_finds_and_shrinks_the_fp16_overflow():
    """find() shrinks to one short row; restricted to the overflow-side regimes, the row must overflow exp
    (with every regime the shrinker may as well land on the underflow side, a 0 / 0)."""
    def broken(x):
        return not softmax_in_unit_interval(naive_softmax(x), x)

    x = find(logits(torch.float16, regimes=("normal", "overflow", "peak")), broken, settings=settings(max_examples=100, database=None, derandomize=True))
    assert x.shape[0] == 1 and x.shape[1] <= 3, x
    assert float(x.max()) > 11.09  # past fp16's exp overflow


def test_given_test_reports_overflow_counterexample(pytester):
    pytester.makepyfile("""
import torch
from hypothesis import given, settings
from pytest_precision.strategies import logits
from pytest_precision.properties import softmax_rows_sum_to_one

def naive(x):
    e = x.exp()
    return e / e.sum(-1, keepdim=True)

@settings(derandomize=True, database=None)
@given(logits(torch.float16))
def test_naive(x):
    softmax_rows_sum_to_one(naive(x), x).assert_ok()
""")
    r = pytester.runpytest("-p", "no:cacheprovider")
    r.assert_outcomes(failed=1)
    # shrunk to one logit that is lost in fp16's exp (here the underflow side: 0 / 0). Hypothesis's own
    # header line changed between versions ("Falsifying example" / "Failing test case"): not matched.
    r.stdout.fnmatch_lines(["*softmax rows sum to 1: VIOLATED: ULP inf*", "*worst row sums to nan (1 elements)*",
                            "*x=tensor([[][[]*[]][]], dtype=torch.float16)*"])


README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_property_snippet() -> str:
    text = README.read_text()
    section = text[text.index("### Property tests with extreme inputs"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_property_snippet_runs(pytester):
    """The README's example, with a correct softmax and attention plugged in, passes; with a
    softmax that skips the max subtraction, it fails."""
    head = """
import torch
import torch.nn.functional as F

def my_attention(q, k, v, causal=False):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])

"""
    snippet = _readme_property_snippet()
    pytester.makepyfile(test_good=head + "def my_softmax(x):\n    return torch.softmax(x, -1)\n" + snippet)
    pytester.makepyfile(test_bad=head + "def my_softmax(x):\n    e = x.exp()\n    return e / e.sum(-1, keepdim=True)\n"
                        + snippet)
    r = pytester.runpytest("-p", "no:cacheprovider", "test_good.py")
    r.assert_outcomes(passed=snippet.count("def test_"))
    r = pytester.runpytest("-p", "no:cacheprovider", "test_bad.py")
    assert r.parseoutcomes().get("failed", 0) >= 1 and "VIOLATED" in r.stdout.str()
