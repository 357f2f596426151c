"""Triton's interpreter on the CPU: its bfloat16 defects are detected by a canary and not blamed
on a user's kernel, and a fault inside an interpreted kernel names the kernel."""
import pytest

pytest.importorskip("triton")
pytest_plugins = ["pytester"]

from pytest_precision.kinds.triton import interpreter_defects, interpreting  # noqa: E402

needs_interpreter = pytest.mark.skipif(not interpreting(), reason="triton was imported without the interpreter")

# the Triton tutorials' fused softmax, as a user would register it: it stores its fp32 result
# straight into the output's dtype, which is where the interpreter's bf16 store truncates
TUTORIAL = """
import torch
import triton
import triton.language as tl
import pytest_precision


@triton.jit
def softmax_kernel(output_ptr, input_ptr, input_row_stride, output_row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    row_idx = tl.program_id(0)
    col_offsets = tl.arange(0, BLOCK_SIZE)
    mask = col_offsets < n_cols
    row = tl.load(input_ptr + row_idx * input_row_stride + col_offsets, mask=mask, other=-float('inf')).to(tl.float32)
    numerator = tl.exp(row{SUBTRACT_MAX})
    out = numerator / tl.sum(numerator, axis=0)
    tl.store(output_ptr + row_idx * output_row_stride + col_offsets, out, mask=mask)


@pytest_precision.register("tutorial", kind="softmax")
def softmax(x):
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.empty_like(x2)
    softmax_kernel[(x2.shape[0],)](y, x2, x2.stride(0), y.stride(0), x2.shape[1],
                                   BLOCK_SIZE=triton.next_power_of_2(x2.shape[1]))
    return y.reshape(x.shape)
"""


@needs_interpreter
def test_the_canary_shows_the_interpreters_bf16_defects():
    defects = interpreter_defects()
    if not defects:
        pytest.skip("this triton's interpreter computes bf16 right: cases that use it are judged as any other")
    assert any("bf16 store rounds wrong (1.004882812 stored as 1," in d for d in defects), defects


@needs_interpreter
def test_a_bf16_kernel_is_not_failed_for_the_interpreters_rounding(pytester, monkeypatch):
    if not interpreter_defects():
        pytest.skip("this triton's interpreter computes bf16 right")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the user's triton.jit reads it
    pytester.makeconftest(TUTORIAL.format(SUBTRACT_MAX=" - tl.max(row, axis=0)"))
    pytester.makeini("[pytest]\n")
    args = ("--precision-suite", "--precision-no-speed", "-p", "no:cacheprovider", "-k", "tutorial and scale20 and not scale200",
            "--precision-configs=fp32,bf16", "-rx")
    pytester.runpytest(*args, "--precision-update-baselines")
    result = pytester.runpytest(*args)
    result.assert_outcomes(passed=1, xfailed=1)
    result.stdout.fnmatch_lines(["XFAIL *softmax[[]tutorial-bf16-scale20[]] - Triton's interpreter (triton *) cannot judge "
                                 "bfloat16 kernels: its fp32 -> bf16 store rounds wrong (1.004882812 stored as 1,*the "
                                 "failing call ran softmax_kernel on bfloat16 tensors there*"])
    # the table and the notes below it say the same: not a crash of the target, not a failure
    out = result.stdout.str()
    assert "FAIL 1/1: crash" not in out and "crashed:" not in out, out[-3000:]
    result.stdout.fnmatch_lines(["| tutorial | bf16 * | skip: expected to fail: Triton's interpreter*",
                                 "1 case(s) skipped: expected to fail: Triton's interpreter*"])


@needs_interpreter
def test_a_fault_inside_an_interpreted_kernel_names_the_kernel(pytester, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytester.makeconftest(TUTORIAL.format(SUBTRACT_MAX=""))  # no max subtraction: exp overflows past 88
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest("--precision-suite", "--precision-no-speed", "-p", "no:cacheprovider",
                                "-k", "tutorial and scale200", "--precision-configs=fp32")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*softmax[[]tutorial-fp32-scale200[]]: FAIL*",
                                 "  first * inside Triton kernel softmax_kernel (interpreted; launched at conftest.py:*) "
                                 "under fp32: produced *"])
    assert not [line for line in result.outlines if line.startswith("  first ") and "interpreter.py" in line]


# a Triton LayerNorm as kernel libraries write one: a forward kernel keeping mean and rstd for a
# backward that allocates its buffers with torch.empty, host code that maps the dtypes it knows
LAYER_NORM = """
import torch
import triton
import triton.language as tl
import pytest_precision

DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _ln_forward(X, W, B, Y, Mean, Rstd, N, eps, BLOCK: tl.constexpr, OUT: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, 0) / N
    {VARIANCE}
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(W + cols, mask=mask).to(tl.float32)
    b = tl.load(B + cols, mask=mask).to(tl.float32)
    tl.store(Y + row * N + cols, ((x - mean) * rstd * w + b).to(OUT), mask=mask)
    tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)


class LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        out_dtype = DTYPES[x.dtype]  # the host code knows three dtypes: float64 is refused here
        rows, n = x.shape
        y = torch.empty_like(x)
        mean = torch.empty(rows, dtype=torch.float32)
        rstd = torch.empty(rows, dtype=torch.float32)
        _ln_forward[(rows,)](x, weight, bias, y, mean, rstd, n, eps, BLOCK=triton.next_power_of_2(n), OUT=out_dtype)
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        xhat = (x.float() - mean[:, None]) * rstd[:, None]
        wdy = dy.float() * weight.float()
        dx = torch.empty_like(x)  # a buffer, filled below: its old contents are nobody's output
        dx.copy_((wdy - (xhat * wdy).mean(-1, keepdim=True) * xhat - wdy.mean(-1, keepdim=True)) * rstd[:, None])
        return dx, (dy.float() * xhat).sum(0).to(weight.dtype), dy.float().sum(0).to(weight.dtype), None


@pytest_precision.register("triton_ln", kind="layer_norm")
def triton_ln(x, weight, bias, eps):
    return LayerNorm.apply(x, weight, bias, eps)
"""
TWO_PASS = "var = tl.sum((x - mean) * (x - mean) * (cols < N), 0) / N"
ONE_PASS = "var = tl.sum(x * x, 0) / N - mean * mean  # E[x^2] - E[x]^2: cancels to below 0 on offset rows"


@needs_interpreter
@pytest.mark.parametrize("variance", [TWO_PASS, ONE_PASS], ids=["two-pass", "one-pass"])
def test_a_fault_is_named_at_the_kernel_that_lost_the_value_not_at_an_allocation(pytester, monkeypatch, variance):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytester.makeconftest(LAYER_NORM.replace("{VARIANCE}", variance))
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest("--precision-suite", "--precision-no-speed", "-p", "no:cacheprovider",
                                "-k", "offset and not hypothesis", "--precision-configs=fp32")
    out = result.stdout.str()
    if variance == TWO_PASS:  # correct: judged (no golden yet), no fault
        assert "first nan" not in out and "FAIL baseline" in out, out[-3000:]
        return
    result.stdout.fnmatch_lines([
        "*layer_norm[[]triton_ln-fp32-offset*[]]: FAIL *nan*",
        "  first nan inside Triton kernel _ln_forward (interpreted; launched at conftest.py:*) under fp32: produced nan "
        "from finite inputs*",
        "  the first fault is located against the target's float32 run, not a float64 one: it did not run on the "
        "float64 inputs (*KeyError: torch.float64*)",
    ])
    assert "aten::empty" not in out, out[-3000:]
