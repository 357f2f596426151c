"""A model repository's run (pytester): only the targets it registered, each backend variant only
where it applies, the limits a target declares, a Triton target on a CPU machine, and output a
user reads."""
import os
import subprocess
import sys

import pytest
from machine import ON_CPU

pytest_plugins = ["pytester"]

EAGER = """
import math
import torch
import pytest_precision


def eager(q, k, v, causal=False, key_padding_mask=None):
    h = q.shape[1]
    k, v = (t if t.shape[1] == h else t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    s = q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])
    allowed = torch.ones(s.shape[-2:], dtype=torch.bool)
    allowed = (allowed.tril() if causal else allowed)[None, None]
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    return (torch.softmax(s.masked_fill(~allowed, -math.inf), -1) @ v.float()).to(q.dtype)
"""


def _collect(pytester, *args):
    result = pytester.runpytest("--precision-suite", "--co", "-q", "-p", "no:cacheprovider", *ON_CPU, *args)
    return [line for line in result.outlines if line.startswith("precision-suite::")]


def _run(pytester, *args):
    return pytester.runpytest("--precision-suite", "--precision-no-speed", "-p", "no:cacheprovider", *ON_CPU, *args)


# ---- 1: the user's run is the user's --------------------------------------------------------

def test_only_the_registered_targets_run(pytester):
    pytester.makeconftest(EAGER + 'pytest_precision.register("mine", eager, kind="attention")\n')
    ids = _collect(pytester)
    assert ids and all(i.startswith("precision-suite::attention[mine-") for i in ids), ids[:5]
    # no torch.softmax, torch.log_softmax, torch.sdpa, tiny_gpt or DDP case, so no golden of theirs
    with_builtins = _collect(pytester, "--precision-builtins")
    names = {i.split("[", 1)[1].split("-", 1)[0] for i in with_builtins}
    assert {"mine", "torch.sdpa", "torch.softmax", "torch.log_softmax", "tiny_gpt"} <= names


def test_a_registered_softmax_does_not_bring_log_softmax(pytester):
    pytester.makeconftest("""
import torch, pytest_precision
pytest_precision.register("mine", lambda x: torch.softmax(x, -1), kind="softmax")
""")
    ids = _collect(pytester)
    assert ids and all(i.startswith("precision-suite::softmax[mine-") for i in ids)


def test_ini_targets_are_registered_targets_too(pytester):
    pytester.makepyfile(mykernels="""
import torch
def softmax(x):
    return torch.softmax(x, -1)
""")
    pytester.makeini("[pytest]\nprecision_targets = mykernels:softmax softmax\n")
    ids = _collect(pytester)
    assert ids and all(i.startswith("precision-suite::softmax[mykernels:softmax-") for i in ids)


def test_with_nothing_registered_the_builtins_run(pytester):
    names = {i.split("[", 1)[1].split("-", 1)[0] for i in _collect(pytester)}
    assert {"torch.softmax", "torch.log_softmax", "torch.sdpa", "tiny_gpt"} <= names


# ---- 2: variants only where they apply ------------------------------------------------------

def test_sdpa_backends_only_for_targets_that_reach_sdpa(pytester):
    pytester.makeconftest(EAGER + """
import torch.nn.functional as F

pytest_precision.register("eager", eager, kind="attention")

@pytest_precision.register("via_sdpa", kind="attention")
def via_sdpa(q, k, v, causal=False, key_padding_mask=None):
    mask = None if key_padding_mask is None else ~key_padding_mask[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)

pytest_precision.register("declared_plain", via_sdpa, kind="attention", sdpa=False)
""")
    ids = _collect(pytester, "--precision-configs=fp32", "-k", "unit")
    assert sorted(ids) == ["precision-suite::attention[declared_plain-fp32-unit]",
                           "precision-suite::attention[eager-fp32-unit]",
                           "precision-suite::attention[via_sdpa-fp32+flash-unit]",
                           "precision-suite::attention[via_sdpa-fp32+math-unit]"]


# ---- 7: targets declare what they support ---------------------------------------------------

LIMITED = EAGER + """
@pytest_precision.register("fp16_kernel", kind="attention", dtypes="fp16", head_dims=(16, 32, 64, 128),
                           grouped_query=False, cross_lengths=False, padding=False, forward_only=True)
def fp16_kernel(q, k, v, causal=False):
    assert q.dtype == torch.float16 and q.shape[-1] in (16, 32, 64, 128), "outside what it declared"
    assert k.shape[1] == q.shape[1] and k.shape[-2] == q.shape[-2], "outside what it declared"
    if torch.is_grad_enabled() and q.requires_grad:
        raise AssertionError("a forward-only kernel was asked for gradients")
    return eager(q.detach(), k.detach(), v.detach(), causal) {DEFECT}
"""


def test_declared_limits_skip_the_cases_outside_with_the_reason(pytester):
    pytester.makeconftest(LIMITED.format(DEFECT=""))
    pytester.makeini("[pytest]\n")
    args = ("--precision-configs=fp32,fp16", "-rs")
    _run(pytester, "--precision-update-baselines", *args)
    result = _run(pytester, *args, "--precision-report=report.json")
    # fp16: unit, sharp10, sharp40, causal, batch2, square128, square136, causal136 run; long, causal-cross
    # and short-keys (S_q != S_k), padded (grouped-query heads, padding), padded-mha and causal-leftpad
    # (padding), gqa (grouped-query heads), hd59 and hd40 (head dims) are skipped; fp32: all 18
    result.assert_outcomes(passed=9, skipped=9 + 18)  # fresh: within the limits in fp16
    result.stdout.fnmatch_lines([
        "*fp16_kernel: declares dtypes float16; fp32 feeds it float32*",
        "*fp16_kernel: declares head dims 16, 32, 64, 128; this regime has head dim 59*",
        "*fp16_kernel: declares cross_lengths=False; this regime has S_q 8 != S_k 512*",
        "*fp16_kernel: declares grouped_query=False; this regime has 4 query heads over 2 key heads*",
    ])
    import json
    report = json.loads((pytester.path / "report.json").read_text())
    skipped = [c for c in report["cases"] if c["verdict"] == "skip"]
    assert len(skipped) == 27 and all("declares" in c["skip_reason"] or "needs a key_padding_mask" in c["skip_reason"]
                                      for c in skipped)
    # judged on its forward output only: no gradient goldens
    outputs = {name for c in report["cases"] if c["verdict"] == "pass" for name in c.get("outputs", {})}
    assert outputs == {"out"}


def test_a_declared_target_still_fails_inside_its_limits(pytester):
    pytester.makeconftest(LIMITED.format(DEFECT="* 1.01"))
    result = _run(pytester, "--precision-configs=fp16", "-k", "unit")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*attention[[]fp16_kernel-fp16-unit[]]: FAIL accuracy*"])


def test_an_unknown_or_malformed_declaration_names_the_target(pytester):
    pytester.makeconftest(EAGER + 'pytest_precision.register("mine", eager, kind="attention", head_dim=64)\n')
    result = _run(pytester)
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*target 'mine' (attention): unknown declaration 'head_dim'; a attention target may "
                                 "declare dtypes, forward_only, mutates, aliases, deterministic, batch_invariant, sdpa, "
                                 "head_dims, *"])
    pytester.makeconftest(EAGER + 'pytest_precision.register("mine", eager, kind="attention", causal="lower")\n')
    result = _run(pytester)
    result.stderr.fnmatch_lines(["*target 'mine': causal='lower': expected 'top-left', 'bottom-right' or None*"])


DECODE = """
import torch
import torch.nn.functional as F
import pytest_precision
from torch.nn.attention.bias import causal_lower_right


def decode(q, k, v, causal=False):  # causal as Hugging Face's sdpa path: aligned bottom-right
    mask = causal_lower_right(q.shape[-2], k.shape[-2]) if causal else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

pytest_precision.register("decode", decode, kind="attention", {DECLARE})
"""


def test_the_causal_alignment_a_target_declares_is_the_one_it_is_held_to(pytester):
    pytester.makeconftest(DECODE.format(DECLARE='causal="bottom-right"'))
    args = ("--precision-configs=fp32", "-k", "causal and math and not pad")
    _run(pytester, "--precision-update-baselines", *args)
    _run(pytester, *args).assert_outcomes(passed=3)
    pytester.makeconftest(DECODE.format(DECLARE='causal="top-left"'))  # what it does not do
    result = _run(pytester, *args)
    result.assert_outcomes(passed=2, failed=1)  # S_q == S_k: both alignments agree; 8 x 24 tells them apart
    result.stdout.fnmatch_lines(["*attention[[]decode-fp32+math-causal-cross[]]: FAIL accuracy*",
                                 "*the output matches a bottom-right causal mask (max abs * within the budget *): if "
                                 "that is the target's alignment, declare it at registration (causal=\"bottom-right\")"])


def test_a_target_that_cannot_run_in_float64_keeps_its_failure(pytester):
    """The float64 re-run that locates a fault skips inside the target: the case still fails, and its
    fault is located against the target's float32 run, which the message says."""
    pytester.makeconftest("""
import pytest, torch, pytest_precision

@pytest_precision.register("fp32_only", kind="softmax")
def fp32_only(x):
    if x.dtype == torch.float64:
        pytest.skip("no float64 kernel")
    e = x.exp()  # no max subtraction: overflows on large logits
    return e / e.sum(-1, keepdim=True)
""")
    result = _run(pytester, "--precision-configs=fp32", "-k", "scale200")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*softmax[[]fp32_only-fp32-scale200[]]: FAIL*",
                                 "  first overflow in aten::exp at conftest.py:* under fp32: produced inf from finite inputs; the "
                                 "float32 run gave inf there too (not an exact result: the target refused float64)",
                                 "*the first fault is located against the target's float32 run, not a float64 one: it "
                                 "did not run on the float64 inputs (Skipped: no float64 kernel)*"])


# ---- 5: a Triton target on a CPU machine ----------------------------------------------------

TRITON_TARGET = """
import torch
import triton
import triton.language as tl
import pytest_precision


@triton.jit
def _softmax_rows(X, Y, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + row * N + offs, mask=offs < N, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, 0))
    tl.store(Y + row * N + offs, (e / tl.sum(e, 0)).to(Y.dtype.element_ty), mask=offs < N)


@pytest_precision.register("my_triton_softmax", kind="softmax")
def my_triton_softmax(x):
    y = torch.empty_like(x)
    _softmax_rows[(x.shape[0],)](x, y, N=x.shape[-1], BLOCK=triton.next_power_of_2(x.shape[-1]))
    return y
"""


@pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"), reason="triton is not installed")
def test_a_triton_target_without_gpu_or_interpreter_fails_once_saying_what_to_set(pytester):
    pytester.makeconftest(TRITON_TARGET)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "--precision-suite", "--precision-no-speed", "-p",
                           "no:cacheprovider", "--precision-configs=fp32", "-k", "unit or scale20", "-rs"],
                          cwd=pytester.path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:]
    assert out.count("cannot launch here: there is no GPU and Triton's interpreter is off; set TRITON_INTERPRET=1") \
        >= 1
    assert "1 failed, 2 skipped" in out, out[-2000:]
    assert "its Triton kernel cannot launch here (see softmax[my_triton_softmax-fp32-" in out
    assert "active drivers" not in out  # Triton's own words say nothing of what to do


# ---- 6: output a user reads -----------------------------------------------------------------

def test_a_raising_target_shows_the_users_frames_not_the_harness(pytester):
    pytester.makeconftest("""
import torch, pytest_precision

def reshape_rows(x):
    return x.view(3, -1)

@pytest_precision.register("broken", kind="softmax")
def broken(x):
    return reshape_rows(x).softmax(-1)
""")
    result = _run(pytester, "--precision-configs=fp32", "-k", "unit")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*raised RuntimeError: shape '[[]3, -1[]]' is invalid*",
                                 "conftest.py:8: in broken", "conftest.py:4: in reshape_rows",
                                 "E   RuntimeError: shape*"])
    failure = result.stdout.str().split("FAILURES")[1].split("precision summary")[0]
    assert "pytest_precision" not in failure and "kinds/tensor/target_call.py" not in failure
    assert len(failure.splitlines()) < 20
    # pytest's --fulltrace still shows every frame, the harness's too
    full = _run(pytester, "--precision-configs=fp32", "-k", "unit", "--fulltrace")
    assert "kinds/tensor/target_call.py" in full.stdout.str().split("FAILURES")[1]


def test_an_ini_target_declares_its_limits_on_its_line(pytester):
    pytester.makepyfile(mykernels=EAGER)
    pytester.makeini("[pytest]\nprecision_targets = mykernels:eager attention dtypes=fp16 head_dims=16,32 sdpa=false\n")
    ids = _collect(pytester, "--precision-configs=fp32,fp16", "-k", "unit or hd59")
    assert sorted(ids) == [f"precision-suite::attention[mykernels:eager-{c}-{r}]"
                           for c in ("fp16", "fp32") for r in ("hd59", "unit")]
    result = _run(pytester, "--precision-configs=fp32,fp16", "-k", "unit or hd59", "-rs")
    result.stdout.fnmatch_lines(["*mykernels:eager: declares head dims 16, 32; this regime has head dim 59*",
                                 "*mykernels:eager: declares dtypes float16; fp32 feeds it float32*"])


# ---- 3: the drawn regime's search and shrink end in their time ------------------------------

def test_a_slow_failing_target_is_caught_within_the_drawn_regimes_time(pytester):
    pytester.makeconftest("""
import time
import torch
import pytest_precision
from pytest_precision.kinds.cases import DrawnRegime
from pytest_precision.suites.softmax import SoftmaxKind


class QuickSoftmax(SoftmaxKind):
    suite = "quick_softmax"
    regimes = {}
    drawn = DrawnRegime("hypothesis", examples=30, seconds=2.0)

    def __init__(self):
        super().__init__(log=False)
        self.name = self.suite


pytest_precision.register_kind(QuickSoftmax())


@pytest_precision.register("slow_naive", kind="quick_softmax")
def slow_naive(x):
    with open("calls.txt", "a") as f:
        f.write("call\\n")
    end = time.process_time() + 0.3  # an interpreted kernel's pace, in CPU time (what the budget counts)
    while time.process_time() < end:
        pass
    e = x.exp()  # no max subtraction
    return e / e.sum(-1, keepdim=True)
""")
    result = _run(pytester, "--precision-configs=fp16", "-k", "hypothesis")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*quick_softmax[[]slow_naive-fp16-hypothesis[]]: FAIL*",
                                 "*Hypothesis found (after shrinking) logits of shape*"])
    # 2 CPU seconds at 0.3 s a call: about 7 calls, and the two of the first-fault re-run (unbounded: 24)
    calls = len((pytester.path / "calls.txt").read_text().splitlines())
    assert calls <= 14, calls


def test_the_model_repo_benchmark_says_which_targets_failed_and_on_what(tmp_path):
    import json

    from pytest_precision.benchmarks.model_repo import _failures

    report = tmp_path / "report.json"
    cases = [{"target": "eager", "categories": ["regression"]}, {"target": "eager", "categories": ["regression", "speed"]},
             {"target": "sdpa", "categories": []}, {"target": "fused", "categories": ["speed"]}]
    report.write_text(json.dumps({"cases": cases}))
    assert _failures(report) == "eager: 2 cases (regression 2, speed 1); fused: 1 cases (speed 1)"
    report.write_text(json.dumps({"cases": cases[2:3]}))
    assert _failures(report) == "none"
