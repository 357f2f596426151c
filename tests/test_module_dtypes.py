"""Where each module of a training step ran (training/module_dtypes.py): a head the model means in
float32 (``TrainSpec(keep_fp32=...)``) passes where it runs with autocast disabled on float32
inputs and fails where only its parameters are float32 (autocast computes it in 16 bits anyway);
under pure bf16 (stochastic rounding too) the declared head keeps float32 parameters; an
undeclared float32 matmul under autocast is reported by the audit, not failed."""
import torch
from torch import nn

from pytest_precision.training import TrainSpec
from pytest_precision.training.module_dtypes import declared_fp32, module_flags, record_module_dtypes
from training_helpers import run_suite

pytest_plugins = ["pytester"]

MODEL = """
import contextlib
import torch
import torch.nn.functional as F
from torch import nn
import pytest_precision
from pytest_precision.numerics.inputs import seeded_normal


class Net(nn.Module):
    def __init__(self, head="autocast-off", checkpoint=None):
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 8)
        self.how, self.checkpoint = head, checkpoint

    def body(self, x):
        return self.norm(torch.relu(self.fc(x)))

    def forward(self, x, y):
        if self.checkpoint is None:
            h = self.body(x)
        else:
            h = torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False, **self.checkpoint)
        if self.how == "autocast-off":  # the head in float32, as a repository keeping it there writes it
            with torch.autocast(x.device.type, enabled=False):
                logits = self.head(h.float())
        else:  # the head as written: autocast decides
            logits = self.head(h)
        return F.cross_entropy(logits.float(), y)


def batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return seeded_normal(g, 64, 16), torch.randint(0, 8, (64,), generator=g)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def spec(**kw):
    keep = kw.pop("keep_fp32", ("head",))
    return pytest_precision.TrainSpec(lambda: Net(**kw), adamw, batch, steps=2, keep_fp32=keep)
"""


def _failed_lines(result):
    return [line for line in result.stdout.lines if line.startswith("precision-suite::") and ": FAIL" in line]


def test_a_head_kept_in_float32_passes_and_one_with_only_float32_parameters_fails(pytester):
    pytester.makeconftest(MODEL + """
pytest_precision.register("head_fp32", spec(), kind="train_step")
pytest_precision.register("head_params_only", spec(head="as-written"), kind="train_step")
""")
    result = run_suite(pytester, "--precision-configs=fp32,amp-bf16,amp-fp16,bf16", "--precision-update-baselines")
    failed = [line for line in _failed_lines(result) if not line.startswith(("precision-suite::train_step[head_params_only-bf16-",
                                                                             "precision-suite::train_step[head_params_only-bf16-sr-"))]
    # the plant: under every autocast config the head computed in 16 bits; fp32 and the correct head pass
    assert sorted(line.split(":")[2].split("]")[0] for line in failed) == [
        "train_step[head_params_only-amp-bf16-trajectory", "train_step[head_params_only-amp-fp16-noscale-trajectory",
        "train_step[head_params_only-amp-fp16-trajectory"], failed
    result.stdout.fnmatch_lines([
        "precision-suite::train_step[[]head_params_only-amp-bf16-trajectory[]]: FAIL dtype* (head (Linear) is declared "
        "float32 (keep_fp32) and ran in bf16 (parameters fp32, inputs bf16): autocast casts a Linear's input and weight "
        "to bf16 whatever they are stored in: run it inside torch.autocast(device_type, enabled=False) on inputs cast "
        "to float32*"])
    # pure bf16: the declared head keeps float32 parameters (the correct model casts its input and passes; the
    # plant's bf16 input meets float32 weights, as it would in the repository)
    rows = [line for line in result.stdout.lines if line.startswith("| head_fp32 ")]
    assert len(rows) >= 6 and not [row for row in rows if "FAIL" in row], rows
    result.stdout.fnmatch_lines(["*train_step[[]head_params_only-bf16-trajectory[]]*mat1 and mat2 must have the same "
                                 "dtype*"])


def test_the_audit_shows_where_each_module_ran_and_an_undeclared_float32_matmul(pytester):
    pytester.makeconftest(MODEL + """
pytest_precision.register("undeclared", spec(keep_fp32=()), kind="train_step")
""")
    result = run_suite(pytester, "--precision-configs=amp-bf16", "--precision-update-baselines", "--precision-audit",
                       "-k", "amp-bf16-trajectory")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([
        "*| module *| class *| params *| inputs *| outputs *| recompute *|",
        "*| fc *| Linear *| fp32 *| fp32 *| bf16 *|*",
        "*| norm *| LayerNorm *| fp32 *| bf16 *| bf16 *|*",
        "*| head *| Linear *| fp32 *| fp32 *| fp32 *|*",
        "*FLAG head (Linear) ran in float32 under autocast bf16 (inputs fp32): its matmul gets no 16-bit speed-up; "
        "declare keep_fp32=('head',) if that is by design",
    ])


def test_declarations_match_a_module_or_one_above_it_and_bad_ones_are_refused():
    assert declared_fp32("blocks.0.ln1", ("blocks.*.ln*",)) and declared_fp32("lm_head.inner", ("lm_head",))
    assert not declared_fp32("blocks.0.qkv", ("blocks.*.ln*",))
    assert TrainSpec(lambda: None, lambda p: None, lambda i: None, keep_fp32="lm_head").keep_fp32 == ("lm_head",)
    try:
        TrainSpec(lambda: None, lambda p: None, lambda i: None, keep_fp32=(nn.Linear,))
    except TypeError as e:
        assert "keep_fp32 must be module names or fnmatch patterns" in str(e)
    else:
        raise AssertionError("a class in keep_fp32 was accepted")


def test_recorded_dtypes_of_a_step_under_autocast():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    with record_module_dtypes(model) as runs, torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 4)).float().sum().backward()
    assert runs["0"].outputs == {torch.bfloat16} and runs["0"].params == {torch.float32} and runs["0"].matmul
    assert not runs["0"].recompute_outputs
    assert module_flags(runs, torch.bfloat16, torch.float32, ("0",))[0]  # declared float32, ran in bf16
    assert module_flags(runs, None, torch.float32, ("0",)) == ([], [])  # fp32: nothing is meant in 16 bits


def test_fp8_recipes_leave_the_modules_declared_float32_alone():
    from pytest_precision.training.configs import TRAIN_CONFIGS
    from pytest_precision.training.fp8 import scaled_mm_fp8_linears
    from pytest_precision.training.recipes import emulated_fp8_linears

    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    with scaled_mm_fp8_linears(model, TRAIN_CONFIGS["fp8-tensorwise"].float8, keep_fp32=("2",)) as counts:
        assert counts.linears == ["0"] and "forward" not in vars(model[2])
    with emulated_fp8_linears(model, ("2",)) as n:
        assert n == 1 and "forward" in vars(model[0]) and "forward" not in vars(model[2])
    with emulated_fp8_linears(model) as n:
        assert n == 2


def test_checkpoint_false_is_no_checkpointing():
    assert TrainSpec(lambda: None, lambda p: None, lambda i: None, checkpoint=False).checkpoint is None
