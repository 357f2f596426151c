"""metrics.compare: each count and statistic on hand-made cases."""
import math

import pytest
import torch

from pytest_precision.numerics.metrics import compare


def t(*v, dtype=torch.float64):
    return torch.tensor(v, dtype=dtype)


def test_identical_is_clean():
    x = torch.randn(100, dtype=torch.float32)
    c = compare(x, x.double())
    assert (c.max_ulp, c.max_abs, c.overflow, c.underflow, c.nan) == (0, 0, 0, 0, 0)
    assert c.sqnr_db == math.inf and c.cosine == pytest.approx(1.0)
    assert c.worst == []


def test_overflow_underflow_nan_counts():
    out = t(math.inf, -math.inf, 0.0, math.nan, 0.0, 1.0, dtype=torch.float16)
    ref = t(7e4, -1.0, 1e-4, 2.0, 1e-9, math.nan)  # 1e-9 is below fp16's range: reported, not failed
    c = compare(out, ref)
    assert (c.overflow, c.underflow, c.nan, c.missing_nan) == (2, 1, 1, 1)
    assert c.flushed_subnormal == 0
    assert c.max_ulp == math.inf
    assert c.worst[0]["ulp"] == math.inf


def test_flushed_subnormal_is_reported():
    c = compare(t(0.0, dtype=torch.float16), t(1e-6))  # 1e-6 is an fp16 subnormal
    assert (c.underflow, c.flushed_subnormal) == (0, 1)


def test_log_domain_counts_minus_inf_as_underflow():
    out, ref = t(-math.inf, math.inf, dtype=torch.float32), t(-120.0, 3.0)
    assert (compare(out, ref, log_domain=True).underflow, compare(out, ref, log_domain=True).overflow) == (1, 1)
    assert compare(out, ref).overflow == 2


def test_fp8_saturation_is_overflow_and_ulps_use_the_scale():
    e4m3 = torch.float8_e4m3fn
    c = compare(t(448.0), t(600.0), e4m3)
    assert c.overflow == 1
    # scale 2**-4: 448 * 2**-4 = 28 is e4m3's max after scaling; 28 vs 30 is beyond it
    assert compare(t(28.0), t(30.0), e4m3, scale=2**-4).overflow == 1
    assert compare(t(1.0), t(1.0625), e4m3, scale=1.0).max_ulp == 0.5
    assert compare(t(1.0), t(1.0625), e4m3, scale=2**-4).max_ulp == 0.5


def test_statistics_values():
    ref = t(1.0, 2.0, 4.0)
    out = (ref * (1 + 2**-10)).to(torch.float16)  # one fp16 ULP above at every binade
    c = compare(out, ref)
    assert c.max_ulp == 1 and c.mean_ulp == 1
    assert c.max_rel == pytest.approx(2**-10)
    assert c.max_abs == pytest.approx(4 * 2**-10)
    err = math.sqrt(sum((v * 2**-10) ** 2 for v in (1, 2, 4)))
    assert c.sqnr_db == pytest.approx(20 * math.log10(math.sqrt(21) / err))
    assert c.count_over(0.5) == 3 and c.count_over(1) == 0
    assert sorted(w["index"] for w in c.worst) == [(0,), (1,), (2,)]


def test_worst_elements_point_at_the_defect():
    ref = torch.linspace(0.1, 1.0, 200, dtype=torch.float64).reshape(10, 20)
    out = ref.float().clone()
    out[7, 3] *= 1.01
    c = compare(out, ref)
    assert c.worst[0]["index"] == (7, 3)
    assert "(7, 3)" in c.worst_table()


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match=r"shape mismatch: output \(2,\) vs reference \(3,\)"):
        compare(torch.ones(2), torch.ones(3))


def test_log_probabilities_near_zero_count_steps_at_one():
    """log p = -0.0185 off by one fp32 step at 1.0 (2^-23): 1 ULP as a log-probability (p is off by
    a relative 2^-23), 64 ULP as a plain number of that magnitude."""
    ref = torch.tensor([-0.0185, -3.0], dtype=torch.float64)
    out = (ref + torch.tensor([2.0**-23, 0.0], dtype=torch.float64)).float()
    assert 0.9 < compare(out, ref, torch.float32, log_domain=True).max_ulp < 1.1
    assert compare(out, ref, torch.float32).max_ulp > 60
    far = (ref + torch.tensor([0.0, 2.0**-21], dtype=torch.float64)).float()  # |log p| >= 1: own magnitude
    assert compare(far, ref, torch.float32, log_domain=True).max_ulp == compare(far, ref, torch.float32).max_ulp


def test_statistics_of_non_finite_outputs_are_nan_never_perfect():
    """An all-NaN output is not 0 off with infinite SQNR and cosine 1: what cannot be measured is NaN."""
    ref = torch.softmax(torch.linspace(-2, 2, 64, dtype=torch.float64), -1)
    c = compare(torch.full((64,), math.nan), ref, torch.float32)
    assert c.nan == 64 and c.max_ulp == math.inf
    for name in ("max_abs", "max_rel", "sqnr_db", "cosine", "mean_ulp", "p99_ulp"):
        assert math.isnan(getattr(c, name)), name
    assert "SQNR nan dB, cosine nan" in c.statistics_lines()[1]
    # partly non-finite: element statistics over the finite elements, whole-tensor ones NaN
    out = ref.float().clone()
    out[3] = math.inf
    c = compare(out, ref, torch.float32)
    assert c.overflow == 1 and c.max_abs < 1e-7 and c.mean_ulp < 1
    assert math.isnan(c.sqnr_db) and math.isnan(c.cosine)
    # NaN where the reference is NaN too (an expected NaN) measures nothing wrong
    ref2 = torch.cat([ref, torch.full((4,), math.nan, dtype=torch.float64)])
    c = compare(torch.cat([ref.float(), torch.full((4,), math.nan)]), ref2, torch.float32)
    assert c.sqnr_db > 100 and c.cosine == pytest.approx(1.0)


def test_summary_table_shows_nan_statistics_as_nan():
    from pytest_precision.reporting.summary import summary_rows

    def rec(regime, sqnr, rel):
        return {"target": "t", "config": "fp32", "regime": regime, "max_ulp": math.inf, "max_rel": rel,
                "sqnr_db": sqnr, "overflow": 0, "underflow": 0, "nan": 1, "passed": False, "categories": ["nan"]}
    for order in ([rec("a", math.nan, math.nan), rec("b", 90.0, 1e-6)], [rec("b", 90.0, 1e-6), rec("a", math.nan, math.nan)]):
        row = summary_rows(order, ["fp32"])[0]
        assert row[4:6] == ("nan", "nan"), row


def test_a_zero_within_the_cancellation_floor_is_error_not_underflow():
    """0 where the exact value is 1e-6 (1 + tanh(u) of GELU far below 0 in float32) is within the
    floor a kind sets from the output's conditioning: error, not underflow. 0 where it is 1e-3 lost
    a value, and the counts line says what cancellation would have explained."""
    out, ref = t(0.0, 0.0, 1.0, dtype=torch.float32), t(1e-6, 1e-3, 1.0)
    c = compare(out, ref, underflow_floor=1e-5)
    assert c.underflow == 1 and c.max_abs == pytest.approx(1e-3)
    assert ("underflow 1 (0 where the exact value is at least 1e-05, more than cancellation of larger terms explains)"
            in c.statistics_lines()[2])
    plain = compare(out, ref)  # no floor (softmax, exp, ULP-judged ops): any representable value lost is underflow
    assert plain.underflow == 2 and "overflow 0, underflow 2, NaN 0" in plain.statistics_lines()[2]
    # a floor below the smallest normal decides nothing and is not shown
    assert "at least" not in compare(out, ref, underflow_floor=1e-40).statistics_lines()[2]
