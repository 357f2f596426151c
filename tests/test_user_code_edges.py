"""Collection runs no user code that can touch the session: the call that decides an attention
target's variants (does it reach SDPA?) is contained. A target that skips, raises, exits, hangs or
answers differently in two xdist workers concerns its own cases alone; every other target of the
repository is still judged."""
import json
import os
import re

import pytest
from machine import ON_CPU
from pytest_precision.reporting.report import REPORT_SCHEMA

pytest_plugins = ["pytester"]

# a softmax beside every attention target below: it must be judged whatever the attention target does
SOFTMAX = """
import os
import time
import pytest
import torch
import torch.nn.functional as F
import pytest_precision


@pytest_precision.register("my_softmax", kind="softmax")
def my_softmax(x):
    return torch.softmax(x.float(), -1).to(x.dtype)
"""

ONLY_FP16 = SOFTMAX + """
@pytest_precision.register("only_fp16_attn", kind="attention")
def only_fp16_attn(q, k, v, causal=False):
    if q.dtype is not torch.float16:
        pytest.skip("fp16 only")
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
"""

ARGS = ("--precision-suite", "--precision-no-speed", "-p", "no:cacheprovider", *ON_CPU)


def _outcomes(result) -> dict:
    return {k: v for k, v in result.parseoutcomes().items() if k in ("passed", "failed", "skipped", "errors", "error")}


def test_a_target_that_skips_a_dtype_in_the_callable_loses_nothing(pytester):
    """The reproduction of issue 23: the probe's float32 call skipped and emptied the session."""
    pytester.makeconftest(ONLY_FP16)
    pytester.makeini("[pytest]\n")
    args = (*ARGS, "--precision-configs=fp32,fp16", "-k", "unit or scale20 and not scale200")
    pytester.runpytest(*args, "--precision-update-baselines")
    result = pytester.runpytest(*args, "-rs")
    # softmax: 2 configs x unit, scale20; attention: fp16 under +math and +flash (the probe found SDPA
    # in fp16 after the fp32 call skipped), fp32's 2 cases skipped by the target itself
    assert _outcomes(result) == {"passed": 4 + 2, "skipped": 2}, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines(["| only_fp16_attn | fp32+math * | skip: fp16 only *", "SKIPPED [[]2[]] conftest.py:*: fp16 only"])
    assert result.ret == 0


def test_a_causal_only_target_is_asked_again_with_the_mask(pytester):
    """nanoGPT's flash path is causal only: it skips a call without the mask, as the probe's first is."""
    pytester.makeconftest(SOFTMAX + """
@pytest_precision.register("causal_only", kind="attention")
def causal_only(q, k, v, causal=False):
    if not causal:
        pytest.skip("causal only")
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
""")
    pytester.makeini("[pytest]\n")
    args = (*ARGS, "--precision-configs=fp32", "-k", "causal and not cross and not causal136 and not fresh or unit and softmax")
    result = pytester.runpytest(*args, "--precision-update-baselines", "-v")
    # the softmax, and the causal regime under both SDPA backends: the probe saw SDPA with the mask
    outcomes = _outcomes(result)
    assert outcomes["passed"] == 1 + 2 and "failed" not in outcomes, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines(["*attention[[]causal_only-fp32+math-causal[]] PASSED*",
                                 "*attention[[]causal_only-fp32+flash-causal[]] PASSED*"])
    assert "its variants were not decided" not in result.stdout.str()


def test_a_target_that_raises_for_a_dtype_is_asked_in_the_next(pytester):
    """flash-attn refuses float32 by raising (RuntimeError), not by skipping: the probe asks in fp16."""
    pytester.makeconftest(SOFTMAX + """
@pytest_precision.register("flash_like", kind="attention")
def flash_like(q, k, v, causal=False):
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
""")
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest(*ARGS, "--precision-configs=fp16", "-k", "unit", "--precision-update-baselines")
    # the softmax, and flash_like's unit case under both SDPA backends, seen reaching SDPA in fp16
    result.assert_outcomes(passed=1 + 2)
    assert "its variants were not decided" not in result.stdout.str()


def test_a_target_that_skips_every_probe_call_keeps_every_backend_and_says_why(pytester):
    pytester.makeconftest(SOFTMAX + """
@pytest_precision.register("picky", kind="attention")
def picky(q, k, v, causal=False):
    if q.shape[-1] == 16:  # the probe's head dim
        pytest.skip("head dim 16 unsupported")
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
""")
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest(*ARGS, "--precision-configs=fp32", "-k", "hd59 or unit and softmax",
                                "--precision-report=report.json")
    # the softmax is judged (no golden: baseline failure), picky runs hd59 under both backends
    result.assert_outcomes(failed=3)
    result.stdout.fnmatch_lines([
        "*attention[[]picky-fp32+math-hd59[]]: FAIL baseline*",
        "  target 'picky': its variants were not decided at collection (the probe call ran in no dtype "
        "(float32: skipped (head dim 16 unsupported); float32, causal: skipped (head dim 16 unsupported); float16: *; "
        "bfloat16, causal: *)): kept every variant of the attention "
        "kind (+math, +flash); declare at registration what the probe asks to skip it (sdpa=True or sdpa=False)",
        "*attention[[]picky-fp32+flash-hd59[]]: FAIL baseline*",
    ])
    # and once below the summary table (counted above pytest's short summary, which CI=true leaves untruncated)
    report = result.stdout.str().split("short test summary info")[0]
    assert report.count("target 'picky': its variants were not decided") == 3
    # and in the JSON report, on each of picky's cases
    cases = json.loads((pytester.path / "report.json").read_text())["cases"]
    notes = {c["target"]: c.get("variants_note", "") for c in cases}
    assert notes["picky"].startswith("its variants were not decided at collection") and not notes["my_softmax"]
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(json.loads((pytester.path / "report.json").read_text()), REPORT_SCHEMA)


@pytest.mark.parametrize("body, said", [
    ("raise SystemExit(0)", "the probe call raised SystemExit: 0"),
    ("pytest.exit('bye')", "the probe call raised Exit: bye"),
    ("pytest.fail('probe refused')", "the probe call raised Failed: probe refused"),
])
def test_a_target_that_exits_or_fails_at_the_probe_ends_nothing(pytester, body, said):
    pytester.makeconftest(SOFTMAX + f"""
CALLS = []

@pytest_precision.register("rude", kind="attention")
def rude(q, k, v, causal=False):
    CALLS.append(1)
    if len(CALLS) == 1:  # only the first call (the probe) misbehaves
        {body}
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
""")
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest(*ARGS, "--precision-configs=fp32", "-k", "unit")
    # 1 softmax and 2 backend cases of rude, judged (no goldens: baseline failures)
    result.assert_outcomes(failed=3)
    result.stdout.fnmatch_lines([f"target 'rude': its variants were not decided at collection ({said}): *"])


def test_a_target_that_hangs_at_the_probe_fails_its_own_cases_at_once(pytester):
    pytester.makeconftest(SOFTMAX + """
@pytest_precision.register("stuck", kind="attention")
def stuck(q, k, v, causal=False):
    time.sleep(3600)
""")
    pytester.makeini("[pytest]\nprecision_timeout = 2\n")
    result = pytester.runpytest(*ARGS, "--precision-configs=fp32", "-k", "unit or causal136 or padded",
                                "--durations=0", "--durations-min=0")
    # the softmax's one case is judged; stuck's 4 cases (2 regimes x 2 backends) fail without running,
    # and the 4 it does not support (padded and padded-mha: no key_padding_mask keyword) are skipped as
    # without the hang
    result.assert_outcomes(failed=5, skipped=4)
    result.stdout.fnmatch_lines([
        "*attention[[]stuck-fp32+math-unit[]]: target 'stuck' (attention): the call that decides its variants at "
        "collection ran past 2 s (ini precision_timeout), so its cases are not run (each would hang again); where it was:",
        "*time.sleep(3600)*",
    ])
    assert "my_softmax-fp32-unit" in result.stdout.str()
    durations = [float(line.split("s ")[0]) for line in result.stdout.lines
                 if re.match(r"\d+\.\d+s call .*stuck-fp32\+\w+-(unit|causal136)", line)]
    assert len(durations) == 4 and all(d < 1.0 for d in durations), result.stdout.str()[-2000:]  # not run


def test_xdist_workers_collect_the_same_cases_when_a_target_answers_differently(pytester):
    """A target that reaches SDPA in one worker process and not in the other: each worker would
    collect other node ids, which xdist refuses for the whole session. The first decision is the run's."""
    pytest.importorskip("xdist")
    pytester.makeconftest(SOFTMAX + """
def manual(q, k, v, causal=False):
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s.float(), -1).to(q.dtype) @ v


@pytest_precision.register("moody", kind="attention")
def moody(q, k, v, causal=False):
    if os.environ.get("PYTEST_XDIST_WORKER") == "gw1":
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return manual(q, k, v, causal)
""")
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest_subprocess(*ARGS, "-n", "2", "--precision-configs=fp32", "-k", "unit or causal")
    out = result.stdout.str()
    assert "Different tests were collected" not in out, out[-3000:]
    outcomes = _outcomes(result)
    # 1 softmax case; moody: unit, causal, causal-cross, causal136 under one or two variants
    assert outcomes.get("failed", 0) in (1 + 4, 1 + 8) and "errors" not in outcomes and "error" not in outcomes, out[-3000:]


# ---- a skip from inside the callable on a drawn regime skips that input, not the search ---------

SHORT_ROWS = """
import pytest
import torch
import pytest_precision


@pytest_precision.register("short_rows", kind="softmax")
def short_rows(x):
    if x.shape[-1] > 64:
        pytest.skip("rows longer than 64 unsupported")
    {BODY}
"""
CORRECT_BODY = "return torch.softmax(x.float(), -1).to(x.dtype)"
NO_MAX_BODY = "e = x.exp()  # no max subtraction: overflows past 11 in fp16\n    return e / e.sum(-1, keepdim=True)"


@pytest.mark.parametrize("body, outcome", [(CORRECT_BODY, {"passed": 1}), (NO_MAX_BODY, {"failed": 1})],
                         ids=["correct", "no-max-subtraction"])
def test_a_skip_on_one_drawn_input_lets_the_search_go_on(pytester, body, outcome):
    pytester.makeconftest(SHORT_ROWS.format(BODY=body))
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest(*ARGS, "--precision-configs=fp16", "-k", "hypothesis")
    assert _outcomes(result) == outcome, result.stdout.str()[-3000:]
    if "failed" in outcome:
        result.stdout.fnmatch_lines(["*softmax[[]short_rows-fp16-hypothesis[]]: FAIL *Hypothesis found a failing input*"])


def test_a_target_that_skips_every_drawn_input_is_skipped_with_its_reason(pytester):
    pytester.makeconftest(SHORT_ROWS.replace("x.shape[-1] > 64", "True").format(BODY=CORRECT_BODY))
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest(*ARGS, "--precision-configs=fp16", "-k", "hypothesis", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED *short_rows: it skipped every drawn input it was given (rows longer than 64 "
                                 "unsupported)*"])


# ---- the xdist claim on a target's decision (runner.variants), unit by unit -----------------------

def _decisions(monkeypatch, decide, name="pkg.mod:fn"):
    from types import SimpleNamespace

    from pytest_precision.runner import variants

    calls = []

    def counted(*args):
        calls.append(args)
        return decide()
    monkeypatch.setattr(variants, "_decide", counted)
    kind, target = SimpleNamespace(name="attention"), SimpleNamespace(name=name)
    return calls, lambda shared: variants.decide_variants(kind, target, "cpu", 5.0, "limit", shared)


def _claim(shared, name="pkg.mod:fn"):
    import hashlib

    return shared / (hashlib.sha256(f"attention\0{name}\0cpu".encode()).hexdigest()[:32] + ".claim")


def test_a_worker_waits_for_the_claimants_decision_and_does_not_probe(monkeypatch, tmp_path):
    import threading

    from pytest_precision.runner.variants import VariantDecision

    calls, decide = _decisions(monkeypatch, lambda: VariantDecision(("",)))
    assert decide(str(tmp_path)) == VariantDecision(("",)) and len(calls) == 1  # claimed and published
    assert _claim(tmp_path).read_text() == str(os.getpid())
    # another target, claimed by a live process (this one) that publishes a moment later
    calls, decide = _decisions(monkeypatch, lambda: VariantDecision(("",)), name="other")
    _claim(tmp_path, "other").write_text(str(os.getpid()))
    theirs = VariantDecision(("+math", "+flash"))
    publish = threading.Timer(0.3, lambda: _claim(tmp_path, "other").with_suffix(".json").write_text(theirs.to_json()))
    publish.start()
    assert decide(str(tmp_path)) == theirs and not calls  # read, not probed again
    publish.join()


def test_a_dead_claimant_is_not_waited_for(monkeypatch, tmp_path):
    import subprocess
    import sys
    import time

    from pytest_precision.runner.variants import VariantDecision

    calls, decide = _decisions(monkeypatch, lambda: VariantDecision(("+math",)))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _claim(tmp_path).write_text(dead.stdout.strip())  # a worker killed while probing
    start = time.monotonic()
    assert decide(str(tmp_path)) == VariantDecision(("+math",)) and len(calls) == 1
    assert time.monotonic() - start < 2  # not the limit and its margin (35 s here)


def test_a_claimant_that_fails_releases_its_claim_and_a_missing_directory_decides_alone(monkeypatch, tmp_path):
    from pytest_precision.runner.variants import VariantDecision

    def interrupted():
        raise KeyboardInterrupt
    calls, decide = _decisions(monkeypatch, interrupted)
    with pytest.raises(KeyboardInterrupt):
        decide(str(tmp_path))
    assert not list(tmp_path.glob("*.claim"))  # a waiting worker would decide at once
    calls, decide = _decisions(monkeypatch, lambda: VariantDecision(("",)))
    assert decide(str(tmp_path / "on-the-controller-only")) == VariantDecision(("",)) and len(calls) == 1
