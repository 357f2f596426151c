"""Triton's interpreter on the CPU: a canary measures its bfloat16 defects, the harness computes bf16
as a GPU does where they are, so bf16 kernels are judged (a correct one passes, a bf16-only defect
fails); a case is excused only where its launches met what the emulation cannot fix, naming it; and
a fault inside an interpreted kernel names the kernel."""
import pytest

pytest.importorskip("triton")
pytest_plugins = ["pytester"]

from pytest_precision.platform.launches import Launch  # noqa: E402
from pytest_precision.platform import triton as kinds_triton  # noqa: E402
from pytest_precision.platform.triton import (interpret_env, interpreter_defects, interpreter_excuse,  # noqa: E402
                                           interpreting, residual_interpreter_defects)

needs_interpreter = pytest.mark.skipif(not interpreting(), reason="triton was imported without the interpreter")
needs_defects = pytest.mark.skipif(not (interpreting() and interpreter_defects()),
                                   reason="this triton's interpreter computes bf16 right: nothing is emulated")

# How a user registers a row-softmax kernel (the tutorial's launch); {KERNEL} defines softmax_kernel
REGISTER = """
import torch
import triton
import triton.language as tl
import pytest_precision

{KERNEL}

@pytest_precision.register("{NAME}", kind="softmax")
def softmax(x):
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.empty_like(x2)
    softmax_kernel[(x2.shape[0],)](y, x2, x2.stride(0), y.stride(0), x2.shape[1],
                                   BLOCK_SIZE=triton.next_power_of_2(x2.shape[1]))
    return y.reshape(x.shape)
"""

# the Triton tutorials' fused softmax: it upcasts on load and stores its fp32 result straight into
# the output's dtype, which is where the raw interpreter's bf16 store truncates
TUTORIAL_KERNEL = """
@triton.jit
def softmax_kernel(output_ptr, input_ptr, input_row_stride, output_row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    row_idx = tl.program_id(0)
    col_offsets = tl.arange(0, BLOCK_SIZE)
    mask = col_offsets < n_cols
    row = tl.load(input_ptr + row_idx * input_row_stride + col_offsets, mask=mask, other=-float('inf')).to(tl.float32)
    numerator = tl.exp(row{SUBTRACT_MAX})
    out = numerator / tl.sum(numerator, axis=0)
    tl.store(output_ptr + row_idx * output_row_stride + col_offsets, out, mask=mask)
"""
TUTORIAL = REGISTER.format(KERNEL=TUTORIAL_KERNEL, NAME="tutorial")

# A defect that shows only in bf16: x - max is computed in the logits' own dtype. At logits of scale
# 20 (max about 50), fp16's probabilities leave its normal range below e^-10, where x is within a
# factor 2 of the max and x - max is exact in fp16; bf16 has fp32's range, so probabilities down to
# e^-87 are judged, and there x - max (64 to 87) is rounded to a multiple of 0.5: off by up to 0.25,
# a relative error of up to 28 % in the probability. fp32 computes it in fp32.
SHIFT_IN_DTYPE = REGISTER.format(NAME="shift16", KERNEL="""
@triton.jit
def softmax_kernel(output_ptr, input_ptr, input_row_stride, output_row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    row_idx = tl.program_id(0)
    col_offsets = tl.arange(0, BLOCK_SIZE)
    mask = col_offsets < n_cols
    row = tl.load(input_ptr + row_idx * input_row_stride + col_offsets, mask=mask, other=-float('inf'))
    row_max = tl.max(row, axis=0).to(row.dtype)  # kept in the logits' dtype (tl.max returns fp32 for 16 bits)
    numerator = tl.exp((row - row_max).to(tl.float32))
    out = numerator / tl.sum(numerator, axis=0)
    tl.store(output_ptr + row_idx * output_row_stride + col_offsets, out, mask=mask)
""")

# A kernel that keeps its running sum of exponentials in the input's dtype, block by block: in bf16
# every addition rounds to 8 bits (on a GPU, and now under the interpreter)
RUNNING_SUM_IN_DTYPE = REGISTER.format(NAME="sum16", KERNEL="""
@triton.jit
def softmax_kernel(output_ptr, input_ptr, input_row_stride, output_row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    BLOCK: tl.constexpr = 128
    cols = tl.arange(0, BLOCK)
    x_row = input_ptr + tl.program_id(0) * input_row_stride
    y_row = output_ptr + tl.program_id(0) * output_row_stride
    m = -float('inf')
    for start in range(0, n_cols, BLOCK):
        x = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=-float('inf')).to(tl.float32)
        m = tl.maximum(m, tl.max(x, 0))
    s = tl.zeros([], input_ptr.dtype.element_ty)
    for start in range(0, n_cols, BLOCK):
        x = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=-float('inf')).to(tl.float32)
        s += tl.sum(tl.exp(x - m).to(input_ptr.dtype.element_ty), 0)
    for start in range(0, n_cols, BLOCK):
        x = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=-float('inf')).to(tl.float32)
        tl.store(y_row + start + cols, tl.exp(x - m) / s, mask=start + cols < n_cols)
""")

# The tutorial's kernel, plus a per-call statistic accumulated with tl.atomic_add in the input's dtype:
# the interpreter has no bf16 atomics (it raises), and the emulation does not cover them
ATOMIC_STATISTIC = """
import torch
import triton
import triton.language as tl
import pytest_precision


@triton.jit
def softmax_kernel(output_ptr, input_ptr, total_ptr, input_row_stride, output_row_stride, n_cols, BLOCK_SIZE: tl.constexpr):
    row_idx = tl.program_id(0)
    col_offsets = tl.arange(0, BLOCK_SIZE)
    mask = col_offsets < n_cols
    row = tl.load(input_ptr + row_idx * input_row_stride + col_offsets, mask=mask, other=-float('inf')).to(tl.float32)
    numerator = tl.exp(row - tl.max(row, axis=0))
    denominator = tl.sum(numerator, axis=0)
    tl.atomic_add(total_ptr, denominator.to(total_ptr.dtype.element_ty))
    tl.store(output_ptr + row_idx * output_row_stride + col_offsets, numerator / denominator, mask=mask)


@pytest_precision.register("atomic", kind="softmax")
def softmax(x):
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.empty_like(x2)
    total = torch.zeros(1, dtype=x.dtype)
    softmax_kernel[(x2.shape[0],)](y, x2, total, x2.stride(0), y.stride(0), x2.shape[1],
                                   BLOCK_SIZE=triton.next_power_of_2(x2.shape[1]))
    return y.reshape(x.shape)
"""


def _session(pytester, monkeypatch, conftest: str):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the user's triton.jit reads it
    pytester.makeconftest(conftest)
    pytester.makeini("[pytest]\n")


ARGS = ("--precision-suite", "--precision-no-speed", "-p", "no:cacheprovider", "-rfx")


# ---- the canary -----------------------------------------------------------------------------------

@needs_defects
def test_the_canary_measures_each_bf16_defect_and_none_remains_under_the_emulation():
    defects = interpreter_defects()
    assert [d.ops for d in defects] == ["arithmetic", "comparison", "cast", "cast", "dot", "sum"], defects
    evidence = [str(d) for d in defects]
    assert evidence[0] == "its bf16 arithmetic is wrong (1.5 * 2 gives 0, not 3)"
    assert evidence[1] == "its bf16 comparisons are wrong (-1 < -2 gives True)"
    assert evidence[2].startswith("its fp32 -> bf16 store rounds wrong (1.004882812 stored as 1, correctly rounded "
                                  "1.0078125)")
    assert evidence[3].startswith("its fp32 -> bf16 cast garbles subnormals (1.828e-40 gives 1.157e-38")
    assert residual_interpreter_defects() == ()


@needs_defects
def test_the_canary_sees_a_defect_the_emulation_leaves(monkeypatch):
    """Planted: the emulation without its dot. The canary run under it reports exactly the dot."""
    import numpy as np

    from pytest_precision.platform import interpreter_bf16
    from pytest_precision.platform.triton_canary import measure_defects

    monkeypatch.setattr(interpreter_bf16, "_dot", lambda original: original)
    with interpret_env(True), np.errstate(all="ignore"), interpreter_bf16.emulate_bf16():
        residual = measure_defects()
    assert [d.ops for d in residual] == ["dot"], residual
    assert "ones(16, 16) @ ones(16, 16) gives" in str(residual[0])


@needs_interpreter
def test_the_emulation_is_entered_only_where_the_canary_found_a_defect(monkeypatch):
    from pytest_precision.platform.interpreter_bf16 import emulating

    with kinds_triton.bf16_as_on_gpu():
        assert emulating() == bool(interpreter_defects())
    monkeypatch.setattr(kinds_triton, "interpreter_defects", lambda: ())  # a triton whose interpreter is right
    with kinds_triton.bf16_as_on_gpu():
        assert not emulating()


# ---- verdicts -------------------------------------------------------------------------------------

@needs_interpreter
def test_a_bf16_kernel_is_not_failed_for_the_interpreters_rounding(pytester, monkeypatch):
    """The tutorial's softmax in bf16 (xfailed before the emulation: the raw interpreter truncated
    its stores) is judged and passes, like its fp32 case."""
    _session(pytester, monkeypatch, TUTORIAL.format(SUBTRACT_MAX=" - tl.max(row, axis=0)"))
    args = (*ARGS, "-k", "tutorial and scale20 and not scale200", "--precision-configs=fp32,bf16")
    pytester.runpytest(*args, "--precision-update-baselines")
    result = pytester.runpytest(*args)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["| tutorial | bf16 * | pass *"])
    assert "Triton's interpreter" not in result.stdout.str()


@needs_defects
def test_a_bf16_only_defect_fails(pytester, monkeypatch):
    """x - max in the logits' dtype: right in fp32, invisible in fp16 at this scale, and failed in
    bf16, on the kernel's own numbers (before the emulation it was xfailed as the interpreter's)."""
    _session(pytester, monkeypatch, SHIFT_IN_DTYPE)
    result = pytester.runpytest(*ARGS, "-k", "shift16 and scale20 and not scale200",
                                "--precision-configs=fp32,fp16,bf16", "--precision-update-baselines")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*softmax[[]shift16-bf16-scale20[]]: FAIL accuracy*oracle: max ULP *"])
    out = result.stdout.str()
    assert "Triton's interpreter" not in out and "XFAIL" not in out, out[-3000:]


@needs_defects
def test_a_kernel_summing_in_bf16_fails(pytester, monkeypatch):
    _session(pytester, monkeypatch, RUNNING_SUM_IN_DTYPE)
    result = pytester.runpytest(*ARGS, "-k", "sum16 and len32768", "--precision-configs=fp32,bf16",
                                "--precision-update-baselines")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*softmax[[]sum16-bf16-len32768[]]: FAIL accuracy*oracle: max ULP *"])
    assert "Triton's interpreter" not in result.stdout.str()


@needs_defects
def test_a_bf16_op_the_emulation_does_not_cover_is_xfailed_naming_it(pytester, monkeypatch):
    _session(pytester, monkeypatch, ATOMIC_STATISTIC)
    result = pytester.runpytest(*ARGS, "-k", "atomic and scale20 and not scale200", "--precision-configs=fp32,bf16",
                                "--precision-update-baselines")
    result.assert_outcomes(passed=1, xfailed=1)
    result.stdout.fnmatch_lines([
        "XFAIL *softmax[[]atomic-bf16-scale20[]] - Triton's interpreter (triton *) cannot judge this bfloat16 case: "
        "kernel softmax_kernel ran tl.atomic_add on bfloat16 operands, which the interpreter does not run as a "
        "GPU does and the harness does not emulate; the call raised InterpreterError: *Unsupported data type*"])
    out = result.stdout.str()
    assert "FAIL 1/1: crash" not in out and "crashed:" not in out, out[-3000:]


@needs_defects
def test_the_excuse_names_only_what_a_launch_met(monkeypatch):
    from pytest_precision.platform.triton_canary import Defect

    clean = Launch("clean_kernel", ("bfloat16", "bfloat16"), bf16_ops={"arithmetic", "cast", "sum"})
    assert interpreter_excuse([clean]) is None  # bf16 emulated throughout: judged like any other case
    noted = Launch("scaled_kernel", ("bfloat16",), bf16_ops={"cast"}, unemulated={"tl.dot_scaled"})
    assert "kernel scaled_kernel ran tl.dot_scaled on bfloat16 operands" in interpreter_excuse([clean, noted])
    assert "clean_kernel" not in interpreter_excuse([clean, noted])
    # a defect the emulation left: cited where the launch computed that class of op, and only there
    monkeypatch.setattr(kinds_triton, "residual_interpreter_defects", lambda: (Defect("dot", "its dot is off"),))
    assert interpreter_excuse([clean]) is None
    dotted = Launch("dot_kernel", ("bfloat16",), bf16_ops={"dot"})
    assert interpreter_excuse([clean, dotted]).count("kernel dot_kernel computed bf16 dot, and even under the "
                                                     "harness's bf16 emulation its dot is off") == 1


@needs_interpreter
def test_a_fault_inside_an_interpreted_kernel_names_the_kernel(pytester, monkeypatch):
    _session(pytester, monkeypatch, TUTORIAL.format(SUBTRACT_MAX=""))  # no max subtraction: exp overflows past 88
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
    # its own process, as a user's run is: in a worker that ran hundreds of in-process sessions
    # before it, the trace once saw no launch (CI, 2026-11-28; not reproduced alone)
    result = pytester.runpytest_subprocess("--precision-suite", "--precision-no-speed", "-p", "no:cacheprovider",
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


# a model whose activation is an interpreted Triton kernel squaring in the activations' dtype
TRAINED_KERNEL = """
import torch
import triton
import triton.language as tl
import pytest_precision


@triton.jit
def square_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(y_ptr + offs, x * x, mask=mask)  # bf16 x bf16 under the bf16 configs


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        x = x.contiguous()
        y = torch.empty_like(x)
        square_kernel[(triton.cdiv(x.numel(), 256),)](x, y, x.numel(), BLOCK=256)
        return y

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc2(Square.apply(self.fc1(x))).float(), y)


def batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g)


pytest_precision.register("squared", pytest_precision.TrainSpec(
    Net, lambda p: torch.optim.SGD(p, lr=0.01), batch, steps=4), kind="train_step")
"""


@needs_defects
def test_a_training_step_with_a_bf16_kernel_is_judged_as_on_a_gpu(pytester, monkeypatch):
    """The bf16 emulation covers training cases too: a model whose Triton kernel squares bf16
    activations trains within the bf16 limits of its fp32 run (the raw interpreter's bf16 products
    of the bit patterns sent its loss far off)."""
    _session(pytester, monkeypatch, TRAINED_KERNEL)
    result = pytester.runpytest(*ARGS, "-k", "train_step and not ddp", "--precision-configs=fp32,bf16,amp-bf16",
                                "--precision-update-baselines")
    # fp32, amp-bf16, bf16, and with them bf16-sr and the FSDP2 bf16 pair, whose spawned ranks run the
    # kernel in bf16 under the same emulation (without it the bit-pattern products fail them); not
    # ddp-bf16, whose ranks run the model in fp32 (its hook compresses the gradients)
    result.assert_outcomes(passed=6)
    result.stdout.fnmatch_lines(["| squared *| bf16 *|*| pass *|", "| squared *| fsdp-bf16 *|*| pass *|"])


@needs_defects
def test_a_model_importing_its_kernel_only_when_built_is_emulated_from_its_first_step(pytester, monkeypatch):
    """A model_fn importing its Triton module when called: no triton in the process before the first
    case (a fresh process), yet its bf16 run is emulated from step 0, not only from a later case."""
    _session(pytester, monkeypatch, "")
    kernel, spec = TRAINED_KERNEL.split("\n\ndef batch(i):", 1)
    pytester.makepyfile(squared_model=kernel)
    pytester.makeconftest("""
import torch
import pytest_precision


def model():
    from squared_model import Net  # imports triton now
    return Net()


def batch(i):""" + spec.replace("    Net, lambda p", "    model, lambda p"))
    # bf16 and bf16-sr in this process (the FSDP2 ranks are fresh processes: the test above)
    result = pytester.runpytest_subprocess(*ARGS, "-k", "train_step and not ddp and not fsdp",
                                           "--precision-configs=bf16", "--precision-update-baselines")
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) >= 1 and "failed" not in outcomes, result.stdout.str()[-3000:]
