"""The tensor-core alignment lint: aligned matmuls pass silently, misaligned ones are named."""
import pytest
import torch
import torch.nn.functional as F
from machine import ON_CPU

from pytest_precision.speed.alignment import required_multiple, tensor_core_misalignments

pytest_plugins = ["pytester"]


def _mm(m, k, n, dtype):
    a, b = torch.ones(m, k, dtype=dtype), torch.ones(k, n, dtype=dtype)
    return lambda: a @ b


def test_aligned_16_bit_matmul_is_not_flagged():
    assert tensor_core_misalignments(_mm(16, 64, 32, torch.bfloat16)) == []
    assert tensor_core_misalignments(_mm(16, 64, 32, torch.float16)) == []


def test_misaligned_16_bit_matmul_names_op_dims_and_line():
    (m,) = tensor_core_misalignments(_mm(17, 59, 32, torch.bfloat16))
    assert m.op == "aten::mm" and m.dtype == "bfloat16" and m.dims == (("M", 17), ("K", 59)) and m.multiple == 8
    assert m.describe().startswith("aten::mm in bfloat16 at test_alignment.py:")
    assert "M=17, K=59 not a multiple of 8" in m.describe()


def test_fp32_without_tf32_has_no_tensor_cores_to_miss():
    assert tensor_core_misalignments(_mm(17, 59, 33, torch.float32)) == []
    assert required_multiple(torch.float32, "cpu") is None


def test_fp32_on_cuda_needs_four_elements_only_under_tf32():
    """Read through torch's fp32_precision settings: also when the legacy getter would raise (TF32
    set through the new API while allow_tf32 says otherwise)."""
    from pytest_precision.numerics.configs import tf32_flags

    matmul = torch.backends.cuda.matmul
    saved = getattr(matmul, "fp32_precision", None)
    with tf32_flags(False):
        assert required_multiple(torch.float32, "cuda") is None
    with tf32_flags(True):
        assert required_multiple(torch.float32, "cuda") == 4
        assert required_multiple(torch.float32, "cpu") is None
    if saved is not None:
        try:
            matmul.fp32_precision = "tf32"  # new API only: matmul.allow_tf32 now raises
            assert required_multiple(torch.float32, "cuda") == 4
        finally:
            matmul.fp32_precision = saved


def test_multiples_are_sixteen_bytes_of_elements():
    assert required_multiple(torch.float16, "cuda") == 8
    assert required_multiple(torch.bfloat16, "cpu") == 8
    assert required_multiple(torch.float8_e4m3fn, "cuda") == 16
    assert required_multiple(torch.float8_e5m2, "cuda") == 16
    assert required_multiple(torch.int32, "cuda") is None


@pytest.mark.parametrize("width, flagged", [(128, False), (100, True)])
def test_sees_the_dtype_autocast_chose(width, flagged):
    layer = torch.nn.Linear(width, 64)
    x = torch.randn(8, width)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return layer(x)
    found = tensor_core_misalignments(step)
    assert bool(found) == flagged
    if flagged:
        assert found[0].dtype == "bfloat16" and ("K", 100) in found[0].dims


def test_attention_head_dim():
    q = torch.randn(1, 2, 32, 59, dtype=torch.bfloat16)
    (m,) = tensor_core_misalignments(lambda: F.scaled_dot_product_attention(q, q, q))
    assert ("head dim", 59) in m.dims and "attention" in m.op
    q64 = torch.randn(1, 2, 32, 64, dtype=torch.bfloat16)
    assert tensor_core_misalignments(lambda: F.scaled_dot_product_attention(q64, q64, q64)) == []


def test_each_distinct_matmul_reported_once():
    call = _mm(17, 59, 32, torch.float16)
    assert len(tensor_core_misalignments(lambda: [call() for _ in range(5)])) == 1


def test_suite_warns_about_the_targets_own_shapes_once(pytester):
    """The suite's deliberately irregular regimes (head dim 59) are not the user's shapes: quiet. A
    target whose own code runs a misaligned 16-bit matmul (a projection to width 100) is flagged,
    once per target, op and shape however many cases run it, and nothing fails for it."""
    pytester.makeini("[pytest]\n")
    pytester.makeconftest("""
import torch
import pytest_precision

@pytest_precision.register("projected", kind="attention")
def projected(q, k, v, causal=False, key_padding_mask=None):
    w = torch.full((100, 16), 0.01, dtype=q.dtype)
    (q[..., :16] @ w.t()).sum()  # a width-100 projection, as a model with hidden size 100 has
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
""")
    r = pytester.runpytest("--precision-suite", "-p", "no:cacheprovider", "--precision-configs=bf16,fp32", *ON_CPU,
                           "--precision-update-baselines", "-k", "attention and flash and not pad and not fresh", "-W",
                           "always::pytest_precision.speed.alignment.TensorCoreAlignmentWarning")
    r.assert_outcomes(passed=26, skipped=2)  # gqa: the flash backend cannot run it on a CPU
    flagged = [line for line in r.outlines if "not a multiple of" in line]
    assert len(flagged) == 1 and "target 'projected'" in flagged[0] and "N=100" in flagged[0], flagged
    assert "head dim=59" not in r.stdout.str() and "head dim=40" not in r.stdout.str()
