"""The training suite end to end (pytester): a correct AMP step passes every config it is meant to
pass, and each planted defect is caught and named: a step that ignores the GradScaler on a model
with a small loss (gradient underflow), gradient clipping before ``scaler.unscale_``, a loss
computed as log(softmax) in low precision, pure bf16 with a small learning rate (lost updates,
fewer with stochastic rounding)."""
import pytest
from machine import ON_CPU

pytest_plugins = ["pytester"]

# A small regression model: fast, and its loss can be made as small as a defect needs.
HEADER = """
import torch
import torch.nn.functional as F
from torch import nn
import pytest_precision
from pytest_precision.inputs import seeded_normal


class Net(nn.Module):
    def __init__(self, loss_scale=1.0):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)
        self.loss_scale = loss_scale

    def forward(self, x, y):
        return self.loss_scale * F.mse_loss(self.fc2(torch.relu(self.fc1(x))), y)


def batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return seeded_normal(g, 64, 16), seeded_normal(g, 64, 8)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)
"""


def _run(pytester, *args):
    """A session of the training suite (the other suites deselected)."""
    args = list(args)
    if "-k" in args:
        i = args.index("-k") + 1
        args[i] = f"train_step and ({args[i]})"
    else:
        args += ["-k", "train_step"]
    return pytester.runpytest("--precision-suite", "-p", "no:cacheprovider", *args)


def _accept_then_run(pytester, *args):
    _run(pytester, "--precision-update-baselines", *args)
    return _run(pytester, *args)


def test_builtin_gpt_passes_every_config(pytester):
    """The built-in target against the committed goldens (the repository's baselines)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    pytester.makeini(f"[pytest]\nprecision_baseline_dir = {root / 'baselines'}\n")
    result = _run(pytester, "-rs", *ON_CPU)  # the committed goldens hold the CPU machines' budgets
    result.assert_outcomes(passed=9, skipped=1)  # tf32 is CUDA only
    for config in ("fp32", "amp-bf16", "amp-fp16", "amp-fp16-noscale", "bf16", "bf16-sr", "fp8-e4m3"):
        result.stdout.fnmatch_lines([f"| tiny_gpt *| {config} *| 8 *| pass *|"])
    for config in ("ddp-fp16", "ddp-bf16"):
        result.stdout.fnmatch_lines([f"| tiny_gpt *| {config} *| 1 *| pass *|"])


def test_correct_amp_step_passes_and_noscale_shows_underflow(pytester):
    pytester.makeconftest(HEADER + """
pytest_precision.register("small_loss", pytest_precision.TrainSpec(lambda: Net(1e-6), sgd, batch, steps=4),
                          kind="train_step")
""")
    result = _accept_then_run(pytester, "--precision-configs=fp32,amp-bf16,amp-fp16")
    result.assert_outcomes(passed=4)
    # amp-fp16 without a scaler is shown, not failed: the table names the parameter whose gradients vanished
    result.stdout.fnmatch_lines(["| small_loss *| amp-fp16-noscale *|*| 100 % fc*| pass *|"])
    result.stdout.fnmatch_lines(["| small_loss *| amp-fp16 *| *4 | *[0-9.e-]* | *[0-9.]* | *[0-9.]* | 0 *| 0 *|*| pass *|"])


def test_step_that_ignores_the_scaler_underflows(pytester):
    pytester.makeconftest(HEADER + """
def no_scaler(model, optimizer, scaler, batch, autocast):
    optimizer.zero_grad()
    with autocast():
        loss = model(*batch)
    loss.backward()  # the defect: scaler.scale(loss) skipped, fp16 gradients of a 1e-6 loss vanish
    optimizer.step()
    return loss


pytest_precision.register("no_scaler", pytest_precision.TrainSpec(lambda: Net(1e-6), sgd, batch, steps=4,
                                                                   step_fn=no_scaler), kind="train_step")
""")
    result = _run(pytester, "--precision-configs=amp-fp16", "-k", "amp-fp16-trajectory")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*train_step[[]no_scaler-amp-fp16-trajectory[]]: FAIL underflow*gradient-underflow rate 100.0 % in fc*.weight > 5 % allowed*",
        # the first op whose backward output underflowed, with the float64 run's value there
        "*first underflow in aten::* (backward*) at conftest.py:* under amp-fp16: produced 0 from nonzero inputs where the reference is *",
    ])


CLIP = HEADER + """
def clipped(model, optimizer, scaler, batch, autocast):
    optimizer.zero_grad()
    with autocast():
        loss = model(*batch)
    scaler.scale(loss).backward()
    {FIRST}
    {SECOND}
    scaler.step(optimizer)
    scaler.update()
    return loss


pytest_precision.register("clip", pytest_precision.TrainSpec(Net, sgd, batch, steps=4, step_fn=clipped), kind="train_step")
"""
UNSCALE = "scaler.unscale_(optimizer)"
CLIP_NORM = "torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)"


def test_clipping_after_unscale_passes(pytester):
    pytester.makeconftest(CLIP.format(FIRST=UNSCALE, SECOND=CLIP_NORM))
    _accept_then_run(pytester, "--precision-configs=fp32,amp-fp16", "-k", "fp32 or amp-fp16-trajectory").assert_outcomes(passed=2)


def test_clipping_before_unscale_is_caught(pytester):
    pytester.makeconftest(CLIP.format(FIRST=CLIP_NORM, SECOND=UNSCALE))
    result = _run(pytester, "--precision-configs=amp-fp16", "-k", "amp-fp16-trajectory")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*clip-amp-fp16-trajectory*FAIL accuracy*the parameter update is * x the fp32 update (median over steps), about "
        "1 / the loss scale 65536: the gradients were clipped or changed before scaler.unscale_(optimizer)*"])
    # the stalled updates also show in the loss trajectory: the loss-deviation verdict
    result.stdout.fnmatch_lines(["*clip-amp-fp16-trajectory*FAIL accuracy*(loss deviates from fp32 by * (relative) at step "
                                 "* > 0.005 allowed for amp-fp16;*"])


LOG_SOFTMAX = """
import torch
import torch.nn.functional as F
from torch import nn
import pytest_precision
from pytest_precision.inputs import seeded_normal


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)
        with torch.no_grad():
            self.fc.weight.copy_(seeded_normal(torch.Generator().manual_seed(3), 32, 16, scale=2.0))

    def forward(self, x, labels):
        logits = self.fc(x)
        {LOSS}


def batch(i):
    g = torch.Generator().manual_seed(200 + i)
    return seeded_normal(g, 64, 16), torch.randint(0, 32, (64,), generator=g)


pytest_precision.register("classifier", pytest_precision.TrainSpec(
    Classifier, lambda p: torch.optim.SGD(p, lr=1e-3), batch, steps=3), kind="train_step")
"""


def test_cross_entropy_passes(pytester):
    pytester.makeconftest(LOG_SOFTMAX.format(LOSS="return F.cross_entropy(logits, labels)"))
    _accept_then_run(pytester, "--precision-configs=fp32,amp-fp16").assert_outcomes(passed=3)


def test_log_of_softmax_in_fp16_is_caught(pytester):
    pytester.makeconftest(LOG_SOFTMAX.format(
        LOSS="return -torch.log(torch.softmax(logits, -1)).gather(1, labels[:, None]).mean()"))
    result = _run(pytester, "--precision-configs=amp-fp16", "-k", "amp-fp16-trajectory")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*classifier-amp-fp16-trajectory*FAIL overflow*non-finite loss at step 0 (loss inf)*",
        # on the CPU, autocast leaves softmax of fp16 logits in fp16: the 0 meets the log
        "*first underflow in aten::log at conftest.py:* under amp-fp16: produced -inf from finite inputs where the reference is *"
        "the 0 came from aten::_softmax at conftest.py:* underflowing where the reference is *",
    ])


PURE_BF16 = HEADER + """
class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(256))

    def forward(self, x, y):
        return F.mse_loss(x[:, :1] * self.w, y[:, :1].expand(-1, 256))


pytest_precision.register("ones", pytest_precision.TrainSpec(
    Scale, lambda p: torch.optim.SGD(p, lr={LR}), batch, steps=8), kind="train_step")
"""


def test_pure_bf16_small_lr_loses_updates_and_stochastic_rounding_keeps_some(pytester):
    pytester.makeconftest(PURE_BF16.format(LR="0.1"))  # updates of about 0.1 ULP at 1.0
    result = _accept_then_run(pytester, "--precision-configs=fp32,bf16", "-k", "not ddp")
    result.assert_outcomes(passed=3)
    # weights at 1.0 in bf16 ignore any change below 2^-8: round to nearest loses every update,
    # stochastic rounding keeps them in expectation
    result.stdout.fnmatch_lines(["| ones *| bf16 *|*| 100 % w *| *0 |*| pass *|"])
    row = next(line for line in result.outlines if line.startswith("| ones") and "| bf16-sr " in line)
    lost = float(row.split("|")[8].split("%")[0])
    assert 5 < lost < 80, row  # about 0.9 ** 8 = 43 %: each step moves a weight with probability 0.1


ROUNDED_WEIGHTS = HEADER + """
def rounding_step(model, optimizer, scaler, batch, autocast):
    loss = pytest_precision.standard_step(model, optimizer, scaler, batch, autocast)
    with autocast():  # the defect: master weights rounded to the autocast dtype after every step
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
    if dtype is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(dtype))
    return loss
""" + PURE_BF16[len(HEADER):].replace("Scale, lambda p: torch.optim.SGD(p, lr={LR}), batch, steps=8)",
                                      "Scale, lambda p: torch.optim.SGD(p, lr={LR}), batch, steps=8, step_fn={STEP})")


def test_amp_keeps_small_updates_in_fp32_master_weights(pytester):
    pytester.makeconftest(ROUNDED_WEIGHTS.format(LR="0.1", STEP="None"))
    _accept_then_run(pytester, "--precision-configs=fp32,amp-bf16").assert_outcomes(passed=2)


def test_master_weights_rounded_to_bf16_lose_updates(pytester):
    pytester.makeconftest(ROUNDED_WEIGHTS.format(LR="0.1", STEP="rounding_step"))
    result = _run(pytester, "--precision-configs=amp-bf16")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*ones-amp-bf16-trajectory*FAIL accuracy*update-lost rate 100.0 % in w > 5 % allowed*"])


def test_update_lost_regression_is_caught(pytester):
    pytester.makeconftest(PURE_BF16.format(LR="1.0"))  # updates of about 1 ULP: kept
    _run(pytester, "--precision-update-baselines", "--precision-configs=fp32,bf16", "-k", "bf16-trajectory and not ddp")
    pytester.makeconftest(PURE_BF16.format(LR="0.1"))
    result = _run(pytester, "--precision-configs=fp32,bf16", "-k", "bf16-trajectory and not ddp")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*ones-bf16-trajectory*FAIL *golden: update-lost rate 100.0 % in w > budget *"])


def test_missing_and_corrupt_training_golden(pytester):
    pytester.makeconftest(HEADER + """
pytest_precision.register("net", pytest_precision.TrainSpec(Net, sgd, batch, steps=2), kind="train_step")
""")
    result = _run(pytester, "--precision-configs=fp32")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*FAIL baseline*no golden baseline at *train_step/net/trajectory/fp32.npz*",
                                 "*write it with: pytest --precision-suite -k *net-fp32-trajectory* --precision-update-baselines*"])
    _run(pytester, "--precision-configs=fp32", "--precision-update-baselines").assert_outcomes(passed=1)
    meta = pytester.path / "precision_baselines" / "train_step" / "net" / "trajectory" / "fp32.json"
    meta.write_text("{not json")
    result = _run(pytester, "--precision-configs=fp32")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"*{meta}: corrupt baseline metadata*"])


def test_changed_model_moves_the_fp32_trajectory(pytester):
    pytester.makeconftest(HEADER + """
pytest_precision.register("net", pytest_precision.TrainSpec(Net, sgd, batch, steps=3), kind="train_step")
""")
    _run(pytester, "--precision-configs=fp32", "--precision-update-baselines").assert_outcomes(passed=1)
    pytester.makeconftest(HEADER + """
pytest_precision.register("net", pytest_precision.TrainSpec(Net, lambda p: torch.optim.SGD(p, lr=0.2), batch, steps=3),
                          kind="train_step")
""")
    result = _run(pytester, "--precision-configs=fp32")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*FAIL regression*golden: the fp32 trajectory moved: step 1 loss * vs golden *"])


def test_step_that_raises_names_target_config_and_step(pytester):
    pytester.makeconftest(HEADER + """
def broken(model, optimizer, scaler, batch, autocast):
    raise RuntimeError("boom")


pytest_precision.register("broken", pytest_precision.TrainSpec(Net, sgd, batch, steps=2, step_fn=broken),
                          kind="train_step")
""")
    result = _run(pytester, "--precision-configs=fp32")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*target 'broken' (train_step) under config fp32: step 0 raised RuntimeError: boom*"])


def test_register_rejects_a_callable_for_train_step():
    import pytest_precision

    with pytest.raises(TypeError, match="kind train_step takes a pytest_precision.TrainSpec"):
        pytest_precision.register("f", lambda x: x, kind="train_step")
    with pytest.raises(ValueError, match="steps must be a positive int"):
        pytest_precision.TrainSpec(lambda: None, lambda p: None, lambda i: None, steps=0)


DDP = """
import torch
import torch.nn.functional as F
from torch import nn
import pytest_precision
from pytest_precision.inputs import seeded_normal


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x, y):
        return {SCALE} * F.mse_loss(self.fc(x), y)


def model():
    return Net()


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


def batch(i):
    g = torch.Generator().manual_seed(300 + i)
    return seeded_normal(g, 32, 16), seeded_normal(g, 32, 8)


pytest_precision.register("small_net", pytest_precision.TrainSpec(model, optimizer, batch, steps=2), kind="train_step")
"""


def test_ddp_compression_hooks_pass_a_correct_model(pytester):
    """Module-level functions: the two spawned ranks import them from the conftest."""
    pytester.makeconftest(DDP.format(SCALE="1.0"))
    result = _accept_then_run(pytester, "--precision-configs=fp16,bf16", "-k", "ddp")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["| small_net *| ddp-fp16 *|*| - *|*| pass *|", "| small_net *| ddp-bf16 *|*| - *|*| pass *|"])


def test_ddp_fp16_hook_underflows_small_gradients(pytester):
    # gradients of about 1e-9: below fp16's subnormal range, well inside bf16's
    pytester.makeconftest(DDP.format(SCALE="1e-8"))
    result = _run(pytester, "--precision-configs=fp16,bf16", "-k", "ddp")
    result.assert_outcomes(failed=2)  # no golden yet: both fail on it, only fp16 on the numerics
    result.stdout.fnmatch_lines(["*small_net-ddp-fp16-trajectory*: FAIL underflow,accuracy,baseline (gradient-underflow rate 100.0 % in fc.weight > 5 % allowed; gradient SQNR 0 dB < 54.2 dB*"])
    result.stdout.fnmatch_lines(["*small_net-ddp-bf16-trajectory*: FAIL baseline (no golden baseline at *"])


def test_ddp_fp16_hook_overflows_large_gradients(pytester):
    # gradients of about 1e7: past fp16's 65504 even after the hook divides by the world size
    pytester.makeconftest(DDP.format(SCALE="1e9"))
    result = _run(pytester, "--precision-configs=fp16", "-k", "ddp")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*small_net-ddp-fp16-trajectory*: FAIL overflow,* gradient elements not finite with the "
                                 "hook, finite without*"])


def test_ddp_cases_skip_a_spec_the_ranks_cannot_import(pytester):
    pytester.makeconftest(HEADER + """
pytest_precision.register("lambdas", pytest_precision.TrainSpec(lambda: Net(), sgd, batch, steps=2), kind="train_step")
""")
    result = _run(pytester, "--precision-configs=fp16", "-k", "ddp", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*lambdas: *model_fn*module-level*"])
