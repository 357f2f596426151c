"""The callable's contract beyond its values (kinds.tensor.contract, kinds.tensor.contract_checks, kinds.tensor.batch), in
real sessions (pytester): for each check a correct target passes and a planted pattern fails with
its category and the sentence a user reads. Sessions run fp32 on one or two regimes; most accept
goldens as they go (--precision-update-baselines), which judges everything but a stored golden."""
import json

import pytest
import torch

import pytest_precision
from pytest_precision.kinds import registry
from pytest_precision.numerics.budgets import REGRESSION_SLACK, ULP_FLOOR

from sample_targets import SOFTMAX_FN

pytest_plugins = ["pytester"]

HEADER = """
import math
import torch
import pytest_precision

""" + SOFTMAX_FN

UNIT = 'unit = {"unit": lambda g: torch.randn(16, 64, generator=g)}\n'


def _row(result, target: str, config: str = "fp32") -> dict[str, str]:
    """The summary table's row of ``target`` under ``config``, by column header."""
    header = None
    for line in result.stdout.lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| target "):
            header = cells
        elif header and line.startswith("| ") and cells[:2] == [target, config]:
            return dict(zip(header, cells))
    raise AssertionError(f"no table row of {target} under {config}")


def _session(pytester, body, *args, accept=True):
    """One session of the targets in ``body`` (a conftest after HEADER), fp32 unless ``args`` say."""
    pytester.makeconftest(HEADER + body)
    pytester.makeini("[pytest]\n")
    configs = () if any(a.startswith("--precision-configs") for a in args) else ("--precision-configs=fp32",)
    accepting = ("--precision-update-baselines",) if accept else ()
    return pytester.runpytest("--precision-suite", "--precision-no-speed", "-p", "no:cacheprovider", *configs,
                              *accepting, *args)


# ---- inputs left alone -----------------------------------------------------------------------------

MUTATES = """
@pytest_precision.register("shifts_x", kind="softmax")
def shifts_x(x):
    x.sub_(x.amax(-1, keepdim=True))  # the max subtracted in place: the caller's logits are moved
    return softmax(x)


@pytest_precision.register("shifts_x_declared", kind="softmax", mutates=("x",))
def shifts_x_declared(x):
    x.sub_(x.amax(-1, keepdim=True))
    out = softmax(x)
    x.zero_()  # a copy handed again (to the peer, the second call) would give a uniform softmax
    return out
"""


def test_an_input_changed_in_place_fails_unless_declared_and_the_copy_is_never_reused(pytester):
    result = _session(pytester, MUTATES, "-k", "softmax and unit")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*softmax[[]shifts_x-fp32-unit[]]: FAIL contract (shifts_x: its forward changed input x in place (4096 of "
        "4096 elements, largest change *); declare mutates=('x',) if it does so by design)",
    ])
    # the declared one passes its oracle and its second call: neither saw the copy it zeroed
    row = _row(result, "shifts_x_declared")
    assert (row["2nd call differs"], row["verdict"]) == ("0", "pass")


BACKWARD_WRITES = UNIT + """
class Tanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, in_place):
        y = torch.tanh(x)
        ctx.save_for_backward(x, y)
        ctx.in_place = in_place
        return y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        if ctx.in_place:  # the gradient written over the saved input to spare an allocation
            return x.copy_(g * (1 - y * y)), None
        return g * (1 - y * y), None


pytest_precision.register("tanh_grad_in_x", lambda x: Tanh.apply(x, True), kind="op", inputs=unit,
                          reference=torch.tanh)
pytest_precision.register("tanh", lambda x: Tanh.apply(x, False), kind="op", inputs=unit, reference=torch.tanh)
"""


def test_an_input_changed_in_place_by_the_backward_fails(pytester):
    result = _session(pytester, BACKWARD_WRITES, "-k", "unit")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*op[[]tanh_grad_in_x-fp32-unit[]]: FAIL contract (tanh_grad_in_x: its backward changed input arg0 in place "
        "(* of 1024 elements, largest change *); declare mutates=('arg0',) if it does so by design)",
    ])


MASK_AND_LABELS = """
def eager(q, k, v, causal=False, key_padding_mask=None):
    h = q.shape[1]
    k, v = k.repeat_interleave(h // k.shape[1], 1).float(), v.repeat_interleave(h // v.shape[1], 1).float()
    s = q.float() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    if key_padding_mask is not None:
        s = s.masked_fill(key_padding_mask[:, None, None, :], -math.inf)
    return (torch.softmax(s, -1) @ v).to(q.dtype)


pytest_precision.register("attn", eager, kind="attention", fully_masked="nan")


@pytest_precision.register("attn_flips_mask", kind="attention", fully_masked="nan")
def attn_flips_mask(q, k, v, causal=False, key_padding_mask=None):
    if key_padding_mask is not None:  # turned in place into the keep-mask a kernel reads
        key_padding_mask = key_padding_mask.logical_not_().logical_not()
    return eager(q, k, v, causal, key_padding_mask)


def nll(logits, target, valid, ignore_index):
    logp = torch.log_softmax(logits.float(), -1)
    return (-logp.gather(-1, target[:, None]).squeeze(-1) * valid).sum() / valid.sum()


@pytest_precision.register("ce", kind="cross_entropy")
def ce(logits, target, ignore_index=-100):
    valid = target != ignore_index
    return nll(logits, torch.where(valid, target, 0), valid, ignore_index).to(logits.dtype)


@pytest_precision.register("ce_clamps_labels", kind="cross_entropy")
def ce_clamps_labels(logits, target, ignore_index=-100):
    valid = target != ignore_index
    target[~valid] = 0  # ignored rows clamped in place to gather: the caller's labels lose their -100
    return nll(logits, target, valid, ignore_index).to(logits.dtype)
"""


def test_a_mask_or_labels_changed_in_place_fail_and_are_put_back(pytester):
    result = _session(pytester, MASK_AND_LABELS, "-k", "padded-mha or (cross_entropy and ignored and not all)")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines([
        "*attention[[]attn_flips_mask-fp32-padded-mha[]]: FAIL contract (attn_flips_mask: its forward changed input "
        "key_padding_mask in place (32 of 32 elements); declare mutates=('key_padding_mask',) if it does so by "
        "design)",
    ])
    # the labels its graph saved are put back after its backward, not before: no autograd error
    result.stdout.fnmatch_lines([
        "*cross_entropy[[]ce_clamps_labels-fp32-ignored[]]: FAIL contract (ce_clamps_labels: its forward changed "
        "input target in place (* of 16 elements); declare mutates=('target',) if it does so by design)",
    ])
    # put back after every call: its oracle passed, and its second call and batch probes saw the mask as it was
    row = _row(result, "attn_flips_mask")
    assert (row["2nd call differs"], row["batch differs"], row["verdict"]) == ("0", "0", "FAIL 1/1: contract")


# ---- a fresh, plain output -------------------------------------------------------------------------

ALIASES = UNIT + """
pytest_precision.register("identity", lambda x: x, kind="op", inputs=unit, reference=lambda x: x.clone())
pytest_precision.register("transpose", lambda x: x.t(), kind="op", inputs=unit)
pytest_precision.register("transpose_declared", lambda x: x.t(), kind="op", inputs=unit, aliases=("arg0",))
# a fresh row expanded without a copy (stride 0): no input's memory
pytest_precision.register("row_mean", lambda x: x.mean(-1, keepdim=True).expand_as(x), kind="op", inputs=unit)
"""


def test_an_output_sharing_an_inputs_memory_fails_unless_declared(pytester):
    result = _session(pytester, ALIASES, "-k", "unit")
    result.assert_outcomes(passed=2, failed=2)
    for name in ("identity", "transpose"):
        result.stdout.fnmatch_lines([
            f"*op[[]{name}-fp32-unit[]]: FAIL contract ({name}: its output shares memory with input arg0 (the input "
            "itself, a view or an alias); return a fresh tensor, or declare aliases=('arg0',))",
        ])
    assert _row(result, "row_mean")["verdict"] == _row(result, "transpose_declared")["verdict"] == "pass"


SUBCLASS = """
class Lazy(torch.Tensor):
    pass


pytest_precision.register("plain", softmax, kind="softmax")
pytest_precision.register("wrapped", lambda x: softmax(x).as_subclass(Lazy), kind="softmax")
"""


def test_a_tensor_subclass_output_is_refused_saying_what_was_returned(pytester):
    result = _session(pytester, SUBCLASS, "-k", "unit")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*softmax[[]wrapped-fp32-unit[]]: target 'wrapped' (softmax) under config fp32 on regime unit returned a "
        "conftest.Lazy, a tensor subclass; the contract is a plain torch.Tensor*",
    ])


# ---- a second call ---------------------------------------------------------------------------------

RACY = """
import os
_calls = [int(os.environ.get("RACY_FIRST_CALL", "0"))]


def racy(x):
    # a racy sum's stand-in (atomics add in another order on every launch): every other call adds the row
    # from its end; the row's max is subtracted in float64 so that both orders pass the oracle
    _calls[0] += 1
    e = (x.double() - x.double().amax(-1, keepdim=True)).exp()
    if _calls[0] % 2:
        return (e / e.sum(-1, keepdim=True)).to(x.dtype)
    e = e.float()
    s = torch.zeros_like(e[..., :1])
    for j in reversed(range(e.shape[-1])):
        s = s + e[..., j:j + 1]
    return (e / s).to(x.dtype)


pytest_precision.register("racy", racy, kind="softmax")
pytest_precision.register("racy_declared", racy, kind="softmax", deterministic=True)
pytest_precision.register("steady", softmax, kind="softmax", deterministic=True)


@pytest_precision.register("dithered", kind="softmax", deterministic=True)
def dithered(x):
    # one ULP up at random (stochastic rounding's stand-in): the second call replays the random state the first had
    return softmax(x) * (1 + 2.0 ** -23 * torch.randint(0, 2, x.shape))
"""


def test_a_nondeterministic_target_is_noted_and_fails_where_it_declared_deterministic(pytester):
    result = _session(pytester, RACY, "-k", "unit")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines([
        "*softmax[[]racy_declared-fp32-unit[]]: FAIL nondeterministic (racy_declared: a second call on fresh copies "
        "of the same inputs gave other bits: output: * of 4096 elements differ, max * ULP)",
    ])
    assert int(_row(result, "racy")["2nd call differs"]) > 0 and _row(result, "racy")["verdict"] == "pass"
    for name in ("steady", "dithered"):
        assert (_row(result, name)["2nd call differs"], _row(result, name)["verdict"]) == ("0", "pass")
    result.stdout.fnmatch_lines([
        "racy: gave other bits on a second call on fresh copies of the same inputs (reported, not judged: declare "
        "deterministic=True to require the same bits)",
    ])


def test_the_regression_budget_is_never_below_the_second_calls_spread(pytester, monkeypatch):
    result = _session(pytester, RACY, "-k", "racy and not declared and unit", "--precision-report=report.json")
    result.assert_outcomes(passed=1)
    case = json.loads((pytester.path / "report.json").read_text())["cases"][0]
    spread = case["contract"]["rerun_max_ulp"]
    golden = json.loads((pytester.path / "precision_baselines/softmax/racy/unit/fp32.json").read_text())
    (entry,) = golden["budgets"].values()
    budget, accepted = entry["outputs"]["reference"]["budget"], entry["outputs"]["reference"]["accepted"]
    # the first call summed in float64 (0 ULP from the stored float32 oracle), the second in float32
    # from the row's end (8 ULP here): the budget is the spread plus its floor, not 1.5 x 0 plus it
    assert spread > REGRESSION_SLACK * accepted["max_ulp"]
    assert budget["max_ulp"] == spread + ULP_FLOOR
    assert case["contract"]["rerun_differing"] > 0
    # judged by that golden, a run whose first call takes the float32 order (8 ULP, over 1.5 x 0 + 2) passes
    monkeypatch.setenv("RACY_FIRST_CALL", "1")
    _session(pytester, RACY, "-k", "racy and not declared and unit", accept=False).assert_outcomes(passed=1)


KEPT = """
_kept = {}


@pytest_precision.register("kept_output", kind="softmax")
def kept_output(x):
    # its output kept and handed back on the next call with these inputs' shape
    key = (x.shape, x.dtype)
    if key not in _kept:
        _kept[key] = softmax(x)
    return _kept[key]


pytest_precision.register("fresh_output", softmax, kind="softmax")
"""


def test_an_output_kept_across_calls_fails(pytester):
    result = _session(pytester, KEPT, "-k", "unit")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*softmax[[]kept_output-fp32-unit[]]: FAIL contract (kept_output: its second call returned the memory of its "
        "first call's output, which the caller still held (an output cached by shape or pointer, a buffer kept "
        "across calls): return a fresh tensor from every call)",
    ])


# ---- batch invariance ------------------------------------------------------------------------------

BATCH = UNIT + """
def batch_max(x):
    # the max subtracted is the whole batch's, not the row's: the same softmax, other roundings per batch
    xf = x.float()
    e = (xf - xf.amax()).exp()
    return (e / e.sum(-1, keepdim=True)).to(x.dtype)


pytest_precision.register("batch_max", batch_max, kind="softmax")
pytest_precision.register("batch_max_declared", batch_max, kind="softmax", batch_invariant=True)
pytest_precision.register("row_max_declared", softmax, kind="softmax", batch_invariant=True)


def l1_rows(x):
    # more than 8 rows take another reduction order (a split chosen by batch size)
    s = x.abs().sum(-1, keepdim=True) if x.shape[0] <= 8 else x.abs().flip(-1).cumsum(-1)[..., -1:]
    return x / s


exact = lambda x: x / x.abs().sum(-1, keepdim=True)
pytest_precision.register("l1", l1_rows, kind="op", inputs=unit, reference=exact, batch_dim=0)
pytest_precision.register("l1_declared", l1_rows, kind="op", inputs=unit, reference=exact,
                          batch_dim={"arg0": 0, "out": 0}, batch_invariant=True)
pytest_precision.register("l1_one_order", exact, kind="op", inputs=unit, batch_dim=-2, batch_invariant=True)
"""


def test_rows_that_depend_on_the_batch_are_reported_and_fail_where_declared_invariant(pytester):
    result = _session(pytester, BATCH, "-k", "unit", "--precision-report=report.json")
    result.assert_outcomes(passed=4, failed=2)
    result.stdout.fnmatch_lines([
        "*softmax[[]batch_max_declared-fp32-unit[]]: FAIL batch_variant (batch_max_declared: declared "
        "batch_invariant=True, and its rows depend on the batch around them: row 0 alone: * of 256 elements differ*)",
    ])
    # the op kind's declared batch dimension, as an int and as a dict: the first half of 16 rows takes the other order
    result.stdout.fnmatch_lines([
        "*op[[]l1_declared-fp32-unit[]]: FAIL batch_variant (l1_declared: declared batch_invariant=True, and its rows "
        "depend on the batch around them: rows 0-7 of 16 alone: * of 512 elements differ*)",
    ])
    for name in ("batch_max", "l1"):
        assert int(_row(result, name)["batch differs"]) > 0 and _row(result, name)["verdict"] == "pass"
    for name in ("row_max_declared", "l1_one_order"):
        assert (_row(result, name)["batch differs"], _row(result, name)["verdict"]) == ("0", "pass")
    result.stdout.fnmatch_lines([
        "batch_max, l1: gave rows whose bits depend on the batch around them (reported, not judged: declare "
        "batch_invariant=True to require the same bits)",
    ])
    cases = {c["target"]: c for c in json.loads((pytester.path / "report.json").read_text())["cases"]}
    assert cases["l1"]["contract"]["batch_differing"] > 0 and cases["l1_one_order"]["contract"]["batch_differing"] == 0
    assert cases["batch_max"]["contract"]["rerun_differing"] == 0


NAN_SIGNS = """
@pytest_precision.register("nan_by_path", kind="softmax", batch_invariant=True, deterministic=True)
def nan_by_path(x):
    # fully masked rows: 0 / 0 (x86's negative NaN) in the regime's batch of 16, float("nan") (a positive
    # one) in any other, as a kernel's path for another batch size may write them
    out = softmax(x)
    return torch.where(torch.isnan(out), float("nan"), out) if x.shape[0] != 16 else out
"""


def test_nan_where_nan_is_expected_is_the_same_result_whatever_its_sign(pytester):
    result = _session(pytester, NAN_SIGNS, "-k", "fully-masked")
    result.assert_outcomes(passed=1)
    row = _row(result, "nan_by_path")
    assert (row["NaN"], row["2nd call differs"], row["batch differs"], row["verdict"]) == ("0", "0", "0", "pass")


@pytest.fixture
def forget():
    yield
    registry.clear()


@pytest.mark.parametrize("batch_dim", ["0", True, 1.0, {"arg0": 0}, {0: 0, "out": 0}, {"arg0": "0", "out": 0}])
def test_a_malformed_batch_dim_is_refused_at_registration_naming_the_target(forget, batch_dim):
    with pytest.raises(ValueError, match=r"target 'bad' \(op\): batch_dim=.*: expected an int or \{input name: dim"):
        pytest_precision.register("bad", torch.tanh, kind="op", inputs={"unit": lambda g: torch.zeros(4, 2)},
                                  batch_dim=batch_dim)


BAD_BATCH_DIM = UNIT + """
pytest_precision.register("dim_5", torch.tanh, kind="op", inputs=unit, batch_dim=5)
pytest_precision.register("dim_of_y", torch.tanh, kind="op", inputs=unit, batch_dim={"y": 0, "out": 0})
"""


def test_a_batch_dim_the_inputs_do_not_have_fails_every_config_naming_the_target(pytester):
    result = _session(pytester, BAD_BATCH_DIM, "--precision-configs=fp32,bf16")
    result.assert_outcomes(failed=2 * 2 * 2)  # 2 targets x 2 configs x (unit, fresh)
    for config in ("fp32", "bf16"):
        result.stdout.fnmatch_lines([
            f"*op[[]dim_5-{config}-unit[]]: target 'dim_5' (op), inputs regime 'unit': batch_dim 5 is no dimension of "
            "input arg0 of shape (16, 64)",
            f"*op[[]dim_of_y-{config}-unit[]]: target 'dim_of_y' (op), inputs regime 'unit': batch_dim names 'y'; the "
            "inputs are arg0",
        ])


# ---- declarations ----------------------------------------------------------------------------------

UNKNOWN_NAMES = """
pytest_precision.register("mutates_y", softmax, kind="softmax", mutates=("y",))
pytest_precision.register("aliases_input", softmax, kind="softmax", aliases="input")
"""


def test_unknown_names_in_mutates_or_aliases_are_an_error_listing_the_inputs(pytester):
    result = _session(pytester, UNKNOWN_NAMES, "-k", "unit")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([
        "*softmax[[]mutates_y-fp32-unit[]]: target 'mutates_y': mutates names 'y'; the inputs it is handed are x",
        "*softmax[[]aliases_input-fp32-unit[]]: target 'aliases_input': aliases names 'input'; the inputs it is "
        "handed are x",
    ])


def test_mutates_and_aliases_take_input_names_at_registration(forget):
    with pytest.raises(TypeError, match=r"target 'bad': mutates=3: expected input names, such as \('x',\)"):
        pytest_precision.register("bad", torch.softmax, kind="softmax", mutates=3)
    with pytest.raises(ValueError, match=r"target 'bad': deterministic='sometimes': expected True or False"):
        pytest_precision.register("bad", torch.softmax, kind="softmax", deterministic="sometimes")


# ---- degenerate regimes ----------------------------------------------------------------------------

NOTHING = """
pytest_precision.register("zeros", lambda x: torch.zeros_like(x), kind="softmax")
pytest_precision.register("uniform", lambda x: torch.full_like(x, 1.0 / x.shape[-1]), kind="softmax")
pytest_precision.register("log_zeros", lambda x: torch.zeros_like(x), kind="log_softmax")
pytest_precision.register("log_uniform", lambda x: torch.full_like(x, -math.log(x.shape[-1])), kind="log_softmax")
"""


def test_an_all_zeros_or_constant_output_passes_no_case(pytester):
    # every regime of softmax and log_softmax (11 seeded and the fresh one) in the three formats, and
    # the drawn one in fp32 (its search shrinks each failure: 18 of the 27 s all three took)
    result = _session(pytester, NOTHING, "--precision-configs=fp32,fp16,bf16", "-k", "not (hypothesis and (fp16 or bf16))")
    result.assert_outcomes(failed=4 * 12 * 3 + 4)


FLUSHED = """
pytest_precision.register("square", lambda x: x * x, kind="op", forward_only=True,
                          inputs={"unit": lambda g: torch.randn(16, 64, generator=g),
                                  # squares near 1e-10: below float16's smallest subnormal (6e-8), all 0 there
                                  "tiny": lambda g: 1e-5 * torch.randn(16, 64, generator=g)})
"""


def test_a_regime_whose_outputs_flush_to_zero_is_refused_as_degenerate(pytester):
    result = _session(pytester, FLUSHED, "--precision-configs=fp32,fp16", "-k", "unit or tiny")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines([
        "*op[[]square-fp16-tiny[]]: FAIL degenerate (regime tiny under fp16: the regime cannot tell a result from "
        "nothing: an all-zeros output would pass within budget; it judges nothing (its exact result's spread is "
        "within the budget's floor): the harness refuses it)",
    ])


def test_changed_bits_counts_values_and_not_nan_payloads():
    from pytest_precision.kinds.tensor.contract import changed_bits

    nan = torch.tensor([float("nan")])
    negative_nan = torch.zeros(1) / torch.zeros(1)
    assert nan.view(torch.int32) != negative_nan.view(torch.int32)  # two NaNs, other bits
    assert not changed_bits(nan, negative_nan).any()
    assert changed_bits(torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])).tolist() == [True, False]
    assert changed_bits(nan, torch.ones(1)).all()
