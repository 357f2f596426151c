"""What a target does by design is a declaration, never ``accuracy`` (kinds.declarations,
reporting.declarations): each declaration real code needs, with a correct target that passes and a
planted defect that stays red; the categories a run names them in; the block that gathers them."""
import torch

from machine import ON_CPU

from pytest_precision.kinds.declarations import Declaration
from pytest_precision.reporting.declarations import declaration_lines, gather

pytest_plugins = ["pytester"]


def _run(pytester, *args):
    return pytester.runpytest("--precision-suite", "--precision-no-speed", "-p", "no:cacheprovider", *ON_CPU, *args)


def _block(result) -> list[str]:
    lines = result.outlines
    start = next((i for i, line in enumerate(lines) if "declarations this run found" in line), None)
    return [] if start is None else lines[start + 1:start + 8]


# ---- op: out_dtype, references that return more precision, references that overflow --------------

LOSS = """
import torch
import torch.nn.functional as F
import pytest_precision


def inputs(g):
    return {"logits": 3 * torch.randn(16, 100, generator=g), "target": torch.randint(0, 100, (16,), generator=g)}


def capped_loss(logits, target):  # a small-LLM repository's loss: soft-capped logits, float32 from 16-bit ones
    return F.cross_entropy(CAP, target)


pytest_precision.register("capped_loss", capped_loss, kind="op", inputs={"unit": inputs}{DECLARE})
"""
CAREFUL = "15 * torch.tanh(logits.float() / 15)"
CAPPED_IN_16_BITS = "(15 * torch.tanh(logits / 15)).float()"  # the defect: the cap in the logits' dtype


def test_a_float32_loss_from_16_bit_inputs_declares_its_output_dtype(pytester):
    pytester.makeconftest(LOSS.replace("CAP", CAREFUL).replace("{DECLARE}", ""))
    first = _run(pytester, "--precision-configs=fp32,bf16", "-k", "unit")
    first.assert_outcomes(failed=2)
    first.stdout.fnmatch_lines(["precision-suite::op[[]capped_loss-fp32-unit[]]: FAIL contract (it returns a float32 result "
                                "(from float64 inputs too): if it does so by design, declare out_dtype=torch.float32)"])
    assert '    pytest_precision.register("capped_loss", ..., out_dtype=torch.float32)' in _block(first)
    pytester.makeconftest(LOSS.replace("CAP", CAREFUL).replace("{DECLARE}", ", out_dtype=torch.float32"))
    _run(pytester, "--precision-update-baselines").assert_outcomes(passed=12, skipped=2)  # every CPU config, fresh
    # judged in float32: the cap computed in the logits' dtype is caught with no golden
    pytester.makeconftest(LOSS.replace("CAP", CAPPED_IN_16_BITS).replace("{DECLARE}", ", out_dtype=torch.float32"))
    planted = _run(pytester, "--precision-configs=fp16,bf16", "-k", "unit")
    planted.assert_outcomes(failed=2)
    planted.stdout.fnmatch_lines(["precision-suite::op[[]capped_loss-bf16-unit[]]: FAIL accuracy,regression (oracle: out: "
                                  "max abs * > budget *"])


ROPE = """
import torch
import pytest_precision


def rope(x):  # rotates its input in place, as fused rotary kernels do, and returns a copy
    n = x.shape[-1] // 2
    a, b = x[..., :n].clone(), x[..., n:].clone()
    angle = torch.arange(n, dtype=torch.float32) * 0.3
    c, s = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x[..., :n] = a * c - b * s
    x[..., n:] = a * s + b * c
    return x.clone()


def reference(x):  # computes in float64 whatever it is given, as a user's reference does
    xd = x.double()
    n = x.shape[-1] // 2
    angle = torch.arange(n, dtype=torch.float64) * 0.3
    return torch.cat([xd[..., :n] * angle.cos() - xd[..., n:] * angle.sin(),
                      xd[..., :n] * angle.sin() + xd[..., n:] * angle.cos()], -1)


pytest_precision.register("rope", rope, kind="op", reference=reference, forward_only=True,
                          inputs={"unit": lambda g: torch.randn(4, 32, generator=g)}{DECLARE})
"""


def test_a_float64_reference_is_the_peer_rounded_and_an_in_place_write_is_declared(pytester):
    pytester.makeconftest(ROPE.replace("{DECLARE}", ""))
    first = _run(pytester, "--precision-configs=fp32,fp16,bf16")
    # the reference's float64 result is rounded to the config's dtype and used as the peer: no contract
    # error hides the in-place write, which every case names with its declaration
    first.assert_outcomes(failed=6)
    first.stdout.fnmatch_lines(["precision-suite::op[[]rope-fp16-unit[]]: FAIL contract,baseline (rope: its forward "
                                "changed input arg0 in place *; declare mutates=('arg0',) if it does so by design; *"])
    assert "output dtype torch.float64" not in first.stdout.str()
    assert '    pytest_precision.register("rope", ..., mutates=("arg0",))' in _block(first)
    pytester.makeconftest(ROPE.replace("{DECLARE}", ', mutates=("arg0",)'))
    _run(pytester, "--precision-configs=fp32,fp16,bf16", "--precision-update-baselines").assert_outcomes(passed=6)
    # the in-place rotation's classic slip: the first half read back after it was overwritten
    pytester.makeconftest(ROPE.replace("{DECLARE}", ', mutates=("arg0",)').replace(
        "a, b = x[..., :n].clone(), x[..., n:].clone()", "a, b = x[..., :n], x[..., n:]"))
    planted = _run(pytester, "--precision-configs=fp32,bf16", "-k", "unit")
    planted.assert_outcomes(failed=2)
    planted.stdout.fnmatch_lines(["precision-suite::op[[]rope-fp32-unit[]]: FAIL accuracy,regression (*"])


GEMMA_NORM = """
import torch
import pytest_precision


def norm(x, w):  # Gemma's RMSNorm: statistics in float32, x̂ (1 + w)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (y * (1.0 + w.float())).to(x.dtype)


def reference(x, w):  # written plainly: in fp16, x.pow(2) at 300 overflows
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)


pytest_precision.register("gemma_norm", norm, kind="op", reference=reference, inputs={
    "scale300": lambda g: (300 * torch.randn(8, 64, generator=g), 0.1 * torch.randn(64, generator=g))})
"""


def test_a_reference_that_overflows_in_the_config_is_no_peer(pytester):
    pytester.makeconftest(GEMMA_NORM)
    result = _run(pytester, "--precision-configs=fp16", "--precision-update-baselines", "-rA", "-k", "scale300")
    result.assert_outcomes(passed=1)  # not refused as degenerate: the exact result rounded judges it
    pytester.makeconftest(GEMMA_NORM.replace("xf = x.float()", "xf = x"))  # the defect: statistics in fp16
    planted = _run(pytester, "--precision-configs=fp16", "-k", "scale300")
    planted.assert_outcomes(failed=1)
    planted.stdout.fnmatch_lines(["precision-suite::op[[]gemma_norm-fp16-scale300[]]: FAIL *underflow*",
                                  "*note: out: the declared reference, run in fp16 as the peer, * lost to 0 of * "
                                  "elements where the exact result is finite; judged against the exact result rounded "
                                  "to torch.float16 instead*"])


# ---- norms: weight=False, eps= --------------------------------------------------------------------

WEIGHTLESS = """
import torch
import torch.nn.functional as F
import pytest_precision


def norm(x):  # a small-LLM repository's norm: no weight, eps the dtype's
    return F.rms_norm(x, (x.size(-1),), eps=torch.finfo(x.dtype).eps)


def in_dtype(x):  # the defect: the mean square in the input's dtype
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + torch.finfo(x.dtype).eps)


def torch_default(x):  # F.rms_norm's eps=None: float32's eps for 16-bit inputs too
    return F.rms_norm(x, (x.size(-1),))


pytest_precision.register("norm", norm, kind="rms_norm", weight=False, eps="finfo")
pytest_precision.register("in_dtype", in_dtype, kind="rms_norm", weight=False, eps="finfo")
pytest_precision.register("torch_default", torch_default, kind="rms_norm", weight=False, eps=torch.finfo(torch.float32).eps)
"""


def test_a_weightless_norm_with_a_dtype_dependent_eps(pytester):
    pytester.makeconftest(WEIGHTLESS)
    result = _run(pytester, "--precision-configs=fp32,fp16,bf16", "--precision-update-baselines", "-k", "not hypothesis")
    failed = {line.split("]: ")[0].split("[")[1] for line in result.outlines
              if line.startswith("precision-suite::") and "]: FAIL" in line}
    assert failed and all(case.startswith("in_dtype-f") or case.startswith("in_dtype-b") for case in failed), failed
    assert {"in_dtype-fp16-scale300", "in_dtype-fp16-unit"} <= failed
    for target in ("norm", "torch_default"):
        result.stdout.fnmatch_lines([f"| {target} *| fp16 *| *7 | *pass*", f"| {target} *| bf16 *| *7 | *pass*"])


def test_an_unknown_eps_declaration_is_refused():
    import pytest

    from pytest_precision.suites.norm import RMS_NORM

    with pytest.raises(ValueError, match="target 'n': eps='tiny': expected a number or 'finfo'"):
        RMS_NORM.declare("n", {"eps": "tiny"})


# ---- the block ---------------------------------------------------------------------------------------

def _record(target, config, regime, declare=None, declare_any=None, categories=("convention",), explained=True):
    record = {"target": target, "kind": "attention", "config": config, "regime": regime, "passed": False,
              "categories": list(categories), "nodeid": f"precision-suite::attention[{target}-{config}-{regime}]"}
    if declare:
        record.update(declare=[d.as_plain() for d in declare], explained=explained)
    if declare_any:
        record.update(declare_any=[d.as_plain() for d in declare_any], explained=False)
    return record


def test_the_block_takes_fp32s_convention_and_leaves_the_other_configs_unexplained():
    mean, nan = Declaration("fully_masked", "mean"), Declaration("fully_masked", "nan")
    records = [_record("t", "fp32", "causal-leftpad", [mean]), _record("t", "fp16", "causal-leftpad", [nan]),
               _record("t", "bf16", "causal-leftpad", [nan]),
               _record("t", "fp32", "hd59", declare_any=[Declaration("cross_lengths", False),
                                                         Declaration("head_dims", (16, 32))], categories=("crash",)),
               _record("t", "fp32", "long", [Declaration("cross_lengths", False)], categories=("unsupported",)),
               _record("t", "fp32", "unit", categories=("baseline",))]
    (block,) = gather(records)
    assert [d.python() for d in block.declarations] == ['cross_lengths=False', 'fully_masked="mean"']
    assert block.unexplained == ["attention[t-bf16-causal-leftpad]", "attention[t-fp16-causal-leftpad]"]
    assert [r["regime"] for r in block.explains["cross_lengths=False"]] == ["hd59", "long"]
    lines = declaration_lines(records, origins={"t": "ini precision_targets"})
    assert "    add to its ini precision_targets line: cross_lengths=false fully_masked=mean" in lines


def test_input_names_add_up_and_a_case_needing_more_than_the_block_is_not_explained():
    records = [_record("k", "fp32", "unit", [Declaration("mutates", ("logits",))], categories=("contract",)),
               _record("k", "fp16", "unit", [Declaration("mutates", ("grad",))], categories=("contract",)),
               _record("k", "bf16", "unit", [Declaration("mutates", ("logits",))], categories=("contract", "accuracy"),
                       explained=False)]
    (block,) = gather(records)
    assert [d.python() for d in block.declarations] == ['mutates=("logits", "grad")']
    assert block.unexplained == ["attention[k-bf16-unit]"]


def test_declarations_travel_as_plain_values():
    for d in (Declaration("out_dtype", torch.float32), Declaration("mutates", ("x", "y")), Declaration("causal", None),
              Declaration("head_dims", (16, 32)), Declaration("fully_masked", "mean")):
        assert Declaration.from_plain(d.as_plain()) == d
    assert Declaration("causal", "bottom-right").python() == 'causal="bottom-right"'
    assert Declaration("mutates", ("x",)).ini() == "mutates=x"


def test_an_in_place_write_is_not_hidden_behind_a_peer_that_raises(pytester):
    pytester.makeconftest("""
import torch
import pytest_precision


def scale(x):  # writes into its input, by design
    return x.mul_(2).clone()


def peer(x):
    raise ValueError("the peer's own bug")


pytest_precision.register("scale", scale, kind="op", peer=peer, forward_only=True, inputs={"unit": lambda g: torch.randn(4, 8, generator=g)})
""")
    result = _run(pytester, "--precision-configs=fp32", "-k", "unit")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*peer (peer peer) under config fp32 on regime unit raised ValueError: the peer's own "
                                 "bug; and scale: its forward changed input arg0 in place *; declare mutates=('arg0',) *"])
    assert '    pytest_precision.register("scale", ..., mutates=("arg0",))' in _block(result)


def test_a_target_that_raises_everywhere_is_offered_nothing(pytester):
    pytester.makeconftest("""
import pytest_precision


@pytest_precision.register("broken", kind="attention")
def broken(q, k, v, causal):
    raise NotImplementedError("not written yet")
""")
    result = _run(pytester, "--precision-configs=fp32", "-k", "math")
    assert result.parseoutcomes()["failed"] > 10
    assert _block(result) == []  # not "it lacks grouped-query heads": it lacks everything
    result.stdout.fnmatch_lines(["precision-suite::attention[[]broken-fp32+math-gqa[]]: FAIL unsupported (*"])


def test_a_declaration_that_would_skip_passing_cases_is_not_offered(pytester):
    pytester.makeconftest("""
import torch.nn.functional as F
import pytest_precision


@pytest_precision.register("long_rows_causal", kind="attention")
def long_rows_causal(q, k, v, causal):
    # a defect: past 100 keys it masks causally whatever it is asked
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal or k.shape[-2] > 100)
""")
    result = _run(pytester, "--precision-configs=fp32", "-k", "math and (unit or square128)")
    failed = [line for line in result.outlines if line.startswith("precision-suite::") and "]: FAIL convention" in line]
    assert failed, result.stdout.str()[-2000:]  # square128, taken alone, looks causal-only
    assert _block(result) == []  # but unit passes without a causal mask: no causal_only=True offered


def test_input_names_found_add_to_those_the_target_declared(pytester):
    pytester.makeconftest("""
import torch
import pytest_precision


def add_inplace(a, b):  # writes both inputs; it declared one
    a.add_(1)
    b.add_(1)
    return (a + b).clone()


pytest_precision.register("add_inplace", add_inplace, kind="op", mutates=("arg0",), forward_only=True,
                          inputs={"unit": lambda g: (torch.randn(4, generator=g), torch.randn(4, generator=g))})
""")
    result = _run(pytester, "--precision-configs=fp32", "-k", "unit")
    assert _block(result)[2:4] == ['    pytest_precision.register("add_inplace", ..., mutates=("arg0", "arg1"))',
                                   '      (in place of its own mutates=)']
