"""Real clients (pytester): third-party code vendored verbatim under tests/clients/ (nanoGPT's
attention and MLP and its GPT trained by train.py's loop, Hugging Face's eager and SDPA attention functions and LlamaRMSNorm, the Triton
tutorials' fused softmax), wired into the kinds' contracts as a user following the README would,
in a conftest beside a copy of the vendored module. Each test counts the cases judged (a session
that collected nothing is not green), checks that the code as written upstream passes, and that
a defect planted in a copy of it fails where it should, with its category, and nowhere else.

Most runs pass --precision-update-baselines: their verdicts are the oracle's, the peer's and the
counts', what a repository adopting the harness sees on its first run; the goldens are checked
where a defect only they can see is planted. CI runs the fast subset below; the tests marked
``clients_full`` (every config and regime of the slow clients) run with PRECISION_CLIENTS=all."""
import importlib.util
import os
from pathlib import Path

import pytest
import torch
from machine import ON_CPU

pytest_plugins = ["pytester"]

CLIENTS = Path(__file__).resolve().parent / "clients"
FULL = os.environ.get("PRECISION_CLIENTS") == "all"


def full(test):
    """Of the full set: marked ``clients_full``, and skipped unless PRECISION_CLIENTS=all."""
    skip = pytest.mark.skipif(not FULL, reason="the full real-client set takes minutes: PRECISION_CLIENTS=all runs it")
    return pytest.mark.clients_full(skip(test))


needs_transformers = pytest.mark.skipif(not importlib.util.find_spec("transformers"),
                                        reason="transformers is not installed (pip install -e '.[hf]')")
CPU_CONFIGS = ("fp32", "fp16", "bf16", "amp-fp16", "amp-bf16", "fp8-e4m3")  # tf32 is skipped on the CPU


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread in these sessions. Under ``pytest -n 2`` on a 2-core machine each worker's
    torch otherwise runs 2 OpenMP threads whose spin-waits, with anything else running, multiplied
    this module's wall time 3 to 5 times (a session of 198 attention cases: 64 s, against 14 s with
    one thread, measured here). Goldens are written and checked within one test, under one setting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _derandomised(monkeypatch):
    """The drawn regime's examples the same in every run, as under CI (the pytester sessions run in
    this process, where the suites' Hypothesis profile was registered on import): a planted defect
    the assertions expect the drawn regime to find is found every run, not most."""
    from pytest_precision.strategies import register_profile

    monkeypatch.setenv("CI", "true")
    register_profile()
    yield
    monkeypatch.undo()
    register_profile()


def _vendor(pytester, module: str, *plants: tuple[str, str]) -> None:
    """Put a vendored module in the user's repository (pytester's rootdir, importable as its code
    is), with each planted defect (old, new) replacing text found exactly once upstream."""
    text = (CLIENTS / f"{module}.py").read_text()
    for old, new in plants:
        assert text.count(old) == 1, f"{module}.py: {old!r} is not there exactly once (the vendored file changed?)"
        text = text.replace(old, new)
    (pytester.path / f"{module}.py").write_text(text)


def _run(pytester, *args, update: bool = True):
    """A session of the suites; with ``update`` as a repository's first run (goldens written for
    the cases that pass), without it judged against the goldens too."""
    return pytester.runpytest("--precision-suite", "--precision-no-speed", "-p", "no:cacheprovider", *ON_CPU, *args,
                              *(("--precision-update-baselines",) if update else ()))


def _failed(result) -> dict[str, list[str]]:
    """Failed case -> its failure categories, as the case's first line tells the user
    (``precision-suite::attention[t-fp16-sharp40]: FAIL overflow,nan (...)``; a target that raised:
    ``precision-suite::softmax[t-fp16-unit]: target 't' (softmax) under config fp16 ... raised ...``)."""
    failed = {}
    for line in result.outlines:
        if line.startswith("precision-suite::") and "]: FAIL " in line:
            case, rest = line[len("precision-suite::"):].split(": FAIL ", 1)
            failed[case] = rest.split(" ", 1)[0].split(",")
        elif line.startswith("precision-suite::") and "]: target '" in line and " raised " in line:
            failed[line[len("precision-suite::"):].split(": target '", 1)[0]] = ["crash"]
    return failed


def _skipped(result) -> dict[str, int]:
    """Skip reason -> cases, from the lines below the summary table."""
    counts = {}
    for line in result.outlines:
        if " case(s) skipped: " in line:
            n, reason = line.split(" case(s) skipped: ", 1)
            counts[reason] = counts.get(reason, 0) + int(n)
    return counts


def _judged(result) -> int:
    outcomes = result.parseoutcomes()
    judged = outcomes.get("passed", 0) + outcomes.get("failed", 0)
    assert judged > 0, "nothing was judged: a session that ran no case is not green"
    return judged


def _passes(pytester, module: str, conftest: str, passed: int, skipped: int, *args):
    """A client as written upstream, registered by ``conftest``: every case judged passes its first run."""
    _vendor(pytester, module)
    pytester.makeconftest(conftest)
    result = _run(pytester, *args)
    result.assert_outcomes(passed=passed, skipped=skipped)
    assert _judged(result) == passed
    return result


# ---- nanoGPT: CausalSelfAttention and MLP (tests/clients/nanogpt_model.py) -------------------

NANOGPT_ATTENTION = """
import pytest
import torch
import pytest_precision
from nanogpt_model import CausalSelfAttention, GPTConfig


class QKV(torch.nn.Module):
    # stands in for c_attn: the suite's q, k, v laid out as c_attn's output, (B, T, 3 C)
    def __init__(self, q, k, v):
        super().__init__()
        self.qkv = torch.cat([t.transpose(1, 2).flatten(2) for t in (q, k, v)], dim=2)

    def forward(self, x):
        return self.qkv


def attention(q, k, v, causal, flash):
    B, H, T, D = q.shape
    attn = CausalSelfAttention(GPTConfig(block_size=T, n_head=H, n_embd=H * D, dropout=0.0, bias=False)).eval()
    attn.flash = flash
    if not flash:  # the manual path masks with its buffer `bias`: nanoGPT's tril, or all ones for no mask
        mask = torch.ones(T, T)
        attn.register_buffer("bias", (mask.tril() if causal else mask).view(1, 1, T, T))
    elif not causal:
        pytest.skip("nanoGPT's flash path is causal only (is_causal=True)")
    attn.c_attn, attn.c_proj = QKV(q, k, v), torch.nn.Identity()
    y = attn(torch.zeros(B, T, H * D, dtype=q.dtype))
    return y.view(B, T, H, D).transpose(1, 2)


# self-attention of one sequence, one key/value head per query head
@pytest_precision.register("nanogpt.manual", kind="attention", grouped_query=False, cross_lengths=False, sdpa=False)
def nanogpt_manual(q, k, v, causal):
    return attention(q, k, v, causal, flash=False)


# {FLASH_NOTE}
@pytest_precision.register("nanogpt.flash", kind="attention", grouped_query=False, cross_lengths=False{FLASH_SDPA})
def nanogpt_flash(q, k, v, causal):
    return attention(q, k, v, causal, flash=True)
"""
# nanoGPT's flash path skips non-causal cases inside the callable; undeclared, the SDPA probe at
# collection asks it again with the causal mask: see
# test_a_client_that_skips_inside_its_callable_leaves_every_other_target_judged
DECLARED_SDPA = dict(FLASH_NOTE="calls SDPA: declared, so that no first call probes it", FLASH_SDPA=", sdpa=True")

# nanoGPT's manual attention with its softmax computed in the input dtype, without the max subtracted
SOFTMAX_WITHOUT_MAX = ("att = F.softmax(att, dim=-1)", "att = torch.exp(att) / torch.exp(att).sum(dim=-1, keepdim=True)")


def test_nanogpt_attention_as_written_passes(pytester):
    _vendor(pytester, "nanogpt_model")
    pytester.makeconftest(NANOGPT_ATTENTION.format(**DECLARED_SDPA))
    result = _run(pytester)
    # manual path: 9 regimes (unit, sharp10, sharp40, causal, hd40, batch2, square128, square136, causal136;
    # the others have S_q != S_k or grouped-query heads) and fresh x 6 CPU configs; the flash path, causal
    # only: causal, causal136 and fresh (seed 1: causal) x 6 configs x 2 SDPA backends (math, flash)
    result.assert_outcomes(passed=10 * 6 + 3 * 6 * 2, skipped=282)
    assert _judged(result) == 96
    # unit, sharp10, sharp40, hd40, batch2, square128 and square136 skip inside the flash path's callable
    assert _skipped(result)["nanoGPT's flash path is causal only (is_causal=True)"] == 7 * 6 * 2


def test_nanogpt_attention_softmax_without_max_fails_where_scores_overflow(pytester):
    _vendor(pytester, "nanogpt_model", SOFTMAX_WITHOUT_MAX)
    pytester.makeconftest(NANOGPT_ATTENTION.format(**DECLARED_SDPA))
    result = _run(pytester, "-k", "nanogpt.manual")
    # exp overflows where scores pass the dtype's exp range: sharp40 (scores to ~120) in every
    # config; sharp10 (to ~30) where exp runs in fp16 (fp16, and amp-fp16's fp16 matmul)
    overflowing = {f"attention[nanogpt.manual-{c}-sharp40]" for c in CPU_CONFIGS} | \
        {f"attention[nanogpt.manual-{c}-sharp10]" for c in ("fp16", "amp-fp16")}
    failed = _failed(result)
    assert _judged(result) == 60
    assert overflowing <= set(failed), sorted(failed)
    assert all({"overflow", "nan"} <= set(cats) for case, cats in failed.items() if case in overflowing), failed
    # elsewhere exp, sum and divide kept in the input dtype (no overflow) pass the typical-error
    # limit of the float32-softmax peer on some cases (measured: 6, accuracy only); never in fp32
    assert all(cats == ["accuracy"] for case, cats in failed.items() if case not in overflowing), failed
    assert not [case for case in set(failed) - overflowing if "-fp32-" in case or "-fp8-e4m3-" in case], failed
    result.stdout.fnmatch_lines([
        "precision-suite::attention[[]nanogpt.manual-fp16-sharp40[]]: FAIL overflow,nan (oracle: out: NaN * > 0 allowed*",
        "  first overflow in aten::exp at nanogpt_model.py:* under fp16: produced inf from finite inputs where the "
        "reference is *",
    ])


NANOGPT_MLP = """
import torch
import pytest_precision
from nanogpt_model import MLP, GPTConfig

C = 64


def mlp(x, c_fc_weight, c_fc_bias, c_proj_weight, c_proj_bias):
    module = MLP(GPTConfig(n_embd=x.shape[-1], dropout=0.0, bias=True)).eval()
    params = {"c_fc.weight": c_fc_weight, "c_fc.bias": c_fc_bias,
              "c_proj.weight": c_proj_weight, "c_proj.bias": c_proj_bias}
    return torch.func.functional_call(module, params, (x,))


def inputs(outlier):
    def make(g):
        x = torch.randn(4, 16, C, generator=g)
        x[..., :2] *= outlier  # a few channels of large activations, as trained LLMs' residual streams have
        return {"x": x, "c_fc_weight": torch.randn(4 * C, C, generator=g) / C ** 0.5,
                "c_fc_bias": 0.02 * torch.randn(4 * C, generator=g),
                "c_proj_weight": torch.randn(C, 4 * C, generator=g) / (4 * C) ** 0.5,
                "c_proj_bias": 0.02 * torch.randn(C, generator=g)}
    return make


pytest_precision.register("nanogpt.mlp", mlp, kind="op", inputs={"unit": inputs(1.0), "outliers": inputs(1000.0)})
"""

# nanoGPT's own GELU until it used nn.GELU (model.py's new_gelu, formula as it was before commit 594068e7,
# "Use nn.GELU"): x ** 3 overflows fp16 past |x| 40,
# harmlessly in the forward (tanh saturates), and its gradient 3 x ** 2 past |x| 148: 0 * inf = NaN
NEW_GELU = [("self.gelu    = nn.GELU()", "self.gelu    = new_gelu"),
            ("class MLP(nn.Module):", "def new_gelu(x):\n    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * "
             "(x + 0.044715 * torch.pow(x, 3.0))))\n\nclass MLP(nn.Module):")]


def test_nanogpt_mlp_passes_and_an_fp16_gelu_overflow_fails(pytester):
    _passes(pytester, "nanogpt_model", NANOGPT_MLP, passed=3 * 6, skipped=3)  # 2 regimes and fresh x 6 CPU configs

    _vendor(pytester, "nanogpt_model", *NEW_GELU)
    result = _run(pytester)
    result.assert_outcomes(failed=2, passed=16, skipped=3)  # fresh (seed 1) draws no outlier
    failed = _failed(result)
    assert set(failed) == {"op[nanogpt.mlp-fp16-outliers]", "op[nanogpt.mlp-amp-fp16-outliers]"}, failed
    assert all(set(cats) == {"overflow", "nan"} for cats in failed.values()), failed  # the output itself is right
    result.stdout.fnmatch_lines([
        "precision-suite::op[[]nanogpt.mlp-fp16-outliers[]]: FAIL overflow,nan (oracle: dx: NaN * > 0 allowed; "
        "oracle: dc_fc_weight: NaN * > 0 allowed; oracle: dc_fc_bias: NaN * > 0 allowed)",
        "  first overflow in aten::pow at nanogpt_model.py:* under fp16: produced inf from finite inputs*",
    ])


# ---- nanoGPT's GPT trained as train.py trains it (tests/clients/nanogpt_model.py) -------------

NANOGPT_TRAINING = """
import torch
import pytest_precision
from pytest_precision.training import MarkovText, split_batch
from nanogpt_model import GPT, GPTConfig


def model_fn():
    return GPT(GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True))


def optimizer_fn(model):
    return model.configure_optimizers(weight_decay=0.1, learning_rate=6e-4, betas=(0.9, 0.95), device_type="cpu")


def loss_fn(model, batch):
    logits, loss = model(*batch)
    return loss


def step_fn(model, optimizer, scaler, batch, autocast, accumulate):
    # train.py's step: the loss of each micro-batch divided by their number, scaled backward, then
    # unscale_, clip to 1, step and update once, zero_grad(set_to_none=True)
    for X, Y in split_batch(batch, accumulate):
        with autocast():
            logits, loss = model(X, Y)
            loss = loss / accumulate
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss


pytest_precision.register("nanogpt.train", pytest_precision.TrainSpec(
    model_fn, optimizer_fn, MarkovText(vocab_size=64, batch_size=4, block_size=32), steps=2, step_fn=step_fn,
    loss_fn=loss_fn, accumulate=2, checkpoint="transformer.h"), kind="train_step")
"""
NANOGPT_TRAINING_ARGS = ("--precision-configs=fp32,amp-bf16,fp8-e4m3", "-k", "trajectory and not fp8-tensorwise")


def test_nanogpt_trained_as_train_py_passes_and_a_loss_not_divided_fails_first_run(pytester):
    """nanoGPT's GPT with train.py's loop (2 micro-batches, GradScaler, clipping), checkpointed per
    block: every config's accumulated gradient and checkpointed step hold on a first run (the
    fp8-delayed recompute once read a history its own micro-batch had grown: 32 dB from the step
    without checkpointing); the loss left undivided fails in every config."""
    result = _passes(pytester, "nanogpt_model", NANOGPT_TRAINING, 4, 0, *NANOGPT_TRAINING_ARGS)
    for config in ("fp32", "amp-bf16", "fp8-e4m3", "fp8-delayed"):
        result.stdout.fnmatch_lines([f"| nanogpt.train *| {config} *| *2 |*| pass *|"])

    pytester.makeconftest(NANOGPT_TRAINING.replace("            loss = loss / accumulate\n", ""))
    result = _run(pytester, *NANOGPT_TRAINING_ARGS)
    result.assert_outcomes(failed=4)
    assert all("accuracy" in cats for cats in _failed(result).values()), _failed(result)
    result.stdout.fnmatch_lines([
        "precision-suite::train_step[[]nanogpt.train-amp-bf16-trajectory[]]: FAIL accuracy (accumulated gradient of 2 "
        "micro-batches at step 0: SQNR * dB against the float64 gradient of the whole batch's mean loss < * dB, 2 x "
        "along it: the loss of each micro-batch was not divided by the 2 micro-batches (loss / 2))"])


# ---- Hugging Face: eager_attention_forward, sdpa_attention_forward, LlamaRMSNorm --------------
# (tests/clients/hf_llama.py, tests/clients/hf_sdpa_attention.py)

# the boolean mask Hugging Face builds for a causal and padded batch, True where a key is attended
HF_ALLOWED = """def allowed(q, k, causal, key_padding_mask):
    # HF's masks: query i sits at position S_k - S_q + i (causal aligned bottom-right), padding per batch row
    sq, sk = q.shape[-2], k.shape[-2]
    mask = torch.ones(sq, sk, dtype=torch.bool)
    mask = (mask.tril(diagonal=sk - sq) if causal else mask)[None, None]
    return mask if key_padding_mask is None else mask & ~key_padding_mask[:, None, None, :]
"""

HF_ATTENTION = """
import torch
import pytest_precision
from hf_llama import eager_attention_forward
from hf_sdpa_attention import sdpa_attention_forward


class Attention(torch.nn.Module):
    # what HF's attention functions read from the attention module (LlamaAttention's attributes)
    def __init__(self, q, k, causal):
        super().__init__()
        self.num_key_value_groups = q.shape[1] // k.shape[1]
        self.is_causal = causal
        self.scaling = q.shape[-1] ** -0.5
        self.eval()


""" + HF_ALLOWED + """

# a fully masked query row (causal with left padding) attends every key alike through the finite
# additive minimum: the mean of v, declared
@pytest_precision.register("hf.eager", kind="attention", causal="bottom-right", fully_masked="mean")
def hf_eager(q, k, v, causal, key_padding_mask=None):
    module = Attention(q, k, causal)
    mask = None
    if causal or key_padding_mask is not None:  # eager takes an additive mask: the dtype's min where masked
        keep = allowed(q, k, causal, key_padding_mask)
        mask = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, torch.finfo(q.dtype).min)
    out, _ = eager_attention_forward(module, q, k, v, mask, scaling=module.scaling, dropout=0.0)
    return out.transpose(1, 2)  # HF returns (B, S, H, D)


@pytest_precision.register("hf.sdpa", kind="attention", causal="bottom-right")
def hf_sdpa(q, k, v, causal, key_padding_mask=None):
    module = Attention(q, k, causal)
    mask = None  # a causal square batch without padding goes as is_causal, as HF's mask builder skips it
    if key_padding_mask is not None or (causal and q.shape[-2] != k.shape[-2]):
        mask = allowed(q, k, causal, key_padding_mask)  # boolean, True where attended
    out, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=module.scaling)
    return out.transpose(1, 2)
"""

# the README's own example of a loss only the goldens see: exp, sum and divide in the input dtype
SOFTMAX_IN_INPUT_DTYPE = ("attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)",
                          "attn_weights = (attn_weights - attn_weights.amax(dim=-1, keepdim=True)).exp()\n"
                          "    attn_weights = attn_weights / attn_weights.sum(dim=-1, keepdim=True)")
# a mask builder that skips the causal mask whenever there is no padding, also for a chunk of 8
# queries over 24 keys: SDPA's is_causal aligns top-left there, where HF's positions are bottom-right
CHUNK_WITHOUT_MASK = ("if key_padding_mask is not None or (causal and q.shape[-2] != k.shape[-2]):",
                      "if key_padding_mask is not None:")


def _hf_attention(pytester, conftest_plant=None, *plants):
    _vendor(pytester, "hf_llama", *plants)
    _vendor(pytester, "hf_sdpa_attention")
    conftest = HF_ATTENTION
    if conftest_plant:
        assert conftest.count(conftest_plant[0]) == 1
        conftest = conftest.replace(*conftest_plant)
    pytester.makeconftest(conftest)


@needs_transformers
def test_hf_attention_functions_as_written_pass_first_run_and_goldens(pytester):
    _hf_attention(pytester)
    counts = dict(passed=18 * 6 + 18 * 6 * 2, skipped=18 + 18 * 2)  # 17 regimes and fresh; sdpa: math and flash backends
    first = _run(pytester)
    first.assert_outcomes(**counts)
    assert _judged(first) == 324
    result = _run(pytester, update=False)
    result.assert_outcomes(**counts)


@needs_transformers
def test_hf_eager_softmax_kept_in_the_input_dtype_fails_first_run_and_its_goldens(pytester):
    # a repository adopting the harness with the defect in: no golden, the oracle against the peer,
    # whose softmax is float32 (as HF's own eager code computes it)
    _hf_attention(pytester, None, SOFTMAX_IN_INPUT_DTYPE)
    first = _run(pytester, "-k", "hf.eager")
    assert _judged(first) == 108
    failed = _failed(first)
    # every max-abs budget holds; the typical error (RMS) passes 1.25 x the peer's (gradients 2 x)
    # in 16-bit configs (measured: 12 of the 26 fp16 and bf16 cases, margins 1.006 to 1.33); under
    # amp-* the scores are fp16 or bf16 too, but nothing first-run sees it there; fp32 and fp8 (which
    # computes in fp32) are unchanged
    assert all(cats == ["accuracy"] for cats in failed.values()), failed
    assert {case.split("-")[1] for case in failed} <= {"fp16", "bf16"}, sorted(failed)
    assert len(failed) >= 8, sorted(failed)
    first.stdout.fnmatch_lines(["precision-suite::attention[[]hf.eager-fp16-long[]]: FAIL accuracy (oracle: "
                                "* RMS abs * > budget *"])

    # goldens recorded from the code as written see it under autocast too
    _hf_attention(pytester)
    _run(pytester, "-k", "hf.eager").assert_outcomes(passed=108, skipped=18)
    _hf_attention(pytester, None, SOFTMAX_IN_INPUT_DTYPE)
    result = _run(pytester, "-k", "hf.eager", update=False)
    failed = _failed(result)
    assert all(set(cats) <= {"accuracy", "regression"} for cats in failed.values()), failed
    assert [case for case, cats in failed.items() if "-amp-" in case and "regression" in cats], sorted(failed)
    assert not [k for k in failed if "-fp32-" in k or "-fp8-e4m3-" in k], failed
    result.stdout.fnmatch_lines(["precision-suite::attention[[]hf.eager-fp16-long[]]: FAIL *regression (*"])


@needs_transformers
def test_hf_sdpa_chunk_without_its_mask_fails_causal_cross_with_the_alignment_hint(pytester):
    _hf_attention(pytester, CHUNK_WITHOUT_MASK)
    result = _run(pytester, "-k", "hf.sdpa and causal")
    # causal, causal-cross, causal-leftpad and causal136 x 6 configs x 2 backends; only the 8 x 24 chunk is wrong
    result.assert_outcomes(failed=12, passed=36, skipped=8)
    failed = _failed(result)
    assert set(failed) == {f"attention[hf.sdpa-{c}+{b}-causal-cross]" for c in CPU_CONFIGS for b in ("math", "flash")}
    assert all("accuracy" in cats for cats in failed.values()), failed
    result.stdout.fnmatch_lines([
        "precision-suite::attention[[]hf.sdpa-fp32+math-causal-cross[]]: FAIL *accuracy (oracle: out: max abs * > budget*",
        "  the output matches a top-left causal mask (max abs * within the budget *): if that is the target's "
        "alignment, declare it at registration (causal=\"top-left\")",
    ])


@needs_transformers
def test_a_chunk_without_its_mask_is_not_called_an_overflow(pytester):
    _hf_attention(pytester, CHUNK_WITHOUT_MASK)
    result = _run(pytester, "-k", "hf.sdpa and causal-cross", "--precision-configs=fp32")
    result.assert_outcomes(failed=2)
    failed = _failed(result)
    # no element of the output or the gradients is infinite (the table's overflow column is 0):
    # wrong keys attended (accuracy), gradients of keys wrongly masked exactly 0 (underflow)
    assert failed["attention[hf.sdpa-fp32+flash-causal-cross]"] == ["underflow", "accuracy"]
    assert failed["attention[hf.sdpa-fp32+math-causal-cross]"] == ["underflow", "accuracy"]


HF_RMS_NORM = """
import torch
import pytest_precision
from hf_llama import LlamaRMSNorm


@pytest_precision.register("hf.rms_norm", kind="rms_norm")
def llama_rms_norm(x, weight, bias, eps):  # the kind calls it with bias=None
    norm = LlamaRMSNorm(x.shape[-1], eps=eps)
    return torch.func.functional_call(norm, {"weight": weight}, (x,))
"""
# the variance computed in the input dtype: fp16 squares overflow past 256
VARIANCE_IN_INPUT_DTYPE = ("        hidden_states = hidden_states.to(torch.float32)\n", "")


@needs_transformers
def test_llama_rms_norm_passes_and_a_variance_in_fp16_fails(pytester):
    # 7 norm regimes (hypothesis included) and fresh x 6 CPU configs
    _passes(pytester, "hf_llama", HF_RMS_NORM, passed=8 * 6, skipped=8)

    _vendor(pytester, "hf_llama", VARIANCE_IN_INPUT_DTYPE)
    result = _run(pytester, "-k", "not hypothesis")
    # fp16: squares overflow (offset, scale300) or statistics lose digits; bf16 (fp32's range): the
    # mean square's lost digits, where y's typical error passes twice the float32-statistics peer's;
    # under amp-* the inputs are fp32
    failed = _failed(result)
    assert _judged(result) == 42 and len(failed) == result.parseoutcomes()["failed"]
    sure = ({f"rms_norm[hf.rms_norm-fp16-{r}]" for r in ("unit", "offset", "near-eps", "long", "scale300")}
            | {f"rms_norm[hf.rms_norm-bf16-{r}]" for r in ("near-eps", "long")})  # 1.4 x the budget or more
    maybe = {"rms_norm[hf.rms_norm-bf16-scale300]"}  # here 1.10 x
    maybe |= {f"rms_norm[hf.rms_norm-{c}-len1000]" for c in ("fp16", "bf16")}  # as unit and long
    maybe |= {f"rms_norm[hf.rms_norm-{c}-fresh]" for c in ("fp16", "bf16")}  # as its draw falls (seed 1: fp16 fails)
    assert sure <= set(failed) <= sure | maybe, failed
    assert {"overflow"} <= set(failed["rms_norm[hf.rms_norm-fp16-scale300]"])
    result.stdout.fnmatch_lines(["precision-suite::rms_norm[[]hf.rms_norm-fp16-scale300[]]: FAIL *overflow*",
                                 "  first overflow in aten::pow at hf_llama.py:* under fp16: *"])


# ---- Hugging Face: the causal-LM loss, NewGELU, LlamaMLP's SwiGLU (tests/clients/hf_losses.py,
# hf_activations.py, hf_llama_mlp.py): what a repository adopting the harness sees on its first run

HF_LOSS = """
import pytest_precision
from hf_losses import ForCausalLMLoss


@pytest_precision.register("hf.causal_lm_loss", kind="cross_entropy")
def causal_lm_loss(logits, target, ignore_index=-100):
    # the suite's rows as one sequence whose labels are already shifted (HF's shift_labels=)
    return ForCausalLMLoss(logits[None], None, logits.shape[-1], ignore_index=ignore_index, shift_labels=target[None])
"""
# the loss computed on the 16-bit logits: the upcast HF writes before cross_entropy removed
LOSS_ON_16_BIT_LOGITS = ("    logits = logits.float()\n", "")


@needs_transformers
def test_hf_causal_lm_loss_passes_and_a_loss_on_16_bit_logits_fails_first_run(pytester):
    # 7 regimes (smoothing skipped: no label_smoothing keyword), the drawn and the fresh one x 6 CPU configs;
    # and tf32 (a CUDA mode) in every regime
    _passes(pytester, "hf_losses", HF_LOSS, passed=9 * 6, skipped=6 + 10)

    _vendor(pytester, "hf_losses", LOSS_ON_16_BIT_LOGITS)
    result = _run(pytester)
    failed = _failed(result)
    assert failed, "the loss on 16-bit logits passed its first run"
    assert {k.split("-")[1] for k in failed} <= {"fp16", "bf16"}, failed
    assert "cross_entropy[hf.causal_lm_loss-bf16-scale40]" in failed, failed
    result.stdout.fnmatch_lines(["precision-suite::cross_entropy[[]hf.causal_lm_loss-bf16-scale40[]]: FAIL *accuracy*"])


HF_GELU = """
import torch
import torch.nn.functional as F
import pytest_precision
from hf_activations import NewGELUActivation

inputs = {"unit": lambda g: torch.randn(64, 256, generator=g), "wide": lambda g: 8 * torch.randn(64, 256, generator=g)}
pytest_precision.register("hf.new_gelu", NewGELUActivation(), kind="op", inputs=inputs)
pytest_precision.register("torch.gelu_tanh", lambda x: F.gelu(x, approximate="tanh"), kind="op", inputs=inputs)
"""


@needs_transformers
def test_hf_new_gelu_and_torch_gelu_tanh_pass_on_wide_inputs(pytester):
    """For x below about -5, 1 + tanh(u) is 0 in float32 where float64 gives about 5e-7: terms of
    magnitude 1 cancelled, well within the output's budget; no value underflowed."""
    # 2 targets x 2 regimes x 6 CPU configs (tf32 skipped)
    _passes(pytester, "hf_activations", HF_GELU, passed=2 * 3 * 6, skipped=2 * 3)


HF_LLAMA_MLP = """
from types import SimpleNamespace

import torch
import pytest_precision
from hf_llama_mlp import LlamaMLP

C, F = 64, 172  # hidden and intermediate sizes; Llama's ratio, 8/3 rounded up


def mlp(x, gate_proj, up_proj, down_proj):
    config = SimpleNamespace(hidden_size=x.shape[-1], intermediate_size=gate_proj.shape[0], mlp_bias=False,
                             hidden_act="silu")
    params = {"gate_proj.weight": gate_proj, "up_proj.weight": up_proj, "down_proj.weight": down_proj}
    return torch.func.functional_call(LlamaMLP(config), params, (x,))


def inputs(outlier):
    def make(g):
        x = torch.randn(4, 8, C, generator=g)
        x[..., :2] *= outlier  # a few channels of large activations: gates deep in SiLU's saturation
        return {"x": x, "gate_proj": torch.randn(F, C, generator=g) / C ** 0.5,
                "up_proj": torch.randn(F, C, generator=g) / C ** 0.5, "down_proj": torch.randn(C, F, generator=g) / F ** 0.5}
    return make


pytest_precision.register("hf.llama_mlp", mlp, kind="op", inputs={"unit": inputs(1.0), "outliers": inputs(30.0)})
"""


@needs_transformers
def test_hf_llama_mlp_passes_first_run(pytester):
    _passes(pytester, "hf_llama_mlp", HF_LLAMA_MLP, passed=3 * 6, skipped=3)  # 2 regimes and fresh x 6 CPU configs (tf32 skipped)


HF_GPT2_ATTENTION = """
import torch
import pytest_precision
from hf_gpt2 import eager_attention_forward


class Attention(torch.nn.Module):
    # what GPT-2's attention function reads from its module
    def __init__(self):
        super().__init__()
        self.eval()


""" + HF_ALLOWED + """

# one key/value head per query head, as GPT-2 and BERT have; a fully masked query row (a padded
# position with only padding before it) attends every key alike through the finite minimum
@pytest_precision.register("hf.gpt2_eager", kind="attention", causal="bottom-right", grouped_query=False,
                           fully_masked="mean")
def gpt2_eager(q, k, v, causal, key_padding_mask=None):
    mask = None
    if causal or key_padding_mask is not None:  # the additive mask: the dtype's minimum where masked
        keep = allowed(q, k, causal, key_padding_mask)
        mask = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, torch.finfo(q.dtype).min)
    out, _ = eager_attention_forward(Attention(), q, k, v, mask, dropout=0.0)
    return out.transpose(1, 2)
"""
# the mask built at float32's minimum and cast to the attention's dtype, as mask builders that
# assume float32 do: -inf in fp16 and bf16, so a fully masked row is exp(-inf - -inf) = NaN
FLOAT32_MIN_CAST = ("mask = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, torch.finfo(q.dtype).min)",
                    "mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min).to(q.dtype)")


@needs_transformers
def test_gpt2_eager_attention_passes_and_a_float32_minimum_mask_fails_first_run(pytester):
    # unit, causal, causal-cross, padded-mha, causal-leftpad, causal136 (padded has grouped-query
    # heads: skipped) x 6 CPU configs; tf32 of the 7 selected; padded in 6 configs
    _passes(pytester, "hf_gpt2", HF_GPT2_ATTENTION, 6 * 6, 7 + 6, "-k", "padded or causal or unit")

    pytester.makeconftest(HF_GPT2_ATTENTION.replace(*FLOAT32_MIN_CAST))
    result = _run(pytester, "-k", "padded or causal or unit")
    failed = _failed(result)
    # only where a query row is fully masked (causal with left padding), only where float32's
    # minimum is not a number of the dtype
    assert set(failed) == {f"attention[hf.gpt2_eager-{c}-causal-leftpad]" for c in ("fp16", "bf16")}, sorted(failed)
    result.stdout.fnmatch_lines(["precision-suite::attention[[]hf.gpt2_eager-fp16-causal-leftpad[]]: FAIL *nan*"])


# ---- a session with clients that skip inside their callables -------------------------------

FLASH_LIKE = """

@pytest_precision.register("flash_like", kind="attention", causal="bottom-right", fully_masked="mean")
def flash_like(q, k, v, causal, key_padding_mask=None):
    # HF's attention behind a kernel that, as flash-attn does, refuses anything but fp16 and bf16
    if q.dtype not in (torch.float16, torch.bfloat16):
        pytest.skip(f"flash-attn takes fp16 and bf16 only, not {q.dtype}")
    return hf_eager(q, k, v, causal, key_padding_mask)
"""


def _verdicts(result) -> dict[str, str]:
    """Case -> PASSED / FAILED / SKIPPED / XFAIL, from a verbose session's lines."""
    verdicts = {}
    for line in result.outlines:
        if line.startswith("precision-suite::") and " " in line:
            case, verdict = line[len("precision-suite::"):].split(" ", 2)[:2]
            if verdict in ("PASSED", "FAILED", "SKIPPED", "XFAIL", "ERROR"):
                verdicts[case] = verdict
    return verdicts


@needs_transformers
def test_a_client_that_skips_inside_its_callable_leaves_every_other_target_judged(pytester):
    """Two clients skip from inside the callable, as the README allows: a flash-attn-like kernel
    that refuses fp32, and nanoGPT's flash path, which is causal only. Registered as a user would,
    without ``sdpa=``, their first call (the SDPA probe, at collection) skipped the whole session
    on c5d0ea4 ("no tests collected", exit 5); the probe now asks again in another dtype and mask."""
    _vendor(pytester, "hf_llama")
    _vendor(pytester, "hf_sdpa_attention")
    _vendor(pytester, "nanogpt_model")
    pytester.makeconftest("import pytest\n" + HF_ATTENTION + FLASH_LIKE + NANOGPT_ATTENTION.split("import pytest_precision", 1)[1]
                          .replace("from nanogpt_model", "import pytest_precision\nfrom nanogpt_model", 1)
                          .format(FLASH_NOTE="calls SDPA, undeclared", FLASH_SDPA=""))
    configs = ("fp32", "fp16", "bf16")
    result = _run(pytester, "-v", f"--precision-configs={','.join(configs)}")
    assert result.ret == 0, result.stdout.str()[-3000:]
    verdicts = _verdicts(result)
    by_target = {}
    for case, verdict in verdicts.items():
        by_target.setdefault(case.split("[", 1)[1].split("-", 1)[0], []).append(verdict)
    # the targets that do not skip: every case judged, exactly as in a session without the others
    assert by_target["hf.eager"].count("PASSED") == 18 * 3
    assert by_target["hf.sdpa"].count("PASSED") == 18 * 3 * 2
    assert by_target["nanogpt.manual"].count("PASSED") == 10 * 3  # 9 regimes and fresh (seed 1: causal, S_q == S_k)
    # the skipping ones: judged where they run; the probe, asked again in fp16 (flash_like) or with the
    # causal mask (nanogpt.flash), saw the eager softmax in one and SDPA (two backends) in the other
    for target, judged in (("flash_like", 18 * 2), ("nanogpt.flash", 3 * 3 * 2)):
        assert by_target[target].count("PASSED") == judged and "FAILED" not in by_target[target], \
            (target, by_target[target])
    assert not [c for c, v in verdicts.items() if c.startswith("attention[flash_like-") and v == "PASSED"
                and "-fp32" in c]
    skipped = _skipped(result)
    assert skipped.get("flash-attn takes fp16 and bf16 only, not torch.float32", 0) >= 11
    assert skipped.get("nanoGPT's flash path is causal only (is_causal=True)", 0) >= 7 * 3


# ---- the Triton tutorials' fused softmax (tests/clients/triton_fused_softmax.py) ----------------

needs_interpreter = pytest.mark.skipif(
    not importlib.util.find_spec("triton") or torch.cuda.is_available(),
    reason="the Triton client runs under Triton's interpreter on a CPU machine")

TRITON_SOFTMAX = """
import torch
import pytest_precision
from triton_fused_softmax import softmax


@pytest_precision.register("tutorial_softmax", kind="softmax", forward_only=True)  # the tutorial has no backward
@pytest_precision.needs_triton
def tutorial_softmax(x):
    return softmax(x.reshape(-1, x.shape[-1])).view_as(x)  # the tutorial's wrapper takes 2-D input
"""
# the tutorial's kernel without its max subtraction ("for numerical stability")
KERNEL_WITHOUT_MAX = ("row_minus_max = row - tl.max(row, axis=0)", "row_minus_max = row")
# the row's padding lanes loaded as 0 rather than -inf: they add exp(0 - max) to the denominator
PADDING_LOADED_AS_ZERO = ("row = tl.load(input_ptrs, mask=mask, other=-float('inf'))",
                          "row = tl.load(input_ptrs, mask=mask, other=0.0)")
SOFTMAX_REGIMES = ("unit", "scale20", "scale200", "near-ties", "sharp-peak", "len1", "len1000", "len32768", "masked",
                   "fully-masked", "large-negative")


def _triton(pytester, monkeypatch, *plants):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the tutorial's triton.jit and host code read it at import
    _vendor(pytester, "triton_fused_softmax", *plants)
    pytester.makeconftest(TRITON_SOFTMAX)


@needs_interpreter
def test_tutorial_softmax_as_written_passes(pytester, monkeypatch):
    _triton(pytester, monkeypatch)
    result = _run(pytester, "--precision-configs=fp32,fp16", "-k", "not hypothesis")
    result.assert_outcomes(passed=12 * 2)
    assert _judged(result) == 24


@needs_interpreter
def test_tutorial_softmax_without_max_subtraction_fails_where_exp_overflows(pytester, monkeypatch):
    _triton(pytester, monkeypatch, KERNEL_WITHOUT_MAX)
    result = _run(pytester, "--precision-configs=fp32", "-k", "not hypothesis and not len32768")
    failed = _failed(result)
    # exp(x) overflows fp32 past 88 (scale200) and is 0 for every logit at -1000: 0 / 0; the tests'
    # fresh seed (tests/conftest.py) draws logits at that scale too
    assert set(failed) == {"softmax[tutorial_softmax-fp32-scale200]", "softmax[tutorial_softmax-fp32-large-negative]",
                           "softmax[tutorial_softmax-fp32-fresh]"}, failed
    result.assert_outcomes(failed=3, passed=8)
    assert all("nan" in cats for cats in failed.values()), failed
    result.stdout.fnmatch_lines([
        "precision-suite::softmax[[]tutorial_softmax-fp32-scale200[]]: FAIL *nan*",
        "  first * inside Triton kernel softmax_kernel (interpreted; launched at triton_fused_softmax.py:*) under fp32: *",
    ])


@needs_interpreter
def test_tutorial_softmax_as_written_passes_bf16(pytester, monkeypatch):
    """The interpreter's fp32 -> bf16 store truncates where a GPU rounds to nearest (scale20 and
    scale200 failed for it); emulated as on a GPU, the tutorial as written passes every regime."""
    _triton(pytester, monkeypatch)
    result = _run(pytester, "--precision-configs=bf16", "-k", "not hypothesis")
    result.assert_outcomes(passed=12)


# ---- the full set: PRECISION_CLIENTS=all ----------------------------------------------------

@full
def test_nanogpt_attention_softmax_kept_in_the_input_dtype_fails_its_goldens(pytester):
    """With the max subtracted, exp, sum and divide in fp16 or bf16 overflow nothing: only the
    goldens' typical-error (RMS) budgets see it."""
    _vendor(pytester, "nanogpt_model")
    pytester.makeconftest(NANOGPT_ATTENTION.format(**DECLARED_SDPA))
    _run(pytester, "-k", "nanogpt.manual").assert_outcomes(passed=42, skipped=35)
    _run(pytester, "-k", "nanogpt.manual", update=False).assert_outcomes(passed=42, skipped=35)
    _vendor(pytester, "nanogpt_model", ("att = F.softmax(att, dim=-1)",
                                        "att = (att - att.amax(dim=-1, keepdim=True)).exp()\n"
                                        "            att = att / att.sum(dim=-1, keepdim=True)"))
    result = _run(pytester, "-k", "nanogpt.manual", update=False)
    assert _judged(result) == 42
    failed = _failed(result)
    assert all(cats == ["regression"] for cats in failed.values()), failed
    assert not [k for k in failed if "-fp32-" in k or "-fp8-e4m3-" in k], failed
    assert sum(f"-{c}-" in k for k in failed for c in ("fp16", "bf16")) >= 6, sorted(failed)


@full
@needs_transformers
def test_hf_eager_without_its_fp32_softmax_dtype_is_no_defect_and_no_alarm(pytester):
    """Dropping ``dtype=torch.float32`` from eager_attention_forward's softmax changes no bit on
    this CPU: torch's softmax of fp16 and bf16 accumulates in fp32 and rounds once either way (so
    does CUDA's). The harness must stay quiet, goldens included."""
    _hf_attention(pytester)
    _run(pytester, "-k", "hf.eager").assert_outcomes(passed=66, skipped=11)
    _hf_attention(pytester, None, ("nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32)",
                                   "nn.functional.softmax(attn_weights, dim=-1)"))
    _run(pytester, "-k", "hf.eager", update=False).assert_outcomes(passed=66, skipped=11)


@full
@needs_transformers
def test_llama_rms_norm_variance_in_fp16_is_found_by_the_drawn_regime(pytester):
    _vendor(pytester, "hf_llama", VARIANCE_IN_INPUT_DTYPE)
    pytester.makeconftest(HF_RMS_NORM)
    result = _run(pytester, "--precision-configs=fp16,bf16", "-k", "hypothesis")
    result.assert_outcomes(failed=1, passed=1)
    assert list(_failed(result)) == ["rms_norm[hf.rms_norm-fp16-hypothesis]"]
    result.stdout.fnmatch_lines(["*Hypothesis found (after shrinking)*"])


@full
@needs_interpreter
@pytest.mark.parametrize("configs", ["fp32,fp16", "amp-fp16,amp-bf16,fp8-e4m3"])
def test_tutorial_softmax_as_written_passes_every_config_and_regime(pytester, monkeypatch, configs):
    _triton(pytester, monkeypatch)
    result = _run(pytester, f"--precision-configs={configs}")
    n = len(configs.split(","))
    result.assert_outcomes(passed=13 * n)  # 11 regimes, the drawn and the fresh one
    assert _judged(result) == 13 * n


@full
@needs_interpreter
def test_tutorial_softmax_with_padding_loaded_as_zero_fails_on_rows_not_a_power_of_two(pytester, monkeypatch):
    """Rows of 256 fill their block: the defect is invisible there. Rows of 1000 (24 padding lanes)
    are off by 24 exp(-max) relative: over fp32's budget, under fp16's ULP; drawn rows of any
    length find it in every config."""
    _triton(pytester, monkeypatch, PADDING_LOADED_AS_ZERO)
    configs = ("fp32", "fp16", "amp-fp16", "amp-bf16", "fp8-e4m3")
    result = _run(pytester, f"--precision-configs={','.join(configs)}")
    assert _judged(result) == 13 * len(configs)
    failed = _failed(result)
    assert {f"softmax[tutorial_softmax-{c}-hypothesis]" for c in configs} <= set(failed), failed
    assert {k.rsplit("-", 1)[1][:-1] for k in failed} <= {"len1000", "hypothesis"}, failed
    assert all("accuracy" in cats for cats in failed.values()), failed


@full
@needs_interpreter
def test_tutorial_softmax_with_padding_loaded_as_zero_fails_bf16(pytester, monkeypatch):
    """Judged in bf16 on a CPU (the interpreter's bf16 emulated as on a GPU), not excused as the
    interpreter's expected failure."""
    _triton(pytester, monkeypatch, PADDING_LOADED_AS_ZERO)
    result = _run(pytester, "--precision-configs=bf16", "-k", "hypothesis")
    result.assert_outcomes(failed=1)
    assert "accuracy" in _failed(result)["softmax[tutorial_softmax-bf16-hypothesis]"]


@full
@needs_interpreter
def test_tutorial_softmax_without_max_subtraction_does_not_compile_for_16_bit_inputs(pytester, monkeypatch):
    """The tutorial's kernel computes in fp32 only because tl.max promotes the 16-bit row: without
    the subtraction, tl.exp gets fp16 or bf16, which Triton refuses (on a GPU too). Those cases
    crash with Triton's message; fp32 ones overflow."""
    _triton(pytester, monkeypatch, KERNEL_WITHOUT_MAX)
    result = _run(pytester, "--precision-configs=fp16,bf16,amp-fp16", "-k", "not hypothesis and not len32768")
    failed = _failed(result)
    assert {k for k, cats in failed.items() if cats == ["crash"]} == \
        {f"softmax[tutorial_softmax-{c}-{r}]" for c in ("fp16", "bf16") for r in SOFTMAX_REGIMES if r != "len32768"}
    assert set(failed) - {k for k, cats in failed.items() if cats == ["crash"]} == \
        {"softmax[tutorial_softmax-amp-fp16-scale200]", "softmax[tutorial_softmax-amp-fp16-large-negative]"}
    result.stdout.fnmatch_lines(["precision-suite::softmax[[]tutorial_softmax-fp16-unit[]]: target 'tutorial_softmax' "
                                 "(softmax) under config fp16 on regime unit raised InterpreterError: "
                                 "ValueError(\"Expected dtype [[]'fp32', 'fp64'[]] but got fp16\")"])
