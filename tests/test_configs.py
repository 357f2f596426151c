"""configs: ids, availability, input rounding, fp8 emulation, and flags restored on error."""
import pytest
import torch

from pytest_precision.numerics.configs import CONFIG_IDS, CONFIGS, fp8_roundtrip, fp8_scale, select_configs


def test_stable_ids_in_matrix_order():
    assert CONFIG_IDS == ("fp32", "tf32", "fp16", "bf16", "amp-fp16", "amp-bf16", "fp8-e4m3")
    assert [c.id for c in select_configs("bf16, fp16")] == ["fp16", "bf16"]
    with pytest.raises(ValueError, match="unknown config id.s. fp64; known: fp32, tf32"):
        select_configs("fp64")


def test_cpu_runs_all_but_tf32():
    reasons = {c.id: c.skip_reason("cpu") for c in CONFIGS.values()}
    assert [k for k, r in reasons.items() if r] == ["tf32"]
    assert "CUDA" in reasons["tf32"]


@pytest.mark.parametrize("cid", ["amp-fp16", "amp-bf16"])
def test_autocast_restored_also_on_error(cid):
    assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(RuntimeError, match="boom"):
        with CONFIGS[cid].active("cpu"):
            assert torch.is_autocast_enabled("cpu")
            assert torch.get_autocast_dtype("cpu") == CONFIGS[cid].autocast_dtype
            raise RuntimeError("boom")
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TF32 flags are entered on CUDA only")
def test_tf32_flags_restored_on_error():
    before = torch.backends.cuda.matmul.allow_tf32
    with pytest.raises(RuntimeError):
        with CONFIGS["tf32"].active("cuda"):
            assert torch.backends.cuda.matmul.allow_tf32
            raise RuntimeError
    assert torch.backends.cuda.matmul.allow_tf32 == before


def test_prepare_rounds_inputs_and_gives_the_same_values_exactly():
    x = torch.tensor([10.01, 1 / 3, -65519.0])
    p = CONFIGS["fp16"].prepare(x, "cpu")
    assert p.value.dtype == torch.float16 and p.exact.dtype == torch.float64
    assert torch.equal(p.value.double(), p.exact)
    assert p.exact[0] != 10.01  # rounded, as the callable sees it
    assert torch.equal(CONFIGS["amp-bf16"].prepare(x, "cpu").value, x)  # autocast casts inside


def test_fp8_scale_is_a_power_of_two_and_dequantisation_exact():
    x = torch.tensor([0.3, -900.0, float("-inf"), 5.0])
    s = fp8_scale(x, torch.float8_e4m3fn)
    assert s == 4.0  # 900 / 448 -> 2**1
    q, s2 = fp8_roundtrip(x, torch.float8_e4m3fn)
    assert s2 == s and q[2] == float("-inf")  # masks pass through
    assert torch.equal((q[[0, 1, 3]] / s).to(torch.float8_e4m3fn).float() * s, q[[0, 1, 3]])
    assert fp8_scale(torch.zeros(3), torch.float8_e4m3fn) == 1.0
