"""The bf16 emulation under Triton's interpreter (pytest_precision.platform.interpreter_bf16): each class
of op on bf16 operands, inside a tiny interpreted kernel, gives the bits torch's bf16 op gives
(torch's CPU bf16 ops compute in fp32 and round once to nearest even: the semantics a GPU has),
negatives, subnormals, inf and NaN included; what it cannot emulate is noted on the launch; and
the interpreter is restored when it ends."""
import math

import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pytest_precision.platform.launches import watch_launches  # noqa: E402
from pytest_precision.platform.triton import interpret_env, interpreter_defects, interpreting  # noqa: E402

pytestmark = [pytest.mark.skipif(not interpreting(), reason="triton was imported without the interpreter"),
              # the interpreter's numpy ops warn on the edge operands (inf - inf, 3e38 * 2e38), as they do in fp32
              pytest.mark.filterwarnings("ignore::RuntimeWarning")]
if interpreting():
    from triton.runtime import interpreter
    from triton.runtime.errors import InterpreterError

    from pytest_precision.platform.interpreter_bf16 import emulate_bf16, emulating

BF16 = torch.bfloat16
SUB = 2.0 ** -133  # the smallest bf16 subnormal


def jit(fn):
    """``fn`` as an interpreted Triton kernel (triton decides at jit time; tests/conftest.py left
    TRITON_INTERPRET unset for the pytester sessions)."""
    with interpret_env(True):
        return triton.jit(fn)


def run(kernel, *args, grid=(1,), **kwargs):
    """Launch ``kernel`` under the emulation."""
    with interpret_env(True), emulate_bf16():
        kernel[grid](*args, **kwargs)


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit, any NaN matching any NaN."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if not got.is_floating_point():
        return torch.equal(got, want)
    nan = torch.isnan(got) & torch.isnan(want)
    wide = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    return bool(((got.view(wide) == want.view(wide)) | nan).all())


def show(got, want):
    return f"\ngot  {got.tolist()}\nwant {want.tolist()}"


# operands: negatives, subnormals, the largest finite values, inf, NaN (against NaN too: the same bits,
# yet not equal), and sums that are ties (1 + 2^-8 rounds to even 1, 1.0078125 + 2^-8 to even 1.015625)
X = torch.tensor([1.5, -2.0, 3.0, 0.1, -0.3, 1.0, 1.0078125, -1.0, SUB, -5 * SUB, 2.0 ** -126, 3e38, -3e38,
                  math.inf, -math.inf, math.nan, 0.0, -7.5, 100.0, 1e-20, -1e30, 2.0, 0.5, -0.0,
                  12.25, -6.0, 1e-38, 255.0, -1.0e-3, 65504.0, 7.0, -4.0], dtype=BF16)
Y = torch.tensor([2.0, 1.0, -3.5, 3.0, 0.7, 2.0 ** -8, 2.0 ** -8, -2.0, 3 * SUB, SUB, -(2.0 ** -127), 2e38, -2e38,
                  1.0, math.inf, math.nan, 5.0, -7.5, -0.01, 1e20, 3.0, math.nan, -0.5, 1.25,
                  -0.75, -6.0, 1e-38, 1.0, 1.0e-3, 2.0, -7.0, 3.0], dtype=BF16)
Z = torch.flip(X, [0])
N = X.numel()
OPS = {  # name -> (OP id in the kernel, torch's result)
    "add": (0, lambda x, y, z: x + y),
    "sub": (1, lambda x, y, z: x - y),
    "mul": (2, lambda x, y, z: x * y),
    "neg": (3, lambda x, y, z: -x),
    # x * y is exact in fp32; the fp64 sum rounded to fp32 is fp32's fma (p' = 53 >= 2 * 24 + 2), then bf16
    "fma": (4, lambda x, y, z: (x.double() * y.double() + z.double()).float().to(BF16)),
    "maximum": (5, lambda x, y, z: torch.fmax(x, y)),  # tl.maximum ignores NaN by default
    "maximum-nan": (6, lambda x, y, z: torch.maximum(x, y)),
    "minimum": (7, lambda x, y, z: torch.fmin(x, y)),
    "clamp": (8, lambda x, y, z: torch.fmin(torch.fmax(x, torch.fmin(y, z)), torch.fmax(y, z))),
    "constant": (9, lambda x, y, z: x * torch.tensor(1.1).to(BF16)),  # the Python float 1.1 becomes bf16
    "where": (10, lambda x, y, z: torch.where(x < y, x, y)),
    "less": (11, lambda x, y, z: x < y),
    "less-equal": (12, lambda x, y, z: x <= y),
    "greater": (13, lambda x, y, z: x > y),
    "greater-equal": (14, lambda x, y, z: x >= y),
    "equal": (15, lambda x, y, z: x == y),
    "not-equal": (16, lambda x, y, z: x != y),
}
COMPARES = 11  # OP ids from here on give booleans (stored as int8)


@jit
def elementwise(x_ptr, y_ptr, z_ptr, out_ptr, N: tl.constexpr, OP: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    y = tl.load(y_ptr + i)
    z = tl.load(z_ptr + i)
    if OP == 0:
        r = x + y
    elif OP == 1:
        r = x - y
    elif OP == 2:
        r = x * y
    elif OP == 3:
        r = -x
    elif OP == 4:
        r = tl.fma(x, y, z)
    elif OP == 5:
        r = tl.maximum(x, y)
    elif OP == 6:
        r = tl.maximum(x, y, propagate_nan=tl.PropagateNan.ALL)
    elif OP == 7:
        r = tl.minimum(x, y)
    elif OP == 8:
        r = tl.clamp(x, tl.minimum(y, z), tl.maximum(y, z))
    elif OP == 9:
        r = x * 1.1
    elif OP == 10:
        r = tl.where(x < y, x, y)
    elif OP == 11:
        r = (x < y).to(tl.int8)
    elif OP == 12:
        r = (x <= y).to(tl.int8)
    elif OP == 13:
        r = (x > y).to(tl.int8)
    elif OP == 14:
        r = (x >= y).to(tl.int8)
    elif OP == 15:
        r = (x == y).to(tl.int8)
    else:
        r = (x != y).to(tl.int8)
    tl.store(out_ptr + i, r)


@pytest.mark.parametrize("name", list(OPS))
def test_an_elementwise_bf16_op_gives_torchs_bits(name):
    op, torch_op = OPS[name]
    out = torch.empty(N, dtype=torch.int8 if op >= COMPARES else BF16)
    run(elementwise, X, Y, Z, out, N=N, OP=op)
    want = torch_op(X, Y, Z)
    want = want.to(torch.int8) if op >= COMPARES else want
    assert same_bits(out, want), show(out, want)


def test_bf16_math_functions_round_the_fp32_result():
    """tl.exp and the other math functions refuse bf16 in triton's front end, so bf16 reaches these
    builder ops only from other code: each computes the interpreter's fp32 function and rounds."""
    from triton.runtime.interpreter import TensorHandle

    builder = interpreter.interpreter_builder
    x = torch.tensor([0.5, 1.5, 3.0, 7.25, 100.0, 2.0 ** -120, 0.0, math.inf], dtype=BF16)
    handle = TensorHandle(x.view(torch.int16).numpy().view("uint16"), tl.bfloat16)
    exact = {"create_sqrt": torch.sqrt, "create_floor": torch.floor, "create_ceil": torch.ceil}
    close = {"create_exp": torch.exp, "create_log": torch.log, "create_sin": torch.sin, "create_cos": torch.cos,
             "create_exp2": torch.exp2, "create_log2": torch.log2, "create_rsqrt": torch.rsqrt}
    with emulate_bf16():
        for name, torch_op in {**exact, **close}.items():
            result = getattr(builder, name)(handle)
            assert result.dtype == tl.bfloat16
            got = torch.from_numpy(result.data.view("int16")).view(BF16)
            want = torch_op(x)
            if name in exact:
                assert same_bits(got, want), name + show(got, want)
            else:  # numpy's and torch's fp32 functions may differ in the last fp32 bit: one bf16 step at most
                steps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
                assert bool(((steps <= 1) | (torch.isnan(got) & torch.isnan(want))).all()), name + show(got, want)


@jit
def cast(x_ptr, y_ptr, N: tl.constexpr, RTZ: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    if RTZ:
        y = x.to(y_ptr.dtype.element_ty, fp_downcast_rounding="rtz")
    else:
        y = x.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + i, y)


CASTS = {  # name -> the source values, the destination dtype
    "fp32-to-bf16": (torch.tensor([1.0048828125, 1.00390625, 1.01171875, -1.0048828125, 1.828e-40, -3.0e-39,
                                   1.1754942e-38, 3.4028235e38, 3.3961e38, -0.0, math.inf, math.nan, 1e-45,
                                   0.1, -65504.0, 7.0], dtype=torch.float32), BF16),
    "bf16-to-fp32": (X, torch.float32),
    "fp16-to-bf16": (torch.tensor([2.0 ** -24, 3 * 2.0 ** -24, 6.1e-5, 65504.0, -1.0009765625, 1.0029296875,
                                   math.inf, math.nan], dtype=torch.float16), BF16),
    "bf16-to-fp16": (torch.tensor([1e5, -1e5, 2.0 ** -20, 2.0 ** -30, 1.5, -SUB, 65504.0, math.nan], dtype=BF16),
                     torch.float16),
    # through fp32, as torch converts: 1 + 2^-8 + 2^-30 is 1 + 2^-8 in fp32, a tie, hence 1
    "fp64-to-bf16": (torch.tensor([1 + 2.0 ** -8 + 2.0 ** -30, 1e-45, 1e300, -3.3e38, 1e-40, math.nan, 2.5, -0.1],
                                  dtype=torch.float64), BF16),
    "bf16-to-fp64": (X, torch.float64),
    "int32-to-bf16": (torch.tensor([0, 1, -1, 257, 259, 2 ** 24 + 1, -(2 ** 30) - 64, 2 ** 31 - 1], dtype=torch.int32),
                      BF16),
    "bf16-to-int32": (torch.tensor([1.5, -2.5, 300.0, -0.75, 0.0, 1e9, -1e9, 255.0], dtype=BF16), torch.int32),
}


@pytest.mark.parametrize("name", list(CASTS))
def test_a_bf16_cast_rounds_to_nearest_even_as_torch(name):
    x, dtype = CASTS[name]
    y = torch.empty(x.numel(), dtype=dtype)
    run(cast, x, y, N=x.numel(), RTZ=False)
    want = x.to(dtype)
    assert same_bits(y, want), show(y, want)


def toward_zero(x: torch.Tensor) -> torch.Tensor:
    """x rounded toward zero to bf16: torch's nearest rounding, one step back where it went past x."""
    near = x.to(BF16)
    past = near.to(torch.float64).abs() > x.to(torch.float64).abs()
    return torch.where(past, (near.view(torch.int16) - 1).view(BF16), near)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_a_bf16_cast_asked_to_round_toward_zero_truncates(dtype):
    x = torch.tensor([1.0048828125, 1.01171875, -1.0048828125, -1.9999, 1.828e-40, -3.0e-39, 3.4028235e38,
                      -3.4e38, math.inf, -math.inf, math.nan, 0.0, -0.0, 0.1, 1 + 2.0 ** -9, 1e-45], dtype=dtype)
    y = torch.empty(x.numel(), dtype=BF16)
    run(cast, x, y, N=x.numel(), RTZ=True)
    want = toward_zero(x)
    assert same_bits(y, want), show(y, want)
    assert float(y[0]) == 1.0 and float(y[6]) == 3.3895313892515355e38  # not rounded up, not to inf


@jit
def constant(y_ptr, N: tl.constexpr, VALUE: tl.constexpr):
    tl.store(y_ptr + tl.arange(0, N), tl.full([N], VALUE, tl.bfloat16))


def test_a_bf16_constant_is_rounded_to_nearest_even():
    y = torch.empty(4, dtype=BF16)
    run(constant, y, N=4, VALUE=1.0048828125)
    assert torch.equal(y, torch.full((4,), 1.0078125, dtype=BF16)), y


@jit
def dot(a_ptr, b_ptr, c_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tile = i[:, None] * N + i[None, :]
    tl.store(out_ptr + tile, tl.dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile), tl.load(c_ptr + tile)))


def test_a_bf16_dot_multiplies_values_and_accumulates_in_fp32():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-8, 9, (16, 16), generator=g).to(BF16)  # small integers: every sum exact in any order
    b = torch.randint(-8, 9, (16, 16), generator=g).to(BF16)
    c = torch.randint(-100, 100, (16, 16), generator=g).float()
    out = torch.empty(16, 16)
    run(dot, a, b, c, out, N=16)
    assert torch.equal(out, a.float() @ b.float() + c)
    a, b = torch.randn(16, 16, generator=g).to(BF16), torch.randn(16, 16, generator=g).to(BF16)
    run(dot, a, b, torch.zeros(16, 16), out, N=16)
    torch.testing.assert_close(out.double(), a.double() @ b.double(), rtol=1e-6, atol=1e-6)


def tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum a GPU-like tree gives, in torch's ops of x's dtype (each addition rounded): element i
    with element i + n/2, level by level."""
    x = x.movedim(dim, 0)
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        x = x[:half] + x[half:]
    return x[0]


@jit
def reduce_sum(x_ptr, rows_ptr, cols_ptr, total_ptr, R: tl.constexpr, C: tl.constexpr):
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    x = tl.load(x_ptr + r[:, None] * C + c[None, :])
    tl.store(rows_ptr + r, tl.sum(x, axis=1))
    tl.store(cols_ptr + c[None, :], tl.sum(x, axis=0, keep_dims=True))
    tl.store(total_ptr, tl.sum(x))


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=str)
def test_a_16_bit_sum_rounds_every_addition(dtype):
    x = (torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    rows, cols, total = torch.empty(8, dtype=dtype), torch.empty(64, dtype=dtype), torch.empty(1, dtype=dtype)
    run(reduce_sum, x, rows, cols, total, R=8, C=64)
    assert same_bits(rows, tree_sum(x, 1)), show(rows, tree_sum(x, 1))
    assert same_bits(cols, tree_sum(x, 0)), show(cols, tree_sum(x, 0))
    assert same_bits(total, tree_sum(x.flatten(), 0).reshape(1))
    once = x.float().sum(1).to(dtype)  # fp32 accumulation, rounded once: what numpy's sum gives for fp16
    assert not torch.equal(rows, once), "the rows' sums should show rounding at each addition"


def test_a_bf16_sum_with_inf_and_nan_is_inf_and_nan():
    x = torch.ones(8, 64, dtype=BF16)
    x[1, 3], x[2, 5], x[2, 6], x[3, 0] = math.inf, math.inf, -math.inf, math.nan
    rows, cols, total = torch.empty(8, dtype=BF16), torch.empty(64, dtype=BF16), torch.empty(1, dtype=BF16)
    run(reduce_sum, x, rows, cols, total, R=8, C=64)
    assert rows[0] == 64 and rows[1] == math.inf and rows[2].isnan() and rows[3].isnan(), rows


def test_an_fp16_sum_is_not_accumulated_in_fp32_under_the_emulation():
    """numpy sums fp16 in fp32 and rounds once; a GPU rounds each addition: 2048 + 1 is 2048 in fp16."""
    x = torch.tensor([[2048.0, 1.0, 1.0, 1.0]], dtype=torch.float16)
    rows, cols, total = torch.empty(1, dtype=torch.float16), torch.empty(4, dtype=torch.float16), torch.empty(1, dtype=torch.float16)
    run(reduce_sum, x, rows, cols, total, R=1, C=4)
    assert float(rows[0]) == 2050.0  # (2048 + 1) + (1 + 1): the first rounds to 2048
    with interpret_env(True):
        reduce_sum[(1,)](x, rows, cols, total, R=1, C=4)
    if float(rows[0]) != 2052.0:
        pytest.skip(f"this triton's interpreter sums fp16 otherwise ({float(rows[0])}): the README's trap is gone")


@jit
def extremes(x_ptr, max_ptr, argmax_ptr, min_ptr, argmin_ptr, R: tl.constexpr, C: tl.constexpr):
    r = tl.arange(0, R)
    x = tl.load(x_ptr + r[:, None] * C + tl.arange(0, C)[None, :])
    top, at = tl.max(x, axis=1, return_indices=True)
    low, where = tl.min(x, axis=1, return_indices=True)
    tl.store(max_ptr + r, top)
    tl.store(argmax_ptr + r, at)
    tl.store(min_ptr + r, low)
    tl.store(argmin_ptr + r, where)


def test_bf16_min_max_and_their_indices_compare_values():
    g = torch.Generator().manual_seed(2)
    x = (torch.randperm(8 * 32, generator=g).float().reshape(8, 32) - 128) * 0.75  # distinct, half negative
    x[3, 7], x[4, 2], x[5] = -math.inf, SUB, -torch.arange(1, 33).float()
    x = x.to(BF16)
    top, low = torch.empty(8, dtype=BF16), torch.empty(8, dtype=BF16)
    at, where = torch.empty(8, dtype=torch.int32), torch.empty(8, dtype=torch.int32)
    run(extremes, x, top, at, low, where, R=8, C=32)
    want_top, want_at = x.max(1)
    want_low, want_where = x.min(1)
    assert torch.equal(top, want_top) and torch.equal(at, want_at.int()), show(top, want_top)
    assert torch.equal(low, want_low) and torch.equal(where, want_where.int()), show(low, want_low)


def hillis_steele(x: torch.Tensor, combine) -> torch.Tensor:
    """An inclusive scan along the last dim, in torch's ops of x's dtype, each step rounded."""
    step = 1
    while step < x.shape[-1]:
        x = torch.cat([x[..., :step], combine(x[..., step:], x[..., :-step])], -1)
        step *= 2
    return x


@jit
def scans(x_ptr, sum_ptr, prod_ptr, reverse_ptr, R: tl.constexpr, C: tl.constexpr):
    tile = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    x = tl.load(x_ptr + tile)
    tl.store(sum_ptr + tile, tl.cumsum(x, axis=1))
    tl.store(prod_ptr + tile, tl.cumprod(x, axis=1))
    tl.store(reverse_ptr + tile, tl.cumsum(x, axis=1, reverse=True))


def test_bf16_scans_round_every_step():
    x = (1 + torch.rand(4, 32, generator=torch.Generator().manual_seed(3)) * 0.1).to(BF16)
    x[1] = -x[1]
    x[2, 5] = 250.0  # later elements add little to 250: rounding shows
    out = [torch.empty(4, 32, dtype=BF16) for _ in range(3)]
    run(scans, x, *out, R=4, C=32)
    want = (hillis_steele(x, torch.add), hillis_steele(x, torch.mul),
            hillis_steele(x.flip(-1), torch.add).flip(-1))
    for got, expect in zip(out, want):
        assert same_bits(got, expect), show(got, expect)


# ---- what the emulation notes, and that it ends -----------------------------------------------------

@jit
def accumulate(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.atomic_add(out_ptr + i, tl.load(x_ptr + i))


def test_a_bf16_op_it_does_not_emulate_is_noted_on_its_launch():
    x = torch.ones(4, dtype=BF16)
    with watch_launches() as launches, pytest.raises(InterpreterError, match="Unsupported data type"):
        run(accumulate, x, torch.zeros(4, dtype=BF16), N=4)  # the interpreter has no bf16 atomics
    assert [(launch.kernel, launch.unemulated) for launch in launches] == [("accumulate", {"tl.atomic_add"})]
    out = torch.zeros(4)
    with watch_launches() as launches:
        run(accumulate, x.float(), out, N=4)
    assert torch.equal(out, torch.ones(4)) and launches[0].unemulated == set()


@jit
def mixed(x_ptr, y_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tile = i[:, None] * N + i[None, :]
    x = tl.load(x_ptr + tile)
    y = tl.load(y_ptr + tile).to(tl.bfloat16)
    tl.store(out_ptr + tile, tl.dot(x * y, x) + tl.sum(x, axis=1)[:, None].to(tl.float32))


def test_each_class_of_emulated_bf16_op_is_noted_on_its_launch():
    x, y = torch.ones(16, 16, dtype=BF16), torch.ones(16, 16)
    with watch_launches() as launches:
        for operand in (x, x.float()):  # fp32 x: y's casts to bf16 and back are the only bf16 ops
            out = torch.empty(16, 16)
            run(mixed, operand, y, out, N=16)
            assert torch.equal(out, torch.full((16, 16), 32.0)), out
    assert [launch.bf16_ops for launch in launches] == [{"arithmetic", "cast", "dot", "sum"}, {"cast"}]


def test_the_interpreter_is_restored_when_the_emulation_ends():
    builder = interpreter.interpreter_builder
    before = (dict(vars(builder)), interpreter.ReduceOps.sum, interpreter.ReduceOps.min_max,
              interpreter.ScanOps.cumsum, interpreter.ScanOps.cumprod)
    with emulate_bf16():
        with emulate_bf16():  # re-entrant: the inner exit keeps it on
            pass
        assert emulating() and "create_fmul" in vars(builder)
    with pytest.raises(ZeroDivisionError), emulate_bf16():
        1 / 0
    assert not emulating()
    assert (dict(vars(builder)), interpreter.ReduceOps.sum, interpreter.ReduceOps.min_max,
            interpreter.ScanOps.cumsum, interpreter.ScanOps.cumprod) == before
    if interpreter_defects():  # and the interpreter's own bf16 is back
        out = torch.empty(N, dtype=BF16)
        with interpret_env(True):
            elementwise[(1,)](X, Y, Z, out, N=N, OP=OPS["mul"][0])
        assert float(out[0]) != 3.0


def test_the_emulations_roundings_are_not_taken_for_the_users_ops():
    """The emulation rounds with torch: the op tracer and the audit, which speak of the user's torch
    ops, see no more under it than under the raw interpreter (no "cast to bfloat16 in user code")."""
    from pytest_precision.explain.audit import audit
    from pytest_precision.explain.tracing import trace

    out = torch.empty(N, dtype=BF16)

    def call():
        elementwise[(1,)](X, Y, Z, out, N=N, OP=OPS["add"][0])

    with interpret_env(True):
        raw = [r.op for r in trace(call)]
        with emulate_bf16():
            emulated = [r.op for r in trace(call)]
            flags = audit(call, autocast=False)["flags"]
    assert emulated == raw and flags == [], (raw, emulated, flags)
