"""Adopting the harness (pytester): the vendored clients of tests/clients/, registered exactly as their
upstream code is, with no declaration added in advance. The first run ends with one block of
declarations (reporting.declarations); pasted once, as printed, it turns every correct client green.
A defect planted in a client is still caught on that first run, and the block does not explain it.

CI runs fp32, fp16 and bf16 (the configs where conventions and defects differ); PRECISION_CLIENTS=all
every CPU config."""
import re

import pytest
from test_clients import (FLOAT32_MIN_CAST, FULL, HF_ATTENTION, HF_GPT2_ATTENTION, NANOGPT_ATTENTION, SOFTMAX_IN_INPUT_DTYPE,
                          SOFTMAX_WITHOUT_MAX, TRITON_SOFTMAX, _derandomised, _failed, _one_thread, _run,  # noqa: F401
                          _vendor, needs_interpreter, needs_transformers)

pytest_plugins = ["pytester"]

CONFIGS = () if FULL else ("--precision-configs=fp32,fp16,bf16",)
# the declarations the adapters in tests/test_clients.py carry, which the upstream code does not
DECLARED = re.compile(r',\s*(?:grouped_query|cross_lengths|sdpa|causal|fully_masked|forward_only)=(?:"[^"]*"|\w+)')
PRINTED = re.compile(r'^    pytest_precision\.register\("([^"]+)", \.\.\., (.*)\)$')


def upstream(conftest: str) -> str:
    """A client's registration as its upstream code is: every declaration left out."""
    return DECLARED.sub("", conftest)


def printed_block(result) -> dict[str, str]:
    """Target -> the keywords its line of the run's block of declarations adds."""
    return {m.group(1): m.group(2) for line in result.outlines if (m := PRINTED.match(line))}


def apply(conftest: str, block: dict[str, str]) -> str:
    """The one edit: each printed line's keywords added to its target's registration."""
    for name, keywords in block.items():
        conftest, n = re.subn(rf'(register\("{re.escape(name)}",[^)]*?kind="\w+")', rf"\1, {keywords}", conftest)
        assert n == 1, name
    return conftest


def _adopted(pytester, conftest: str, expected: dict[str, str], *args):
    """The first run of ``conftest`` as upstream: only conventions and contracts fail, each explained by
    the printed block, which is ``expected``; pasted, the next run passes every case it judges."""
    configs = () if any(a.startswith("--precision-configs") for a in args) else CONFIGS
    pytester.makeconftest(conftest)
    first = _run(pytester, *configs, *args)
    block = printed_block(first)
    assert block == expected, block
    failed = _failed(first)
    assert failed and all(set(c) <= {"convention", "unsupported", "contract", "crash", "baseline"}
                          for c in failed.values()), failed
    assert "not explained" not in first.stdout.str()
    pytester.makeconftest(apply(conftest, block))
    again = _run(pytester, *configs, *args)
    outcomes = again.parseoutcomes()
    assert outcomes.get("passed", 0) > 0 and "failed" not in outcomes, again.stdout.str()[-3000:]
    assert printed_block(again) == {}
    return first


def _not_explained(result) -> set[str]:
    """The cases the block's "not explained" lines name (the first four per target)."""
    found = set()
    for line in result.outlines:
        if "not explained, failures as listed above" in line:
            found |= {c.strip() for c in line.split(": ", 2)[-1].split(" and ")[0].split(", ")}
    return found


@needs_transformers
def test_hf_attention_functions_adopted_with_one_edit(pytester):
    _vendor(pytester, "hf_llama")
    _vendor(pytester, "hf_sdpa_attention")
    conftest = upstream(HF_ATTENTION)
    first = _adopted(pytester, conftest, {"hf.eager": 'causal="bottom-right", fully_masked="mean"',
                                          "hf.sdpa": 'causal="bottom-right"'})
    first.stdout.fnmatch_lines(["precision-suite::attention[[]hf.eager-fp32-causal-leftpad[]]: FAIL convention (50 "
                                "fully masked query rows (every key masked): the target returned the mean of v *: "
                                "declare fully_masked='mean')"])
    # exp, sum and divide in the input dtype: caught on the same first run, and explained by nothing
    _vendor(pytester, "hf_llama", SOFTMAX_IN_INPUT_DTYPE)
    pytester.makeconftest(conftest)
    planted = _run(pytester, *CONFIGS, "-k", "hf.eager")
    failed = _failed(planted)
    accuracy = {case for case, cats in failed.items() if "accuracy" in cats}
    assert accuracy and {case.split("-")[1] for case in accuracy} <= {"fp16", "bf16"}, sorted(failed)
    assert "not explained" in planted.stdout.str()


@needs_transformers
def test_gpt2_attention_adopted_with_one_edit_and_a_float32_minimum_mask_stays_red(pytester):
    _vendor(pytester, "hf_gpt2")
    conftest = upstream(HF_GPT2_ATTENTION)
    _adopted(pytester, conftest, {"hf.gpt2_eager": 'causal="bottom-right", fully_masked="mean", grouped_query=False'})
    # the mask at float32's minimum cast to fp16 or bf16: NaN on the fully masked rows there, where fp32
    # returns the mean: fp32's convention is the block's, and the 16-bit cases stay failures
    pytester.makeconftest(conftest.replace(*FLOAT32_MIN_CAST))
    planted = _run(pytester, *CONFIGS)
    assert printed_block(planted)["hf.gpt2_eager"] == 'causal="bottom-right", fully_masked="mean", grouped_query=False'
    assert {"attention[hf.gpt2_eager-fp16-causal-leftpad]", "attention[hf.gpt2_eager-bf16-causal-leftpad]"} <= \
        _not_explained(planted), planted.stdout.str()[-3000:]


NANOGPT_UPSTREAM = upstream(NANOGPT_ATTENTION.format(FLASH_NOTE="calls SDPA", FLASH_SDPA="")).replace(
    '''    elif not causal:
        pytest.skip("nanoGPT's flash path is causal only (is_causal=True)")
''', "")  # nanoGPT's flash path masks causally whatever it is asked: is_causal=True


def test_nanogpt_attention_adopted_with_one_edit(pytester):
    _vendor(pytester, "nanogpt_model")
    assert "pytest.skip" not in NANOGPT_UPSTREAM
    first = _adopted(pytester, NANOGPT_UPSTREAM, {
        "nanogpt.manual": "cross_lengths=False, grouped_query=False",
        "nanogpt.flash": "causal_only=True, cross_lengths=False, grouped_query=False"})
    for line in ("precision-suite::attention[[]nanogpt.manual-fp32-gqa[]]: FAIL unsupported (on inputs with 4 query "
                 "heads over 2 key heads: if the target does not support that, declare grouped_query=False)",
                 "precision-suite::attention[[]nanogpt.flash-fp32+math-unit[]]: FAIL convention (asked for no causal "
                 "mask, the target applied one *: if it is causal only, declare causal_only=True)"):
        first.stdout.fnmatch_lines([line])
    # the softmax without its max subtracted: overflow on the same first run, explained by nothing
    _vendor(pytester, "nanogpt_model", SOFTMAX_WITHOUT_MAX)
    pytester.makeconftest(NANOGPT_UPSTREAM)
    planted = _run(pytester, *CONFIGS, "-k", "nanogpt.manual and (sharp40 or gqa)")
    overflowing = {case for case, cats in _failed(planted).items() if {"overflow", "nan"} <= set(cats)}
    assert {f"attention[nanogpt.manual-{c}-sharp40]" for c in ("fp32", "fp16", "bf16")} <= overflowing
    assert printed_block(planted) == {"nanogpt.manual": "grouped_query=False"}
    assert overflowing <= _not_explained(planted)


@needs_interpreter
def test_the_triton_tutorial_softmax_as_upstream_needs_no_declaration(pytester, monkeypatch):
    # softmax kinds judge the output alone: the tutorial's kernel without a backward needs no forward_only=True
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _vendor(pytester, "triton_fused_softmax")
    pytester.makeconftest(upstream(TRITON_SOFTMAX))
    result = _run(pytester, "--precision-configs=fp32", "-k", "not hypothesis")
    assert result.parseoutcomes().get("passed") == 12 and "failed" not in result.parseoutcomes()
    assert printed_block(result) == {}


def test_an_output_without_gradients_is_a_contract_to_declare(pytester):
    pytester.makeconftest("""
import torch
import pytest_precision

def kernel(x):  # a forward-only kernel: its result carries no autograd graph
    return torch.tanh(x).detach()

pytest_precision.register("kernel", kernel, kind="op", inputs={"unit": lambda g: torch.randn(8, 16, generator=g)})
""")
    first = _adopted(pytester, pytester.path.joinpath("conftest.py").read_text(), {"kernel": "forward_only=True"})
    first.stdout.fnmatch_lines(["precision-suite::op[[]kernel-fp32-unit[]]: FAIL contract (it returns an output without "
                                "gradients: if it does so by design, declare forward_only=True)"])
