"""The attention suite end to end (pytester): SDPA passes every config and backend; each planted
defect is caught and named."""
import pytest
from machine import NOT_KERNELS, ON_CPU

pytest_plugins = ["pytester"]

HEADER = """
import math
import torch
import pytest_precision


def expand(k, heads):
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def masks(s, causal, key_padding_mask, off_by_one=False):
    sq, sk = s.shape[-2:]
    allowed = torch.ones(sq, sk, dtype=torch.bool).tril(1 if off_by_one else 0) if causal else torch.ones(sq, sk, dtype=torch.bool)
    allowed = allowed[None, None]
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    return s.masked_fill(~allowed, -math.inf)
"""

EAGER = HEADER + """
@pytest_precision.register("eager", kind="attention")
def eager(q, k, v, causal=False, key_padding_mask=None):
    qf, kf, vf = q.float(), expand(k, q.shape[1]).float(), expand(v, q.shape[1]).float()
    s = masks(qf @ kf.transpose(-1, -2) {SCALE}, causal, key_padding_mask, off_by_one={OFF_BY_ONE})
    return (torch.softmax(s, -1) @ vf).to(q.dtype)
"""

FP16_NAIVE = HEADER + """
@pytest_precision.register("fp16_scores", kind="attention")
def fp16_scores(q, k, v, causal=False, key_padding_mask=None):
    qh, kh, vh = q.half(), expand(k, q.shape[1]).half(), expand(v, q.shape[1]).half()
    s = masks(qh @ kh.transpose(-1, -2) / math.sqrt(q.shape[-1]), causal, key_padding_mask)
    e = s.exp()  # softmax in fp16, no max subtraction
    return ((e / e.sum(-1, keepdim=True)) @ vh).to(q.dtype)
"""

ONLINE = HEADER + """
@pytest_precision.register("online", kind="attention")
def online(q, k, v, causal=False, key_padding_mask=None, block=8):
    qf, kf, vf = q.float(), expand(k, q.shape[1]).float(), expand(v, q.shape[1]).float()
    s_all = masks(qf @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1]), causal, key_padding_mask)
    m = torch.full(s_all.shape[:-1] + (1,), -math.inf)
    l = torch.zeros_like(m)
    acc = torch.zeros(q.shape, dtype=torch.float32)
    for j in range(0, s_all.shape[-1], block):
        s = s_all[..., j:j + block]
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p = torch.exp(s - m_new)
        alpha = torch.exp(m - m_new)
        l = l * alpha + p.sum(-1, keepdim=True)
        acc = {ACC} + p @ vf[..., j:j + block, :]
        m = m_new
    return (acc / l).to(q.dtype)
"""


def _run(pytester, *args):
    """A session of the attention suite (softmax cases deselected)."""
    args = list(args)
    if "-k" in args:
        i = args.index("-k") + 1
        args[i] = f"attention and ({args[i]})"
    else:
        args += ["-k", "attention"]
    # accuracy only: timing is tested in test_speed.py, and timings taken under pytest -n are noise
    return pytester.runpytest("--precision-suite", "--precision-no-speed", "-p", "no:cacheprovider", *args)


def _accept_then_run(pytester, *args):
    _run(pytester, "--precision-update-baselines", *args)
    return _run(pytester, *args)


def test_sdpa_passes_every_config_and_backend(pytester):
    """The CPU's SDPA backends, on every machine (a CUDA machine has others, and lists the kernels)."""
    pytester.makeini("[pytest]\n")
    result = _accept_then_run(pytester, *ON_CPU, "-k", NOT_KERNELS)
    result.assert_outcomes(passed=132, skipped=22)  # 6 configs x {math, flash} x 11 regimes; tf32 skipped
    result.stdout.fnmatch_lines(["*precision summary, absolute error*", "*| target *| config *| *cases | max abs *| RMS abs *"])
    for config in ("fp32", "fp16", "bf16", "amp-fp16", "amp-bf16", "fp8-e4m3"):
        for backend in ("math", "flash"):
            result.stdout.fnmatch_lines([f"*| torch.sdpa *| {config}+{backend} *| *11 | *pass*"])


def test_correct_eager_and_online_softmax_pass(pytester):
    body = EAGER.format(SCALE="/ math.sqrt(q.shape[-1])", OFF_BY_ONE=False) + ONLINE.split(HEADER)[1].format(
        ACC="acc * alpha")
    pytester.makeconftest(body)
    pytester.makeini("[pytest]\n")
    result = _accept_then_run(pytester, "--precision-configs=fp32,fp16,bf16")
    # neither calls SDPA: each runs once per config and regime, not once per SDPA backend
    result.assert_outcomes(passed=2 * 3 * 11)
    assert "+math" not in result.stdout.str() and "+flash" not in result.stdout.str()


def test_missing_scale_is_caught(pytester):
    pytester.makeconftest(EAGER.format(SCALE="", OFF_BY_ONE=False))
    result = _run(pytester, "--precision-configs=fp32", "-k", "unit")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*attention[[]eager-fp32-unit[]]: FAIL accuracy*(oracle: out: max abs * > budget *"])


def test_fp16_scores_and_softmax_overflow_at_q_scale_40(pytester):
    pytester.makeconftest(FP16_NAIVE)
    result = _run(pytester, "--precision-configs=fp32", "-k", "sharp40")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*attention[[]fp16_scores-fp32-sharp40[]]: FAIL overflow*",
        "*first overflow in aten::exp at conftest.py:* under fp32: produced inf from finite inputs; the float64 run "
        "computed it in float16 too (the callable casts its inputs itself*",
    ])


def test_online_softmax_without_rescale_is_caught(pytester):
    pytester.makeconftest(ONLINE.format(ACC="acc"))
    result = _run(pytester, "--precision-configs=fp32", "-k", "unit")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*attention[[]online-fp32-unit[]]: FAIL accuracy*(oracle: out: max abs * > budget *"])


def test_causal_mask_off_by_one_is_caught(pytester):
    pytester.makeconftest(EAGER.format(SCALE="/ math.sqrt(q.shape[-1])", OFF_BY_ONE=True))
    result = _run(pytester, "--precision-configs=fp32", "-k", "causal")
    result.assert_outcomes(failed=3)  # causal (16 long), causal-cross and causal136 (past the common block sizes)
    result.stdout.fnmatch_lines(["*attention[[]eager-fp32-causal[]]: FAIL accuracy*(oracle: out: max abs * > budget *"])
    result.stdout.fnmatch_lines(["*attention[[]eager-fp32-causal136[]]: FAIL accuracy*(oracle: out: max abs * > budget *"])
    # the non-causal regimes are unaffected by the defect
    _accept_then_run(pytester, "--precision-configs=fp32", "-k", "unit").assert_outcomes(passed=1)


def test_target_without_padding_keyword_skips_padded_regime(pytester):
    pytester.makeconftest(HEADER + """
@pytest_precision.register("nopad", kind="attention")
def nopad(q, k, v, causal=False):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
""")
    result = _run(pytester, "--precision-configs=fp32", "-k", "padded and math", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*nopad: the padded regime needs a key_padding_mask keyword*"])


def test_a_missing_rescale_in_16_wide_blocks_is_caught_past_one_block(pytester):
    """Blocks as wide as the old regimes' 16 keys: one block, so the rescale is never needed there
    and the defect is bit-identical to the correct kernel; 128 keys take eight blocks."""
    pytester.makeconftest(ONLINE.replace("block=8", "block=16").format(ACC="acc"))
    pytester.makeini("[pytest]\n")
    result = _accept_then_run(pytester, "--precision-configs=fp32", "-k", "unit or square128")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*attention[[]online-fp32-square128[]]: FAIL accuracy*(oracle: out: max abs * > budget *"])


HF_EAGER = HEADER + """
import os

@pytest_precision.register("hf_eager", kind="attention")
def hf_eager(q, k, v, causal=False, key_padding_mask=None):
    k, v = expand(k, q.shape[1]), expand(v, q.shape[1])
    s = masks(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), causal, key_padding_mask)
    if {FP16_SOFTMAX}:  # exp, sum and divide in the inputs' 16 bits
        e = torch.exp(s - s.amax(-1, keepdim=True))
        p = e / e.sum(-1, keepdim=True)
    else:  # the softmax in fp32, as Hugging Face's eager attention does
        p = torch.softmax(s, -1, dtype=torch.float32).to(q.dtype)
    return p @ v
"""


def test_a_softmax_kept_in_16_bits_is_caught_by_the_rms_error_not_the_max(pytester):
    """The defect's largest errors stay inside the 16-bit max-error budgets (set by their floor);
    its typical error is what grows, and the golden's RMS budget holds it."""
    pytester.makeini("[pytest]\n")
    pytester.makeconftest(HF_EAGER.format(FP16_SOFTMAX=False))
    args = ("--precision-configs=fp16", "-k", "unit or square128")
    _accept_then_run(pytester, *args).assert_outcomes(passed=2)
    pytester.makeconftest(HF_EAGER.format(FP16_SOFTMAX=True))
    result = _run(pytester, *args)
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*attention[[]hf_eager-fp16-square128[]]: FAIL regression (golden: dq: RMS abs * > budget *"])
    assert "max abs" not in "".join(line for line in result.outlines if "FAIL regression" in line)
