"""The norm suite (layer_norm and rms_norm kinds) end to end (pytester): correct norms pass every
config, each planted defect is caught with its category, and torch's own op is held against an
independent implementation."""
import pytest

from pytest_precision.kinds import registry
from pytest_precision.kinds.cases import NO_VARIANT, Case
from pytest_precision.numerics.budgets import violations
from pytest_precision.numerics.configs import CONFIGS

pytest_plugins = ["pytester"]

HEADER = """
import torch
import pytest_precision
"""

# statistics in fp32 whatever x's dtype, as fused kernels keep them; rms_norm is called with bias=None
CORRECT = HEADER + """
@pytest_precision.register("mine_ln", kind="layer_norm")
def mine_ln(x, weight, bias, eps):
    xf = x.float()
    d = xf - xf.mean(-1, keepdim=True)
    return (d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + eps) * weight.float() + bias.float()).to(x.dtype)


@pytest_precision.register("mine_rms", kind="rms_norm")
def mine_rms(x, weight, bias, eps):
    assert bias is None
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
"""

# the other careful pattern: statistics in fp32, the normalised row rounded to x's dtype, the affine in
# x's dtype (LlamaRMSNorm's weight * hidden_states.to(input_dtype)): up to three roundings of y
UPCAST_ROUND_AFFINE = HEADER + """
@pytest_precision.register("ln_upcast", kind="layer_norm")
def ln_upcast(x, weight, bias, eps):
    xf = x.float()
    d = xf - xf.mean(-1, keepdim=True)
    return (d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight + bias


@pytest_precision.register("rms_upcast", kind="rms_norm")
def rms_upcast(x, weight, bias, eps):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
"""

# E[x^2] - E[x]^2: at mean 1e4 both terms are 1e8, where fp32's spacing is 8, and the variance 1 is lost
ONE_PASS = HEADER + """
@pytest_precision.register("one_pass", kind="layer_norm")
def one_pass(x, weight, bias, eps):
    mean = x.mean(-1, keepdim=True)
    var = x.pow(2).mean(-1, keepdim=True) - mean * mean
    return (x - mean) * torch.rsqrt(var + eps) * weight + bias
"""

# the mean square accumulated and held in fp16 for fp32 inputs: squares past 65504 are inf
FP16_RMS = HEADER + """
@pytest_precision.register("fp16_rms", kind="rms_norm")
def fp16_rms(x, weight, bias, eps):
    ms = x.half().pow(2).mean(-1, keepdim=True).to(x.dtype)
    return x * torch.rsqrt(ms + eps) * weight
"""

# statistics in the input dtype: the mean and the variance of fp16 or bf16 rows kept in 16 bits
LN_16_BIT_STATISTICS = HEADER + """
@pytest_precision.register("ln16", kind="layer_norm")
def ln16(x, weight, bias, eps):
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + eps) * weight + bias
"""

# Hugging Face's LlamaRMSNorm without its upcast: the mean square in the input dtype
RMS_16_BIT_STATISTICS = HEADER + """
@pytest_precision.register("rms16", kind="rms_norm")
def rms16(x, weight, bias, eps):
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps)).to(x.dtype)
"""

NO_EPS = HEADER + """
@pytest_precision.register("no_eps", kind="layer_norm")
def no_eps(x, weight, bias, eps):
    d = x - x.mean(-1, keepdim=True)
    return d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True)) * weight + bias
"""


def _run(pytester, *args):
    """A session of the norm suite (other suites' cases deselected)."""
    args = list(args)
    if "-k" in args:
        i = args.index("-k") + 1
        args[i] = f"(layer_norm or rms_norm) and ({args[i]})"
    else:
        args += ["-k", "layer_norm or rms_norm"]
    # accuracy only: timing is tested in test_speed.py, and timings taken under pytest -n are noise
    return pytester.runpytest("--precision-suite", "--precision-no-speed", "-p", "no:cacheprovider", *args)


def _setup(pytester, body):
    pytester.makeconftest(body)
    pytester.makeini("[pytest]\n")


# The second run of a correct target's test, against the goldens its first run wrote, leaves out the
# drawn regime: it keeps no golden, and would repeat the first run's search (the same examples
# under CI=true)
AGAIN = "not hypothesis and not fresh"


def test_correct_norms_pass_every_config(pytester):
    _setup(pytester, CORRECT)
    configs = "fp32,fp16,bf16,amp-fp16,amp-bf16,fp8-e4m3"
    first = _run(pytester, f"--precision-configs={configs}", "--precision-update-baselines")
    first.assert_outcomes(passed=2 * 6 * 8)  # 2 targets x 6 configs x (6 regimes, hypothesis, fresh)
    again = _run(pytester, f"--precision-configs={configs}", "-k", AGAIN)  # against the goldens just written
    again.assert_outcomes(passed=2 * 6 * 6)
    for result, regimes in ((first, 8), (again, 6)):
        result.stdout.fnmatch_lines(["*precision summary, absolute error*",
                                     "*| target *| config *| *cases *| *max abs *| *RMS abs *"])
        for config in configs.split(","):
            result.stdout.fnmatch_lines([f"*| mine_ln *| {config} *| *{regimes} | *pass*",
                                         f"*| mine_rms *| {config} *| *{regimes} | *pass*"])
    assert (pytester.path / "precision_baselines/layer_norm/mine_ln/offset/fp32.npz").is_file()


def test_normalise_in_float32_then_affine_in_dtype_passes(pytester):
    """Rounding the normalised row to x's dtype and applying the affine there (three roundings of
    y where the peer has one) is careful code: it passes every regime, the drawn one included, in
    fp16 and bf16 (its y RMS error is 0.79 to 0.82 of the budget on the fixed regimes)."""
    _setup(pytester, UPCAST_ROUND_AFFINE)
    first = _run(pytester, "--precision-configs=fp16,bf16", "--precision-update-baselines")
    first.assert_outcomes(passed=2 * 2 * 8)  # 2 targets x 2 configs x (6 regimes, hypothesis, fresh)
    first.stdout.fnmatch_lines(["*| ln_upcast *| bf16 *| *8 | *pass*", "*| rms_upcast *| fp16 *| *8 | *pass*"])
    again = _run(pytester, "--precision-configs=fp16,bf16", "-k", AGAIN)  # against the goldens just written
    again.assert_outcomes(passed=2 * 2 * 6)
    again.stdout.fnmatch_lines(["*| ln_upcast *| bf16 *| *6 | *pass*", "*| rms_upcast *| fp16 *| *6 | *pass*"])


@pytest.mark.parametrize("config, seed", [("bf16", 28), ("fp16", 221)])
def test_y_rms_is_judged_on_settled_statistics_only(config, seed):
    """On a row of 64 the RMS of y's roundings is a few elements' roundings: the upcast-normalise-round-
    affine pattern went 1.15 (bf16, seed 28) and 1.10 (fp16, seed 221) times past twice the peer's RMS
    there. Below Y_RMS_MIN_ELEMENTS only the max error judges y; from it on, the RMS budget is
    Y_RMS_FACTOR x the larger of the two careful composites' RMS errors (plus its floor)."""
    import torch

    from pytest_precision.kinds.target import Target
    from pytest_precision.numerics.inputs import seeded_normal
    from pytest_precision.suites.norm import (Y_RMS_FACTOR, Y_RMS_MIN_ELEMENTS, NormInputs,
                                              composite_norm_affine_in_dtype)
    from pytest_precision.suites.norm_inputs import affine_parameters as _affine

    kind = registry.get_kind("layer_norm")
    target = Target("ln_upcast", lambda x, w, b, eps: composite_norm_affine_in_dtype(x, w, b, eps, False), "layer_norm")
    case = Case(kind, target, CONFIGS[config], NO_VARIANT, "hypothesis", "cpu")
    g = torch.Generator().manual_seed(seed)
    x = seeded_normal(g, 1, 64)
    m = kind.measure(case, NormInputs(x, *_affine(g, 64, False)), grad_seed=1)
    assert m.results["y"].peer_budget.rms_abs is None and not violations(m.results["y"].oracle, m.results["y"].peer_budget)

    regime = kind.regimes["unit"]  # 8 x 256: the RMS budget holds, the pattern within it
    assert regime.inputs().x.numel() >= Y_RMS_MIN_ELEMENTS
    m = kind.measure(Case(kind, target, CONFIGS[config], NO_VARIANT, "unit", "cpu"), regime.inputs(), grad_seed=1)
    budget, peer = m.results["y"].peer_budget.rms_abs, m.results["y"].peer.rms_abs
    assert Y_RMS_FACTOR * peer < budget and m.results["y"].oracle.rms_abs > peer  # the peer alone would not set it
    assert 0.7 < m.results["y"].oracle.rms_abs / budget < 0.9


def test_one_pass_variance_fails_the_offset_regime(pytester):
    _setup(pytester, ONE_PASS)
    result = _run(pytester, "--precision-configs=fp32", "-k", "offset or unit")
    result.assert_outcomes(failed=2)  # no goldens: both fail on that; the oracle check is what we look at
    # some rows' variance comes out negative (NaN), the others' wrong
    result.stdout.fnmatch_lines(["*layer_norm[[]one_pass-fp32-offset[]]: FAIL nan,accuracy,baseline (oracle: y: NaN * > 0 allowed; "
                                 "oracle: y: max abs * > budget *",
                                 "*first nan in aten::rsqrt at conftest.py:* under fp32: produced nan from finite inputs where "
                                 "the reference is *"])
    assert "one_pass-fp32-unit]: FAIL baseline" in result.stdout.str()  # centred rows: only the golden is missing


def test_one_pass_variance_is_found_by_hypothesis(pytester):
    _setup(pytester, ONE_PASS)
    result = _run(pytester, "--precision-configs=fp32", "-k", "hypothesis")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*layer_norm[[]one_pass-fp32-hypothesis[]]: FAIL *hypothesis*",
                                 "*Hypothesis found (after shrinking) NormInputs(x=(*), dtype=torch.float32, eps=*"])


def test_fp16_accumulated_mean_square(pytester):
    """For fp32 inputs: the rounding to fp16 costs accuracy on unit rows, and squares past 65504
    make the mean square inf and y 0 (underflow), traced to the op."""
    _setup(pytester, FP16_RMS)
    result = _run(pytester, "--precision-configs=fp32", "-k", "unit or scale300")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*rms_norm[[]fp16_rms-fp32-unit[]]: FAIL accuracy*(oracle: y: max abs * > budget *"])
    result.stdout.fnmatch_lines(["*rms_norm[[]fp16_rms-fp32-scale300[]]: FAIL overflow,underflow,accuracy,baseline (oracle: y: "
                                 "underflow * > 0 allowed*",
                                 "*first overflow in aten::pow at conftest.py:* under fp32: produced inf from finite inputs*"])


def test_statistics_in_16_bits_fail_without_a_golden(pytester):
    """Norms whose statistics are kept in fp16 or bf16 fail against the float32-statistics peers
    with no golden: y's RMS error past Y_RMS_FACTOR x theirs (bf16 too, where the max error is one
    element's rounding and passes; measured over the budget: ln16 1.05 to 1.48, rms16 1.25 to 1.51
    on long), and fp16's squares overflow on scale300."""
    _setup(pytester, LN_16_BIT_STATISTICS + RMS_16_BIT_STATISTICS.split(HEADER, 1)[1])
    result = _run(pytester, "--precision-configs=fp16,bf16,fp32", "-k", "long or unit or scale300")
    result.assert_outcomes(failed=18)  # no goldens: every case fails on that; the oracle check is what we look at
    for target in ("ln16", "rms16"):
        for config in ("fp16", "bf16"):
            result.stdout.fnmatch_lines([f"*_norm[[]{target}-{config}-long[]]: FAIL accuracy,baseline (oracle: y: RMS abs * > "
                                         "budget *",
                                         "*(the oracle check compares with a composite with float32 statistics in the same "
                                         "config*"])
        result.stdout.fnmatch_lines([f"*_norm[[]{target}-fp16-scale300[]]: FAIL overflow,*"])
        assert f"[{target}-fp32-long]: FAIL baseline (" in result.stdout.str()  # fp32: statistics in fp32
    out = result.stdout.str()
    assert "layer_norm[ln16-bf16-unit]: FAIL accuracy,baseline (" in out
    # rms16-bf16-unit sits at 0.996 of the RMS budget (its statistics' roundings happen to be small there):
    # neither way is asserted


def test_a_norm_without_eps_fails_near_eps(pytester):
    _setup(pytester, NO_EPS)
    result = _run(pytester, "--precision-configs=fp32", "-k", "near-eps")
    result.assert_outcomes(failed=1)
    # the row of zeros: 0 x rsqrt(0) is NaN (in float64 as well: a defect of the formula, so no first fault is
    # named); the rows of variance near eps are off by up to sqrt(1 + eps / var)
    result.stdout.fnmatch_lines(["*layer_norm[[]no_eps-fp32-near-eps[]]: FAIL nan,accuracy,baseline (oracle: y: NaN 256 > 0 "
                                 "allowed; oracle: y: max abs * > budget *"])


def test_regression_against_golden(pytester):
    """A norm computing in float64 gets a tight golden; the same norm in fp32 later stays within
    the peer budget and fails the regression budget."""
    accurate = HEADER + """
@pytest_precision.register("mine", kind="layer_norm")
def mine(x, weight, bias, eps):
    return torch.nn.functional.layer_norm(x.double(), x.shape[-1:], weight.double(), bias.double(), eps).to(x.dtype)
"""
    _setup(pytester, accurate)
    _run(pytester, "--precision-update-baselines", "--precision-configs=fp32", "-k", "long").assert_outcomes(passed=1)
    _setup(pytester, accurate.replace(".double()", ""))
    result = _run(pytester, "--precision-configs=fp32", "-k", "long")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*FAIL regression (golden: *RMS abs * > budget *",
                                 "*if this run is right, accept it with: pytest --precision-suite -k 'layer_norm[[]mine-fp32-long[]]'*"])
    assert "oracle:" not in result.stdout.str()  # within the peer budget: only the regression fires


def test_the_contract_is_one_call_for_both_kinds(pytester):
    """A target with the wrong output dtype breaks the contract (the message names it); rms_norm
    gets bias=None."""
    _setup(pytester, HEADER + """
@pytest_precision.register("wide", kind="rms_norm")
def wide(x, weight, bias, eps):
    return torch.nn.functional.rms_norm(x.double(), x.shape[-1:], weight.double(), eps)
""")
    result = _run(pytester, "--precision-configs=bf16", "-k", "unit")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*target 'wide' (rms_norm) under config bf16 on regime unit: output dtype torch.float64, "
                                 "the kind gives torch.bfloat16 under bf16*"])


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
def test_the_builtin_torch_op_is_held_against_an_independent_peer(name, monkeypatch):
    """torch's op as the built-in target is compared with the composite; were it broken
    (normalising in bf16 inside an fp32 config), its check would say so."""
    import torch

    kind = registry.get_kind(name)
    builtin = kind.default_targets()[0]
    assert builtin.name == f"torch.{name}" and "composite" in kind.peer_for(builtin)[1]
    case = Case(kind, builtin, CONFIGS["fp32"], NO_VARIANT, "unit", "cpu")
    regime = kind.regimes["unit"]
    m = kind.measure(case, regime.inputs(), grad_seed=regime.seed + 1)
    assert not any(violations(r.oracle, r.peer_budget) for r in m.results.values())
    norm = torch.nn.functional.rms_norm if name == "rms_norm" else torch.nn.functional.layer_norm
    broken = type("F", (), {name: staticmethod(lambda x, *a, **k: norm(x.bfloat16(), *[
        t.bfloat16() if isinstance(t, torch.Tensor) else t for t in a], **k).to(x.dtype))})
    monkeypatch.setitem(type(kind).peer.__globals__, "F", broken)  # the module the kind's peer reads F from
    m = kind.measure(case, regime.inputs(), grad_seed=regime.seed + 1)
    assert violations(m.results["y"].oracle, m.results["y"].peer_budget)


def test_torch_layer_norm_backward_limit_in_16_bits_is_named():
    """torch's CPU layer_norm saves mean and rstd in 16 bits for its backward: on rows whose mean
    dwarfs their spread its dx in fp16 is several times a two-pass backward's error. The built-in
    target's drawn case names that limit, and nothing else (forward failures, centred rows, fp32)."""
    import torch

    from pytest_precision.numerics.inputs import seeded_normal
    from pytest_precision.suites.norm import NormInputs, composite_norm, norm_reference, torch_backward_limit

    g = torch.Generator().manual_seed(3)
    x, w, b = seeded_normal(g, 4, 64, shift=100.0), seeded_normal(g, 64, shift=1.0, scale=0.1), seeded_normal(g, 64, scale=0.1)
    a = NormInputs(x, w, b)
    assert torch_backward_limit(a, torch.float16, {"dx"}) and torch_backward_limit(a, torch.bfloat16, {"dweight"})
    assert not torch_backward_limit(a, torch.float32, {"dx"})
    assert not torch_backward_limit(a, torch.float16, {"y", "dx"})  # the forward keeps fp32 statistics: never excused
    assert not torch_backward_limit(NormInputs(x - 100.0, w, b), torch.float16, {"dx"})  # centred rows

    grad_out = torch.randn(4, 64, generator=g, dtype=torch.float64).half()

    def dx(fn, dtype):  # on the fp16-rounded inputs and upstream gradient, computed in dtype
        xx = x.half().to(dtype).requires_grad_(True)
        fn(xx, w.half().to(dtype), b.half().to(dtype)).backward(grad_out.to(dtype))
        return xx.grad.to(torch.float64)

    exact = dx(lambda *t: norm_reference(*t, 1e-5, False), torch.float64)
    torch_err = float((dx(lambda *t: torch.nn.functional.layer_norm(t[0], (64,), *t[1:]), torch.float16) - exact).abs().max())
    two_pass_err = float((dx(lambda *t: composite_norm(*t, 1e-5, False), torch.float16) - exact).abs().max())
    if torch_err < 2 * two_pass_err:
        pytest.skip(f"this torch's fp16 layer_norm backward is {torch_err:.3g} off, the two-pass {two_pass_err:.3g}: the "
                    "known limit can go")
