"""The softmax suite end to end, in real pytest sessions (pytester): each verdict passes a
correct target and catches a planted defect."""
import json

import numpy as np
import pytest
from machine import DEVICE, NOT_KERNELS, configs_run
from sample_targets import CORRECT_SOFTMAX

from pytest_precision.numerics.configs import CONFIGS

pytest_plugins = ["pytester"]

CONFTEST = """
import torch
import pytest_precision

{body}
"""

CORRECT = CORRECT_SOFTMAX

CORRECT_LOG = """
@pytest_precision.register("mine_log", kind="log_softmax")
def mine_log(x):
    z = x.float()
    z = z - z.amax(-1, keepdim=True)
    return (z - z.exp().sum(-1, keepdim=True).log()).to(x.dtype)
"""

NO_MAX_SUBTRACTION = """
@pytest_precision.register("naive", kind="softmax")
def naive(x):
    e = x.exp()
    return e / e.sum(-1, keepdim=True)
"""

LOG_OF_SOFTMAX = """
@pytest_precision.register("log_of_softmax", kind="log_softmax")
def log_of_softmax(x):
    return torch.softmax(x, -1).log()
"""


def _setup(pytester, body, ini=""):
    pytester.makeconftest(CONFTEST.format(body=body))
    pytester.makeini(f"[pytest]\n{ini}\n")


def _line_of(pytester, text):
    lines = (pytester.path / "conftest.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def _run(pytester, *args):
    """A session of the softmax suite (the attention suite's cases are deselected)."""
    args = list(args)
    if "-k" in args:
        i = args.index("-k") + 1
        args[i] = f"softmax and ({args[i]})"
    else:
        args += ["-k", "softmax"]
    # accuracy only: timing is tested in test_speed.py, and timings taken under pytest -n are noise
    return pytester.runpytest("--precision-suite", "--precision-no-speed", "-p", "no:cacheprovider", *args)


# The second run of a correct target's every-config test, against the goldens its first run wrote:
# the drawn regime keeps no golden (it would repeat the first run's search, the same examples under
# CI=true), and the largest regime's goldens are read and judged by the same code as the others'
# (the main job reads the built-in targets' at that size under every config); the regimes with
# NaN and -inf in their goldens stay.
AGAIN = "not hypothesis and not fresh and not len32768"


def test_correct_softmax_and_log_softmax_pass_every_config(pytester):
    _setup(pytester, CORRECT + CORRECT_LOG)
    ran = configs_run()  # the CPU: every config but tf32
    skipped = len(CONFIGS) - len(ran)
    first = _run(pytester, "--precision-update-baselines")
    first.assert_outcomes(passed=2 * 13 * len(ran), skipped=2 * 13 * skipped)  # 2 targets x 13 regimes
    again = _run(pytester, "-k", AGAIN)  # every config, 10 of the regimes, against the goldens just written
    again.assert_outcomes(passed=2 * 10 * len(ran), skipped=2 * 10 * skipped)
    for result, regimes in ((first, 13), (again, 10)):
        result.stdout.fnmatch_lines([f"*precision summary (device {DEVICE}, budgets keyed {DEVICE}-*)*"])
        for config in ran:
            result.stdout.fnmatch_lines([f"*| mine *| {config} *| *{regimes} | *pass*"])
            result.stdout.fnmatch_lines([f"*| mine_log *| {config} *| *{regimes} | *pass*"])


def test_missing_max_subtraction_is_reported_as_overflow(pytester):
    _setup(pytester, NO_MAX_SUBTRACTION)
    # no update run first: it would fail this case too and write it no golden (the output is the same)
    result = _run(pytester, "--precision-configs=fp16", "-k", "sharp-peak")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*softmax[[]naive-fp16-sharp-peak[]]: FAIL overflow*",
        f"*first overflow in aten::exp at conftest.py:{_line_of(pytester, 'x.exp()')} under fp16: produced inf from "
        "finite inputs where the reference is *e+*",
        "*| naive *| fp16 *| *1 | *FAIL 1/1: *overflow*",
    ])


def test_log_of_softmax_is_caught_as_underflow(pytester):
    _setup(pytester, LOG_OF_SOFTMAX)
    # no update run first: it would fail this case too and write it no golden (the output is the same),
    # and its hypothesis case shrinks a counterexample for 20 s
    result = _run(pytester, "--precision-configs=fp32", "-k", "scale200")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*log_softmax[[]log_of_softmax-fp32-scale200[]]: FAIL underflow*oracle: underflow * > 0 allowed*",
        f"*first underflow in aten::log at conftest.py:{_line_of(pytester, '.log()')} under fp32: produced -inf from finite "
        f"inputs where the reference is *; the 0 came from aten::*softmax at conftest.py:{_line_of(pytester, '.log()')} "
        "underflowing where the reference is *e-*",
    ])


def test_inaccurate_softmax_fails_the_peer_budget(pytester):
    _setup(pytester, """
@pytest_precision.register("sloppy_exp", kind="softmax")
def sloppy_exp(x):
    z = x - x.amax(-1, keepdim=True)
    e = z.to(torch.bfloat16).exp().to(x.dtype)  # exp in 8 bits inside an fp32 softmax
    return e / e.sum(-1, keepdim=True)
""")
    result = _run(pytester, "--precision-configs=fp32", "-k", "unit")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*FAIL accuracy*oracle: max ULP * > budget *", "*worst elements:*"])


def test_fully_masked_row_rule(pytester):
    _setup(pytester, """
@pytest_precision.register("nan_to_zero", kind="softmax")
def nan_to_zero(x):
    return torch.nan_to_num(torch.softmax(x, -1), nan=0.0)
""")
    result = _run(pytester, "--precision-configs=fp32", "-k", "masked")
    result.assert_outcomes(failed=2)  # no goldens: both fail on that; the oracle check is what we look at
    result.stdout.fnmatch_lines(["*fully-masked*FAIL missing_nan*NaN expected but missing 512 > 0 allowed*"])
    assert "masked]: FAIL baseline" in result.stdout.str()  # partial masks: only the golden is missing


def test_regression_against_golden(pytester):
    """A target more accurate than torch gets a tight golden; making it torch-like later passes the
    peer budget but fails the regression budget."""
    accurate = """
@pytest_precision.register("mine", kind="softmax")
def mine(x):
    return torch.softmax(x.double(), -1).to(x.dtype)
"""
    _setup(pytester, accurate)
    _run(pytester, "--precision-update-baselines", "--precision-configs=fp32", "-k", "scale20 and not scale200").assert_outcomes(passed=1)
    _setup(pytester, accurate.replace("x.double()", "x"))
    result = _run(pytester, "--precision-configs=fp32", "-k", "scale20 and not scale200")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*FAIL regression (golden: max ULP * > budget *",
        "*against the golden (regression budget max ULP *",
        "*if this run is right, accept it with: pytest --precision-suite -k 'softmax[[]mine-fp32-scale20[]]' "
        "--precision-configs=fp32 --precision-update-baselines",
    ])
    assert "oracle:" not in result.stdout.str()  # within the peer budget: only the regression fires


def test_missing_baseline_names_the_command(pytester):
    _setup(pytester, CORRECT)
    result = _run(pytester, "--precision-configs=bf16", "-k", "unit")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*no golden baseline at *precision_baselines/softmax/mine/unit/bf16.npz",
        "*if this run is right, accept it with: pytest --precision-suite -k 'softmax[[]mine-bf16-unit[]]' --precision-configs=bf16 "
        "--precision-update-baselines",
    ])
    assert not (pytester.path / "precision_baselines").exists()  # nothing written without the flag
    # the printed command works
    fix = _run(pytester, "-k", "softmax[mine-bf16-unit]", "--precision-configs=bf16", "--precision-update-baselines")
    fix.assert_outcomes(passed=1)
    _run(pytester, "--precision-configs=bf16", "-k", "unit").assert_outcomes(passed=1)


@pytest.mark.parametrize("damage", ["corrupt-npz", "truncated-npz", "corrupt-json", "schema", "pickle"])
def test_damaged_baseline_is_named_and_kept(pytester, damage):
    _setup(pytester, CORRECT)
    _run(pytester, "--precision-update-baselines", "--precision-configs=fp16", "-k", "unit").assert_outcomes(passed=1)
    d = pytester.path / "precision_baselines" / "softmax" / "mine" / "unit"
    npz, meta = d / "fp16.npz", d / "fp16.json"
    if damage == "corrupt-npz":
        npz.write_bytes(b"not a zip file at all")
        expect = f"*{npz}: corrupt or truncated baseline tensors*"
    elif damage == "truncated-npz":
        npz.write_bytes(npz.read_bytes()[:100])
        expect = f"*{npz}: corrupt or truncated baseline tensors*"
    elif damage == "corrupt-json":
        meta.write_text("{ not json")
        expect = f"*{meta}: corrupt baseline metadata*"
    elif damage == "schema":  # an older one (a newer one is refused: test_damaged_baselines.py)
        m = json.loads(meta.read_text())
        m["schema_version"] = 0
        meta.write_text(json.dumps(m))
        expect = f"*{meta}: baseline schema version 0, this pytest-precision reads version 1*"
    else:
        np.savez(npz, reference=np.array([object()], dtype=object))
        expect = f"*{npz}: reference holds Python objects (a pickle): never loaded*"
    before = (npz.read_bytes(), meta.read_bytes())
    result = _run(pytester, "--precision-configs=fp16", "-k", "unit")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([expect, "*the file is left as it is; if this run is right, accept it with: pytest --precision-suite -k "
                                         "'softmax[[]mine-fp16-unit[]]' --precision-configs=fp16 --precision-update-baselines)"])
    assert (npz.read_bytes(), meta.read_bytes()) == before
    _run(pytester, "--precision-update-baselines", "--precision-configs=fp16", "-k", "unit").assert_outcomes(passed=1)
    _run(pytester, "--precision-configs=fp16", "-k", "unit").assert_outcomes(passed=1)


def test_changed_inputs_are_not_called_a_regression(pytester):
    """Other bits from the same seed and spec (another machine's draw) are judged on the error
    statistics, said so; another spec (a generator changed) is refused as no regression."""
    _setup(pytester, CORRECT)
    _run(pytester, "--precision-update-baselines", "--precision-configs=fp32", "-k", "unit").assert_outcomes(passed=1)
    meta = pytester.path / "precision_baselines" / "softmax" / "mine" / "unit" / "fp32.json"
    m = json.loads(meta.read_text())
    m["input_checksum"] = "0" * 64
    meta.write_text(json.dumps(m))
    result = _run(pytester, "--precision-configs=fp32", "-k", "unit")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["1 case(s) drew inputs whose bits differ from those their goldens were accepted on*"])
    m["input_spec"]["seed"] += 1
    meta.write_text(json.dumps(m))
    result = _run(pytester, "--precision-configs=fp32", "-k", "unit")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*the inputs changed since the golden was accepted*not a precision regression*"])


def test_update_prints_old_and_new_budgets(pytester):
    accurate = """
@pytest_precision.register("mine", kind="softmax")
def mine(x):
    return torch.softmax(x.double(), -1).to(x.dtype)
"""
    _setup(pytester, accurate)
    first = _run(pytester, "--precision-update-baselines", "--precision-configs=fp32", "-k", "scale20 and not scale200")
    first.stdout.fnmatch_lines(["*precision baselines written: 1*", "softmax/mine/scale20 [[]fp32[]] on cpu-* new: max ULP *"])
    _setup(pytester, accurate.replace("x.double()", "x"))
    second = _run(pytester, "--precision-update-baselines", "--precision-configs=fp32", "-k", "scale20 and not scale200")
    second.stdout.fnmatch_lines(["softmax/mine/scale20 [[]fp32[]] on cpu-* changed: max_ulp * -> *"])


def test_builtin_targets_and_config_selection(pytester):
    pytester.makeini("[pytest]\n")
    result = _run(pytester, "--precision-configs=fp32,tf32", "--collect-only", "-q")
    out = result.stdout.str()
    assert "precision-suite::softmax[torch.softmax-fp32-unit]" in out
    assert "precision-suite::log_softmax[torch.log_softmax-tf32-len32768]" in out
    assert "fp16" not in out
    ran = _run(pytester, "--precision-configs=tf32", "-rs", "-k", f"unit and {NOT_KERNELS}")
    reason = CONFIGS["tf32"].skip_reason(DEVICE)
    if reason:  # the CPU (or a GPU before compute capability 8.0): skipped, with the reason
        ran.assert_outcomes(skipped=2)
        ran.stdout.fnmatch_lines([f"*{reason}*"])
    else:  # run (and failed for want of goldens, which this test does not write)
        assert "skipped" not in ran.parseoutcomes()


def test_unknown_config_and_device_are_usage_errors(pytester):
    pytester.makeini("[pytest]\n")
    r = _run(pytester, "--precision-configs=fp16,fp64")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*--precision-configs: unknown config id(s) fp64; known: fp32, tf32, fp16*"])
    r = _run(pytester, "--precision-device=cuda", "--collect-only", "-q")
    if DEVICE == "cpu":
        assert r.ret == pytest.ExitCode.USAGE_ERROR
        r.stderr.fnmatch_lines(["*--precision-device=cuda: torch.cuda.is_available() is False*"])
    else:
        assert r.ret == pytest.ExitCode.OK


def test_target_that_raises_is_named(pytester):
    _setup(pytester, """
@pytest_precision.register("broken", kind="softmax")
def broken(x):
    if x.dtype == torch.float16:
        raise RuntimeError("no fp16 kernel")
    return torch.softmax(x, -1)
""")
    result = _run(pytester, "--precision-configs=fp16", "-k", "unit")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*target 'broken' (softmax) under config fp16 on regime unit raised RuntimeError: no fp16 kernel*"])


def test_wrong_shape_is_named(pytester):
    _setup(pytester, """
@pytest_precision.register("flat", kind="softmax")
def flat(x):
    return torch.softmax(x, -1).flatten()
""")
    result = _run(pytester, "--precision-configs=fp32", "-k", "unit")
    result.stdout.fnmatch_lines(["*target 'flat' (softmax) under config fp32 on regime unit: shape mismatch, output (4096,), "
                                 "expected (16, 256)*"])


def test_ini_targets(pytester):
    pytester.makepyfile(mykernels="""
import torch
def softmax(x):
    return torch.softmax(x, -1)
""")
    pytester.syspathinsert()
    pytester.makeini("[pytest]\nprecision_targets =\n    mykernels:softmax softmax\n")
    result = _run(pytester, "--precision-configs=fp32", "--collect-only", "-q")
    assert "softmax[mykernels:softmax-fp32-unit]" in result.stdout.str()
    pytester.makeini("[pytest]\nprecision_targets =\n    mykernels:nothing softmax\n")
    bad = _run(pytester, "--precision-configs=fp32")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*precision_targets: cannot import 'mykernels:nothing'*"])


def test_baseline_dir_ini(pytester):
    _setup(pytester, CORRECT, ini="precision_baseline_dir = goldens/here")
    _run(pytester, "--precision-update-baselines", "--precision-configs=fp32", "-k", "unit").assert_outcomes(passed=1)
    assert (pytester.path / "goldens" / "here" / "softmax" / "mine" / "unit" / "fp32.npz").exists()


def test_hypothesis_regime_finds_and_shrinks_a_counterexample(pytester, monkeypatch):
    """Without max subtraction fp16 exp overflows (logits past 11.09) or underflows to 0 / 0 (large
    negative rows): either way the shrunk input is one short row, printed, with the faulting op."""
    import re
    # derandomised as under CI in any environment: with a random seed the shrinker sometimes stops
    # at three rows of one logit (seen once on the README's test command without CI)
    monkeypatch.setenv("CI", "true")
    _setup(pytester, NO_MAX_SUBTRACTION)
    result = _run(pytester, "--precision-configs=fp16", "-k", "hypothesis")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*softmax[[]naive-fp16-hypothesis[]]: FAIL *Hypothesis found a failing input of shape*",
        "  first * in aten::* at conftest.py:* under fp16: produced * from * inputs*",
        "  Hypothesis found (after shrinking) logits of shape (*), torch.float16:",
        "    [[][[]*[]][]]",
        "  no golden baseline: drawn inputs have no golden*",
    ])
    out = result.stdout.str()
    rows, cols = map(int, re.search(r"logits of shape \((\d+), (\d+)\)", out).groups())
    # short rows, readable (which minimal example the shrinker reaches follows the derandomised
    # seed, a digest of the attack's code: one row of one logit, or two)
    assert rows <= 2 and cols <= 3 and rows * cols <= 4, out
    assert "--precision-update-baselines" not in out  # nothing to accept for drawn inputs


def test_hypothesis_regime_passes_a_correct_softmax(pytester):
    _setup(pytester, CORRECT)
    _run(pytester, "--precision-configs=fp16,bf16,fp8-e4m3", "-k", "hypothesis").assert_outcomes(passed=3)


def _rekey_budgets(meta_path, rename: dict, extra: dict | None = None):
    m = json.loads(meta_path.read_text())
    m["budgets"] = {rename.get(k, k): v for k, v in m["budgets"].items()}
    m["budgets"].update(extra or {})
    meta_path.write_text(json.dumps(m))
    return m


def test_budgets_are_keyed_by_the_cpu_vector_isa(pytester):
    import torch
    _setup(pytester, CORRECT)
    result = _run(pytester, "--precision-update-baselines", "--precision-configs=fp32", "-k", "unit")
    result.assert_outcomes(passed=1)
    isa = torch.backends.cpu.get_cpu_capability().lower()
    result.stdout.fnmatch_lines([f"*precision summary (device cpu, budgets keyed cpu-{isa})*"])
    meta = json.loads((pytester.path / "precision_baselines" / "softmax" / "mine" / "unit" / "fp32.json").read_text())
    assert list(meta["budgets"]) == [f"cpu-{isa}"] and meta["written_on"] == f"cpu-{isa}"


def test_machine_without_a_budget_is_judged_by_the_widest_of_its_device_type(pytester):
    """A CI runner with another vector ISA than the one that accepted the golden: the budgets of
    the other CPU machines judge it (the loosest limit of each), and the output says so."""
    import torch
    isa = f"cpu-{torch.backends.cpu.get_cpu_capability().lower()}"
    accurate = """
@pytest_precision.register("mine", kind="softmax")
def mine(x):
    return torch.softmax(x.double(), -1).to(x.dtype)
"""
    _setup(pytester, accurate)
    _run(pytester, "--precision-update-baselines", "--precision-configs=fp32", "-k", "scale20 and not scale200").assert_outcomes(passed=1)
    meta_path = pytester.path / "precision_baselines" / "softmax" / "mine" / "scale20" / "fp32.json"
    tight = _rekey_budgets(meta_path, {isa: "cpu-tight"})["budgets"]["cpu-tight"]

    # torch's fp32 softmax (tens of ULP) against the tight budget of the accurate target: fails, and says whose
    _setup(pytester, accurate.replace("x.double()", "x"))
    failed = _run(pytester, "--precision-configs=fp32", "-k", "scale20 and not scale200")
    failed.assert_outcomes(failed=1)
    failed.stdout.fnmatch_lines([f"*(no budget recorded for {isa}: judged by the widest recorded for cpu-tight, scaled by the spread between machines "
                                 "(2 x the largest error, 1.47 x the typical); "
                                 "if this run is right, accept it with: pytest --precision-suite *--precision-update-baselines)",
                                 "*1 case(s) had no budget recorded for*judged by the widest recorded for other cpu machines*"])
    # a second machine that accepted a looser budget: the widest limit applies and the case passes
    loose = json.loads(json.dumps(tight))
    loose["outputs"]["reference"]["budget"].update(max_ulp=1000.0, mean_ulp=100.0)
    _rekey_budgets(meta_path, {}, {"cpu-loose": loose, "cuda-sm90": tight})
    passed = _run(pytester, "--precision-configs=fp32", "-k", "scale20 and not scale200")
    passed.assert_outcomes(passed=1)
    passed.stdout.fnmatch_lines(["*1 case(s) had no budget recorded for*"])


def test_a_first_run_on_another_device_type_borrows_from_any_machine_unless_strict(pytester):
    """Goldens recorded only on another device type (CPU goldens on a first GPU run, here the
    reverse): the widest budget of any machine judges, scaled by this machine's peer error, and
    both the case and the summary say so; --precision-strict-budgets fails the case instead."""
    import torch
    isa = f"cpu-{torch.backends.cpu.get_cpu_capability().lower()}"
    _setup(pytester, CORRECT)
    _run(pytester, "--precision-update-baselines", "--precision-configs=fp32", "-k", "unit").assert_outcomes(passed=1)
    _rekey_budgets(pytester.path / "precision_baselines" / "softmax" / "mine" / "unit" / "fp32.json", {isa: "cuda-sm90"})
    borrowed = _run(pytester, "--precision-configs=fp32", "-k", "unit")
    borrowed.assert_outcomes(passed=1)
    borrowed.stdout.fnmatch_lines(["*1 case(s) had no budget recorded for*judged by the widest recorded for other machines "
                                   "(1 of them by machines of another device type, no cpu machine having one)*"])
    # a planted regression is still caught by the borrowed budget
    _setup(pytester, CORRECT.replace("(e / e.sum(-1, keepdim=True))", "(e / e.sum(-1, keepdim=True) * (1 + 2 ** -21))"))
    caught = _run(pytester, "--precision-configs=fp32", "-k", "unit")
    caught.assert_outcomes(failed=1)
    caught.stdout.fnmatch_lines(["*FAIL*regression*", "*no budget recorded for cpu-*: judged by the widest recorded for "
                                 "cuda-sm90 (no cpu machine has one: a first run on this device type)*"])
    _setup(pytester, CORRECT)
    strict = _run(pytester, "--precision-configs=fp32", "-k", "unit", "--precision-strict-budgets")
    strict.assert_outcomes(failed=1)
    strict.stdout.fnmatch_lines([f"*fp32.json: no accepted budget for '{isa}' (strict budgets: none borrowed) "
                                 "(has: cuda-sm90); if this run is right, accept it with: pytest --precision-suite*"])


