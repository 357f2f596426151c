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


# ---------------------------------------------------------------- TF32 flags, both of torch's APIs
# torch's flags are process-wide and exist without CUDA, so the flag logic runs here; each test
# restores them (the TF32_STATE fixture), whatever it leaves behind.

B = torch.backends
NEW_API = hasattr(B, "fp32_precision")


def _settings():
    return (B.fp32_precision, B.cuda.matmul.fp32_precision, B.cudnn.fp32_precision, B.cudnn.conv.fp32_precision,
            B.cudnn.rnn.fp32_precision)


@pytest.fixture
def tf32_state():
    """torch's TF32 settings as they were before the test, restored after it: the legacy flags
    (whose setters also write the new settings), then the new settings."""
    legacy = (B.cuda.matmul.allow_tf32, B.cudnn.allow_tf32, torch.get_float32_matmul_precision())
    saved = _settings() if NEW_API else None
    yield
    B.cuda.matmul.allow_tf32, B.cudnn.allow_tf32 = legacy[:2]
    torch.set_float32_matmul_precision(legacy[2])
    if NEW_API:
        (B.fp32_precision, B.cuda.matmul.fp32_precision, B.cudnn.fp32_precision, B.cudnn.conv.fp32_precision,
         B.cudnn.rnn.fp32_precision) = saved


def _legacy_reads():
    """What the legacy getters say, or the error they raise."""
    out = []
    for read in (lambda: B.cuda.matmul.allow_tf32, lambda: B.cudnn.allow_tf32, torch.get_float32_matmul_precision):
        try:
            out.append(read())
        except RuntimeError as e:
            out.append(f"raises: {str(e)[:40]}")
    return out


def _user_state(how):
    """A state a user could have left TF32 in before the run."""
    if how == "legacy on":
        B.cuda.matmul.allow_tf32 = True
        B.cudnn.allow_tf32 = True
    elif how == "matmul precision high":
        torch.set_float32_matmul_precision("high")
    elif how == "new api on":
        B.cuda.matmul.fp32_precision = "tf32"
        B.cudnn.conv.fp32_precision = "tf32"
    elif how == "new api generic":
        B.fp32_precision = "tf32"
    elif how == "mixed":  # legacy on, then the new API off: the legacy getter now raises
        B.cuda.matmul.allow_tf32 = True
        B.cuda.matmul.fp32_precision = "ieee"


STATES = ["default", "legacy on", "matmul precision high", "new api on", "new api generic", "mixed"]
ALLOWED = {"default": False, "legacy on": True, "matmul precision high": True, "new api on": True,
           "new api generic": True, "mixed": False}


@pytest.mark.skipif(not NEW_API, reason="torch before 2.9 has only the legacy flags")
@pytest.mark.parametrize("how", STATES)
def test_tf32_read_in_either_world_and_restored_exactly(tf32_state, how):
    from pytest_precision.numerics.configs import tf32_flags, tf32_matmul_allowed

    _user_state(how)
    before, legacy_before = _settings(), _legacy_reads()
    assert tf32_matmul_allowed() is ALLOWED[how]  # never raises, whichever API set it
    for enabled in (True, False):
        with pytest.raises(RuntimeError, match="boom"):
            with tf32_flags(enabled):
                assert tf32_matmul_allowed() is enabled
                assert B.cuda.matmul.fp32_precision == B.cudnn.conv.fp32_precision == ("tf32" if enabled else "ieee")
                raise RuntimeError("boom")
        assert _settings() == before
        assert _legacy_reads() == legacy_before  # as readable (or not) as the user left them
        assert tf32_matmul_allowed() is ALLOWED[how]


def test_tf32_config_enters_the_flags_on_cuda_only(tf32_state):
    from pytest_precision.numerics.configs import tf32_matmul_allowed

    with CONFIGS["tf32"].active("cuda"):  # the flag logic needs no GPU
        assert tf32_matmul_allowed()
    with CONFIGS["fp32"].active("cuda"):
        assert not tf32_matmul_allowed()
    with CONFIGS["tf32"].active("cpu"):  # the CPU has no TF32 path: nothing touched
        assert tf32_matmul_allowed() is False
    assert not tf32_matmul_allowed()


def test_tf32_flags_with_only_the_legacy_api(tf32_state, monkeypatch):
    """torch before 2.9: allow_tf32 set and restored, also on error."""
    from pytest_precision.numerics import configs

    monkeypatch.setattr(configs, "_precision_api", lambda: False)
    before = (B.cuda.matmul.allow_tf32, B.cudnn.allow_tf32)
    with pytest.raises(RuntimeError, match="boom"):
        with configs.tf32_flags(True):
            assert B.cuda.matmul.allow_tf32 and B.cudnn.allow_tf32 and configs.tf32_matmul_allowed()
            raise RuntimeError("boom")
    assert (B.cuda.matmul.allow_tf32, B.cudnn.allow_tf32) == before


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
