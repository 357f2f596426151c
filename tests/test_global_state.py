"""torch's process-wide state a target leaves changed (default dtype, grad mode, an autocast left
entered, flush-denormal, deterministic and TF32 flags) fails that target's case naming the change,
is restored before anything else runs, and writes no golden; a target that changes state and puts
it back, or draws random numbers, is not flagged."""
import os

import pytest
import torch

from pytest_precision.numerics.global_state import snapshot

pytest_plugins = ["pytester"]

CONFTEST = """
import torch
import pytest_precision

@pytest_precision.register("clean", kind="softmax")
def clean(x):  # changes state inside, and puts it back; draws random numbers
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False), torch.no_grad():
        torch.rand(3)
    return torch.softmax(x.float(), -1).to(x.dtype)

@pytest_precision.register("leaky", kind="softmax")
def leaky(x):
    out = torch.softmax(x.float(), -1).to(x.dtype)
    if x.shape[-1] == 1:  # the len1 regime: leaves its change behind
        {LEAK}
    return out
"""
ARGS = ("--precision-suite", "--precision-configs=fp32", "--precision-no-speed", "-p", "no:cacheprovider",
        "-k", "softmax and not log_softmax and (unit or len1])", "--precision-update-baselines")


@pytest.mark.parametrize("leak, said", [
    ("torch.set_default_dtype(torch.float64)", "default dtype float32 -> float64"),
    ("torch.set_grad_enabled(False)", "grad mode True -> False"),
    ("torch.autocast('cpu', dtype=torch.bfloat16).__enter__()", "autocast on cpu False -> True; autocast nesting 0 -> 1"),
    ("torch.use_deterministic_algorithms(True)", "deterministic algorithms False -> True"),
    # before, left in place for the user's later tests without a word
    ("import os; os.chdir('/')", "working directory * -> /"),
    ("import os; os.environ.clear()", "environment variables * removed (*)"),
])
def test_a_leaked_change_fails_its_case_and_no_other(pytester, leak, said):
    pytester.makeconftest(CONFTEST.replace("{LEAK}", leak))
    pytester.makeini("[pytest]\n")
    result = pytester.runpytest(*ARGS)
    # clean's 2 cases and leaky's unit case pass, after leaky's len1 case ran (in either order)
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines([f"*softmax[[]leaky-fp32-len1[]]*left process-wide state changed: *{said}*"
                                 "(restored;*"])
    assert not (pytester.path / "precision_baselines" / "softmax" / "leaky" / "len1").exists()  # nothing written
    assert os.getcwd() == str(pytester.path) and "PATH" in os.environ  # restored for what runs next


def test_the_snapshot_restores_what_a_target_changed():
    before = snapshot()
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.autocast("cpu", dtype=torch.bfloat16).__enter__()  # entered, never exited
    try:
        changed = before.changes(snapshot())
    finally:
        before.restore()
    assert changed == ["default dtype float32 -> float64", "grad mode True -> False", "autocast on cpu False -> True",
                       "autocast nesting 0 -> 1"]
    # the nesting is back at 0: the next autocast region ends by clearing its cache of casted weights
    weight = torch.ones(4, 4, requires_grad=True)  # a leaf parameter: autocast caches its casts
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.mm(weight, weight)
    with torch.no_grad():
        weight.add_(1.0)  # an optimizer step
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert float(torch.mm(weight, weight)[0, 0].detach()) == 16.0  # not a stale cast of the ones (4.0)
    assert before.changes(snapshot()) == []
    assert torch.get_default_dtype() is torch.float32 and torch.is_grad_enabled()


def test_flush_denormal_is_seen_where_the_cpu_has_it():
    before = snapshot()
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-denormal mode")
    try:
        assert before.changes(snapshot()) == ["flush-denormal False -> True"]
    finally:
        before.restore()
    assert before.changes(snapshot()) == []
