"""The Triton kernels: against torch on small shapes, the interpreter's bf16 traps, the one-pass
error statistics against the torch path, and planted kernel defects caught by the suites.

Without CUDA the kernels run under Triton's interpreter: tests/conftest.py imports triton under
TRITON_INTERPRET=1 before any test module and then restores the environment, so the process's
triton interprets while pytester sessions, which read the variable to decide whether the suites
list the kernels, still see it unset (kernels/runtime.py)."""
import math
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest_plugins = ["pytester"]

DEVICE = "cuda" if CUDA else "cpu"
KERNELS = Path(__file__).resolve().parents[1] / "kernels"


@pytest.fixture(autouse=True)
def kernels_can_run():
    from pytest_precision.kernels.runtime import unavailable

    reason = unavailable(DEVICE)
    if reason:  # triton imported in compiled mode before this module on a CPU machine
        pytest.skip(reason)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ softmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("cols,block", [(300, None), (1000, 128), (37, 16)], ids=["one-block", "online", "online-odd"])
def test_softmax_matches_torch(dtype, log, cols, block):
    from pytest_precision.kernels.softmax import softmax_with_lse

    x = (torch.randn(6, cols, generator=_gen(), dtype=torch.float64) * 8).to(dtype)
    x[2, ::3] = -math.inf  # partly masked
    x[4] = torch.linspace(-100, 100, cols, dtype=torch.float64).to(dtype)  # the max moves every block
    dy = torch.randn(6, cols, generator=_gen(1), dtype=torch.float64).to(dtype)
    xk = x.to(DEVICE).detach().requires_grad_()
    y, lse = softmax_with_lse(xk, log=log, block=block)
    y.backward(dy.to(DEVICE))
    xt = x.double().requires_grad_()
    yt = (torch.log_softmax if log else torch.softmax)(xt, -1)
    yt.backward(dy.double())
    assert y.dtype == dtype and y.shape == x.shape and lse.dtype == torch.float32
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(y.cpu().double(), yt.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse.cpu().double(), torch.logsumexp(x.double(), -1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(xk.grad.cpu().double(), xt.grad, rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("block", [None, 16])
def test_fully_masked_rows_are_nan_like_torch(block):
    from pytest_precision.kernels.softmax import log_softmax, softmax, softmax_with_lse

    x = torch.randn(3, 40, generator=_gen()).to(DEVICE)
    x[1] = -math.inf
    for fn, ref in ((softmax, torch.softmax), (log_softmax, torch.log_softmax)):
        y = fn(x).cpu()
        assert torch.isnan(y[1]).all() and torch.isnan(ref(x.cpu(), -1)[1]).all()
        assert torch.isfinite(y[[0, 2]]).all()
    _, lse = softmax_with_lse(x, block=block)
    assert lse[1].item() == -math.inf


def test_log_softmax_keeps_tiny_results_near_zero():
    """-log1p(exp(-37)) = -8.5e-17: computed as log(1 + s) it would be 0, 6e8 ULPs of fp32 away."""
    from pytest_precision.kernels.softmax import log_softmax

    y = log_softmax(torch.tensor([[-104.0, -141.0]], device=DEVICE)).cpu()
    assert y[0, 0].item() == pytest.approx(-math.exp(-37), rel=1e-6)


# ------------------------------------------------------------------ flash attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [
    dict(B=1, H=2, H_kv=2, S_q=16, S_k=16, D=64, causal=False, pad=False),
    dict(B=1, H=2, H_kv=1, S_q=20, S_k=20, D=128, causal=True, pad=False),
    dict(B=2, H=4, H_kv=2, S_q=8, S_k=24, D=16, causal=False, pad=True),
    dict(B=1, H=1, H_kv=1, S_q=17, S_k=29, D=59, causal=True, pad=False),
], ids=["d64", "d128-causal-gqa", "padded-gqa", "d59-causal"])
def test_flash_attention_matches_float64_math(dtype, shape):
    from pytest_precision.kernels.flash_attention import flash_attention_with_lse
    from pytest_precision.suites.attention import attention_scores, reference_attention

    g = _gen(3)
    B, H, H_kv, S_q, S_k, D = (shape[k] for k in ("B", "H", "H_kv", "S_q", "S_k", "D"))
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)
               for s in ((B, H, S_q, D), (B, H_kv, S_k, D), (B, H_kv, S_k, D)))
    mask = None
    if shape["pad"]:
        mask = torch.zeros(B, S_k, dtype=torch.bool)
        mask[0, 5:] = True
        mask[1, :3] = True
    do = torch.randn(B, H, S_q, D, generator=g, dtype=torch.float64).to(dtype)
    mine = [t.to(DEVICE).detach().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention_with_lse(*mine, causal=shape["causal"],
                                        key_padding_mask=None if mask is None else mask.to(DEVICE))
    out.backward(do.to(DEVICE))
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*exact, causal=shape["causal"], key_padding_mask=mask)
    ref.backward(do.double())
    assert out.dtype == dtype and out.shape == (B, H, S_q, D)
    tol = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}[dtype]
    torch.testing.assert_close(out.detach().cpu().double(), ref.detach(), rtol=tol, atol=tol)
    for m, e in zip(mine, exact):
        torch.testing.assert_close(m.grad.cpu().double(), e.grad, rtol=4 * tol, atol=4 * tol)
    scores = attention_scores(*exact[:2], shape["causal"], mask)
    torch.testing.assert_close(lse.cpu().double(), torch.logsumexp(scores, -1).detach(), rtol=1e-4, atol=1e-4)


def test_flash_attention_under_autocast_computes_in_the_autocast_dtype():
    from pytest_precision.kernels.flash_attention import flash_attention

    q = torch.randn(1, 1, 16, 16, generator=_gen()).to(DEVICE)
    with torch.autocast(DEVICE, dtype=torch.float16):
        out = flash_attention(q, q, q)
    assert out.dtype == torch.float16


def test_every_head_dim_and_dtype_has_gpu_tiles_and_a_larger_one_is_named():
    """The GPU's tile table covers every head dim up to its maximum, in every dtype and dot mode
    (compile_check holds each entry to the cards' limits); a larger head dim is a clear error, not
    a KeyError at launch."""
    import triton

    from pytest_precision.kernels import flash_attention as fa

    for d in range(1, fa.MAX_HEAD_DIM + 1):
        block_d = max(16, triton.next_power_of_2(d))
        for dtype, ieee in ((torch.float16, False), (torch.bfloat16, False), (torch.float32, False),
                            (torch.float32, True)):
            for kernel in ("forward", "dkdv", "dq"):
                assert (kernel, fa._operands(dtype, ieee), block_d) in fa.TILES, (kernel, dtype, ieee, d)
    q = torch.zeros(1, 1, 4, fa.MAX_HEAD_DIM + 1, device=DEVICE)
    with pytest.raises(ValueError, match="head dim 257 over the largest this kernel has tiles for, 256"):
        fa.flash_attention(q, q, q)


# ------------------------------------------------------------------ the interpreter's bf16 traps

@pytest.mark.skipif(CUDA, reason="the trap is the interpreter's; this machine runs the kernels natively")
def test_interpreter_bf16_dot_trap_is_real_and_the_upcast_avoids_it():
    """triton 3.9.0's interpreter multiplies bf16 dot operands' raw bits (triton-lang/triton#11584);
    our kernels' UPCAST_DOT casts them to fp32 first. If the first assertion ever fails, upstream
    fixed the trap and the upcast (kernels/runtime.py) can go."""
    import triton.language as tl

    from pytest_precision.kernels.runtime import LazyKernel, upcast_dot

    def dot16(a_ptr, b_ptr, c_ptr, UPCAST: tl.constexpr):
        r = tl.arange(0, 16)
        a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
        b = tl.load(b_ptr + r[:, None] * 16 + r[None, :])
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        tl.store(c_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, b))

    kernel = LazyKernel(dot16)
    ones = torch.ones(16, 16, dtype=torch.bfloat16)
    c = torch.empty(16, 16)
    kernel[(1,)](ones, ones, c, UPCAST=False)
    if c[0, 0].item() == 16.0:
        pytest.skip("the interpreter's bf16 dot is right in this triton: the upcast is no longer needed")
    assert c[0, 0].item() > 1e9
    assert upcast_dot()
    kernel[(1,)](ones, ones, c, UPCAST=True)
    assert c[0, 0].item() == 16.0


@pytest.mark.skipif(CUDA, reason="the trap is the interpreter's")
def test_bf16_subnormal_outputs_round_correctly_under_the_interpreter():
    """The interpreter's fp32 -> bf16 cast truncates and garbles subnormals (1.8e-40 -> 1.2e-38);
    the kernels hand bf16 across their boundary as fp32 there, so the result is torch's rounding."""
    from pytest_precision.kernels.softmax import softmax

    x = torch.tensor([[0.0, -92.0, -3.0]], dtype=torch.bfloat16)
    y = softmax(x)
    assert torch.equal(y, torch.softmax(x.double(), -1).to(torch.bfloat16))


def test_targets_skip_with_a_reason_where_kernels_cannot_run(monkeypatch):
    from pytest_precision.kernels.flash_attention import flash_attention
    from pytest_precision.kernels.builtin import builtin_targets, skip_reason

    from pytest_precision.platform import triton as where_triton_runs

    assert skip_reason(torch.softmax, "cpu") is None  # unmarked callables are never skipped
    monkeypatch.setattr(where_triton_runs, "interpreting", lambda: False)  # a CPU process without the interpreter
    assert "TRITON_INTERPRET=1" in skip_reason(flash_attention, "cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not CUDA:
        assert builtin_targets(("softmax", "log_softmax", "attention")) == []
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    names = [t.name for t in builtin_targets(("softmax", "log_softmax", "attention"))]
    assert names == ["triton.softmax", "triton.log_softmax", "triton.flash_attention"]


# ------------------------------------------------------------------ error statistics

ULP_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
SPECIALS = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-40, 6e-8, 65504.0, 448.0, 500.0, 1e-3]


@st.composite
def out_and_ref(draw):
    dtype = draw(st.sampled_from(ULP_DTYPES))
    n = draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    scale_exp = draw(st.sampled_from([0, 0, -4, 3]))
    ref = torch.randn(n, generator=g, dtype=torch.float64) * draw(st.sampled_from([1e-3, 1.0, 30.0, 1e4]))
    noise = torch.randn(n, generator=g, dtype=torch.float64) * draw(st.sampled_from([0.0, 1e-6, 1e-3, 0.3]))
    out = ref * (1 + noise)
    for i in draw(st.lists(st.integers(0, n - 1), max_size=6)):
        out[i] = draw(st.sampled_from(SPECIALS))
    for i in draw(st.lists(st.integers(0, n - 1), max_size=4)):
        ref[i] = draw(st.sampled_from(SPECIALS))
    scale = 2.0 ** scale_exp
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        out = torch.where(torch.isfinite(out), (out / scale).to(dtype).to(torch.float64) * scale, out)
        out = out.to(torch.float32)  # fp8 results are carried dequantised in fp32, as the configs do
    else:
        out = out.to(dtype)
    ref = ref.to(draw(st.sampled_from([torch.float64, torch.float32])))
    return out, ref, dtype, scale, draw(st.booleans()), draw(st.sampled_from([0.0, 1e-2]))


@settings(max_examples=40, deadline=None)
@given(out_and_ref())
def test_error_statistics_kernel_equals_torch_path(case):
    from pytest_precision.kernels.error_stats import error_statistics, error_statistics_torch

    out, ref, dtype, scale, log_domain, floor = case
    kw = dict(scale=scale, log_domain=log_domain, underflow_floor=floor)
    a = error_statistics(out.to(DEVICE), ref.to(DEVICE), dtype, block=64, iters=2, **kw)
    b = error_statistics_torch(out, ref, dtype, **kw)
    for name in ("numel", "n_finite", "argmax_ulp", "overflow", "underflow", "nan", "missing_nan",
                 "flushed_subnormal", "max_ulp", "max_abs", "max_rel"):
        assert getattr(a, name) == getattr(b, name), name  # counts and maxima: exact
    assert torch.equal(a.histogram, b.histogram)
    for name in ("sum_ulp", "sum_sq_err", "sum_sq_ref", "sum_sq_out", "sum_out_ref"):  # sums: fp32 rounding
        assert getattr(a, name) == pytest.approx(getattr(b, name), rel=2**-24, abs=1e-300), name


def test_metrics_compare_on_the_kernel_path_equals_the_torch_path(monkeypatch):
    """What compare() does on CUDA (the kernel's statistics), forced on this device, gives the
    same Comparison as the torch path."""
    from pytest_precision.kernels.error_stats import KERNEL_DTYPES, error_statistics
    from pytest_precision.numerics import metrics

    monkeypatch.setattr(metrics, "_FUSED", (error_statistics, frozenset(KERNEL_DTYPES)))  # what install() does on CUDA
    g = _gen(5)
    ref = torch.randn(64, 48, generator=g, dtype=torch.float64) * 20
    cases = [
        (ref.to(torch.bfloat16), dict()),
        (ref.to(torch.float16), dict(underflow_floor=1e-2)),
        (torch.log_softmax(ref, -1).float(), dict(log_domain=True)),
    ]
    out = ref.to(torch.bfloat16).float()
    out[3, 4], out[5, 6], out[7, 8] = math.nan, math.inf, 0.0
    cases.append((out, dict()))
    for out, kw in cases:
        r = torch.log_softmax(ref, -1) if kw.get("log_domain") else ref
        dtype = out.dtype if out.dtype != torch.float32 or kw.get("log_domain") else torch.bfloat16
        monkeypatch.setattr(metrics, "_use_fused", lambda *a: False)
        torch_path = metrics.compare(out.to(DEVICE), r.to(DEVICE), dtype, **kw)
        monkeypatch.setattr(metrics, "_use_fused", lambda *a: True)
        fused = metrics.compare(out.to(DEVICE), r.to(DEVICE), dtype, **kw)
        a, b = fused.summary(), torch_path.summary()
        for key in a:
            if key in ("sqnr_db", "cosine", "mean_ulp", "rms_abs"):  # sums in another order
                assert a[key] == pytest.approx(b[key], rel=1e-6, nan_ok=True), key
            else:
                assert a[key] == b[key] or (math.isnan(a[key]) and math.isnan(b[key])), key
        assert repr(fused.worst) == repr(torch_path.worst)  # NaN entries: compare their text


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_error_statistics_of_fp8_tensors_equal_the_torch_path(dtype):
    """fp8 tensors themselves (not fp32 carriers): widened to fp16 before the kernel, exactly."""
    from pytest_precision.kernels.error_stats import error_statistics, error_statistics_torch

    ref = torch.randn(700, generator=_gen(7), dtype=torch.float64) * 30
    out = ref.to(dtype)
    a = error_statistics(out.to(DEVICE), ref.to(DEVICE), block=64, iters=3)
    b = error_statistics_torch(out, ref)
    assert (a.max_ulp, a.argmax_ulp, a.overflow, a.n_finite) == (b.max_ulp, b.argmax_ulp, b.overflow, b.n_finite)
    assert torch.equal(a.histogram, b.histogram) and a.max_ulp > 0


def test_the_fused_path_makes_the_ulp_tensor_only_when_asked(monkeypatch):
    """Passing cases need none of what the elementwise ULP tensor gives (worst elements, exact
    p99, counts over a budget): on the kernel's path it is made on first use, and then it is the
    torch path's."""
    from pytest_precision.kernels.error_stats import KERNEL_DTYPES, error_statistics
    from pytest_precision.numerics import metrics

    made = []
    real = metrics.ulp_distance
    monkeypatch.setattr(metrics, "ulp_distance", lambda *a, **k: made.append(1) or real(*a, **k))
    monkeypatch.setattr(metrics, "_FUSED", (error_statistics, frozenset(KERNEL_DTYPES)))
    monkeypatch.setattr(metrics, "_use_fused", lambda *a: True)
    ref = torch.randn(16, 64, generator=_gen(9), dtype=torch.float64) * 20
    out = ref.to(torch.bfloat16)
    fused = metrics.compare(out.to(DEVICE), ref.to(DEVICE))
    assert made == [] and fused.max_ulp > 0
    worst, p99 = fused.worst, fused.p99_ulp
    assert made == [1]
    fused.count_over(1.0)
    assert made == [1]  # made once
    monkeypatch.setattr(metrics, "_use_fused", lambda *a: False)
    torch_path = metrics.compare(out.to(DEVICE), ref.to(DEVICE))
    assert (worst, p99) == (torch_path.worst, torch_path.p99_ulp)


# ------------------------------------------------------------------ planted defects, caught by the suites

def _mutant(pytester, module: str, old: str, new: str) -> None:
    """Copy kernels/<module>.py with one line changed into the pytester directory as mutant.py."""
    source = (KERNELS / f"{module}.py").read_text()
    assert source.count(old) == 1, f"the line to mutate is gone from kernels/{module}.py: {old!r}"
    pytester.makepyfile(mutant=source.replace(old, new))


def _suite(pytester, kind, fn, *args):
    pytester.makeconftest(f"import pytest_precision, mutant\npytest_precision.register('mutant', mutant.{fn}, kind='{kind}')\n")
    pytester.makeini("[pytest]\n")
    return pytester.runpytest("--precision-suite", "-p", "no:cacheprovider", *args)


SKIPPED_RESCALE = ("s = (s + 1.0) * alpha + tl.sum(", "s = (s + 1.0) + tl.sum(")


def test_softmax_kernel_itself_passes_where_the_defect_is_planted(pytester):
    _mutant(pytester, "softmax", *(SKIPPED_RESCALE[0],) * 2)  # an unchanged copy
    args = ("--precision-configs=fp32", "-k", "softmax and len32768")
    _suite(pytester, "softmax", "softmax", "--precision-update-baselines", *args).assert_outcomes(passed=1)
    _suite(pytester, "softmax", "softmax", *args).assert_outcomes(passed=1)


def test_softmax_kernel_that_skips_the_rescale_is_caught(pytester):
    """The running sum not rescaled when a later block raises the max: rows of 32768 (four blocks
    of 8192) come out too small."""
    _mutant(pytester, "softmax", *SKIPPED_RESCALE)
    result = _suite(pytester, "softmax", "softmax", "--precision-configs=fp32", "-k", "softmax and len32768")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*softmax[[]mutant-fp32-len32768[]]: FAIL accuracy*(oracle: max ULP * > budget *"])


def test_attention_kernel_with_an_fp16_accumulator_is_caught(pytester):
    """The output accumulator rounded to fp16 after every key block."""
    line = "acc = acc * alpha[:, None] + _dot(_operand(p, v.dtype, ROUND_BF16), v, UPCAST, IEEE)"
    _mutant(pytester, "flash_attention", line,
            "acc = (acc * alpha[:, None] + _dot(_operand(p, v.dtype, ROUND_BF16), v, UPCAST, IEEE)).to(tl.float16).to(tl.float32)")
    result = _suite(pytester, "attention", "flash_attention", "--precision-configs=fp32", "-k", "attention and long")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*attention[[]mutant-fp32-long[]]: FAIL accuracy*(oracle: out: max abs * > budget *"])
