"""The training suite end to end (pytester): a correct AMP step passes every config it is meant to
pass, twice in a row with goldens recorded once, and each planted defect is caught and named,
under SGD, Adam and AdamW where the optimizer matters: gradient clipping before
``scaler.unscale_``, a model change (the attention's scale), gradients really lost (a step that
ignores the GradScaler on a small loss) beside exactly-zero ones that are not (an attention key
bias), a batch_fn that does not repeat itself; and a loss computed as log(softmax) in low
precision, pure bf16 with a small learning rate (lost updates, fewer with stochastic rounding),
DDP's compression hooks."""
import pytest
from machine import ON_CPU
from training_helpers import ATTENTION_MODEL, HEADER, accept_then_run, run_suite

# imported here, outside the pytester sessions: a module first imported inside one is dropped from
# sys.modules when it ends, while the kind registry keeps the kind that uses it, and the DDP ranks'
# entry point (pickled by reference when spawned) must be found in sys.modules
import pytest_precision.training.distributed  # noqa: F401

pytest_plugins = ["pytester"]


@pytest.mark.slow(reason="the main job runs these cases against the same goldens")
def test_builtin_gpt_passes_every_config(pytester):
    """The built-in target against the committed goldens (the repository's baselines)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    pytester.makeini(f"[pytest]\nprecision_baseline_dir = {root / 'baselines'}\n")
    result = run_suite(pytester, "-rs", *ON_CPU)  # the committed goldens hold the CPU machines' budgets
    result.assert_outcomes(passed=14, skipped=1)  # tf32 is CUDA only
    for config in ("fp32", "amp-bf16", "amp-fp16", "amp-fp16-noscale", "bf16", "bf16-sr", "fp8-e4m3", "fp8-tensorwise",
                   "fp8-delayed"):
        result.stdout.fnmatch_lines([f"| tiny_gpt *| {config} *| 8 *| pass *|"])
    for config in ("ddp-fp16", "ddp-bf16", "fsdp-bf16", "fsdp-bf16-reduce-bf16", "fsdp-fp16-reduce-fp16"):
        result.stdout.fnmatch_lines([f"| tiny_gpt *| {config} *| 1 *| pass *|"])


def test_correct_amp_step_passes_and_noscale_shows_underflow(pytester):
    pytester.makeconftest(HEADER + """
pytest_precision.register("small_loss", pytest_precision.TrainSpec(lambda: Net(1e-6), sgd, batch, steps=4),
                          kind="train_step")
""")
    result = accept_then_run(pytester, "--precision-configs=fp32,amp-bf16,amp-fp16")
    result.assert_outcomes(passed=4)
    # amp-fp16 without a scaler is shown, not failed: the table names the parameter whose gradients vanished
    result.stdout.fnmatch_lines(["| small_loss *| amp-fp16-noscale *|*| 100 % (*/*) fc*| pass *|"])
    # (the final parameters' SQNR is inf where they equal fp32's bit for bit: the default ISA)
    result.stdout.fnmatch_lines(["| small_loss *| amp-fp16 *| *4 | *[0-9.e-]* | *[0-9.]* | *[0-9.f]* | 0 *| 0 *|*| pass *|"])


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
    result = run_suite(pytester, "--precision-configs=amp-fp16", "-k", "amp-fp16-trajectory")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        # no scaler scaled the loss: the step ran at 1, where none of these gradients is in float16's
        # normal range; every gradient applied is 0, and the scale is what loses them
        "*train_step[[]no_scaler-amp-fp16-trajectory[]]: FAIL underflow,accuracy,baseline (gradient norm 0 x fp32's at "
        "step 0 *: every gradient the optimizer applied is 0; *; loss scale 1 at step 0 (no GradScaler scaled the loss at "
        "any step: loss.backward() without scaler.scale(loss)) leaves * of fc* first-step gradients below float16's "
        "normal range (6.1e-05) that 65536, *; in all 808 of 808 significant gradients below it at 1 (* flushed to 0), "
        "* at 65536; *: scale the loss with the GradScaler the step is handed (scaler.scale(loss).backward(), "
        "scaler.step(optimizer), scaler.update()); no golden baseline at *",
        # the first op whose backward output underflowed, with the float64 run's value there
        "*first underflow in aten::* (backward*) at conftest.py:* under amp-fp16: produced 0 from nonzero inputs where the reference is *",
    ])


# the model with a loss_fn, optimizer_fn taking the model, the usual AMP loop with clipping,
# learnable Markov-chain text
ATTENTION = """
import torch
import torch.nn.functional as F
from torch import nn
import pytest_precision
from pytest_precision.training import MarkovText


""" + ATTENTION_MODEL + """

def model():
    return TinyAttention()


def loss_fn(model, batch):
    logits, loss = model(*batch)
    return {LOSS_SCALE} * loss


def optimizer(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{{"params": decay, "weight_decay": 0.1}}, {{"params": rest, "weight_decay": 0.0}}]
    return {{"sgd": lambda: torch.optim.SGD(groups, lr=0.1), "adam": lambda: torch.optim.Adam(groups, lr=1e-2),
            "adamw": lambda: torch.optim.AdamW(groups, lr=1e-2)}}["{OPT}"]()


def step(model, optimizer, scaler, batch, autocast):
    with autocast():
        loss = loss_fn(model, batch)
    {BACKWARD}
    {FIRST}
    {SECOND}
    {STEP}
    optimizer.zero_grad(set_to_none=True)
    return loss


batch = {BATCH}
pytest_precision.register("attn", pytest_precision.TrainSpec(model, optimizer, batch, steps=4, step_fn=step, loss_fn=loss_fn),
                          kind="train_step")
"""
UNSCALE = "scaler.unscale_(optimizer)"
CLIP_NORM = "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"
CORRECT = dict(SCALE="", LOSS_SCALE="1.0", BACKWARD="scaler.scale(loss).backward()", FIRST=UNSCALE, SECOND=CLIP_NORM,
               STEP="scaler.step(optimizer); scaler.update()", BATCH="MarkovText(vocab_size=32, batch_size=4, block_size=16)")
OPTIMIZERS = ("sgd", "adam", "adamw")
SINGLE_PROCESS = ("fp32", "amp-bf16", "amp-fp16", "amp-fp16-noscale", "bf16", "bf16-sr", "fp8-e4m3", "fp8-tensorwise",
                  "fp8-delayed")


def _attention(pytester, opt, **planted):
    pytester.makeconftest(ATTENTION.format(**{**CORRECT, **planted, "OPT": opt}))


def test_correct_loop_passes_every_config_twice_with_goldens_recorded_once(pytester):
    """nanoGPT's optimizer (AdamW with two parameter groups): every single-process config, the
    key bias's exactly-zero gradient included (the DDP cases below run the same model)."""
    _attention(pytester, "adamw")
    args = ("--precision-configs=fp32,amp-bf16,amp-fp16,bf16,fp8-e4m3", "-k", "not ddp and not fsdp")
    run_suite(pytester, "--precision-update-baselines", *args).assert_outcomes(passed=9)
    for _ in range(2):
        result = run_suite(pytester, *args)
        result.assert_outcomes(passed=9)
        for config in SINGLE_PROCESS:
            result.stdout.fnmatch_lines([f"| attn *| {config} *| *4 |*| pass *|"])


@pytest.mark.parametrize("opt", OPTIMIZERS[:2])
def test_correct_loop_passes_under_sgd_and_adam(pytester, opt):
    """The configs the planted defects below fail (AdamW: the test above)."""
    _attention(pytester, opt)
    accept_then_run(pytester, "--precision-configs=fp32,amp-fp16").assert_outcomes(passed=3)


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_clipping_before_unscale_is_caught(pytester, opt):
    """Under Adam and AdamW the update hardly shrinks (they normalise the gradient's scale away):
    the gradient's norm and SQNR against fp32 catch it, and the message names the cause."""
    _attention(pytester, opt, FIRST=CLIP_NORM, SECOND=UNSCALE)
    result = run_suite(pytester, "--precision-configs=amp-fp16", "-k", "amp-fp16-trajectory")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*attn-amp-fp16-trajectory*FAIL accuracy*(gradient norm * x fp32's at step 0 (a correct step stays within 0.97 "
        "to 1.03 in float16): the applied gradients have fp32's direction (cosine 1.0000) and norm 1 / the loss scale at "
        "every step: they were clipped to norm 1 before scaler.unscale_(optimizer), which then divided them by the "
        "scale; clip after unscale_; gradient SQNR 0.0* dB in group 0 at the first step < 4* dB, 0.0* dB in group 1 "
        "at the first step < 48.2 dB, what float16 keeps in a correct step;*"])


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_a_model_change_moves_the_fp32_reference(pytester, opt):
    """The attention's scale set to 1 instead of 1/sqrt(8): on Markov text the fp32 run's first
    gradients move, and the message names the parameters that moved most."""
    _attention(pytester, opt)
    run_suite(pytester, "--precision-configs=fp32", "--precision-update-baselines").assert_outcomes(passed=1)
    run_suite(pytester, "--precision-configs=fp32").assert_outcomes(passed=1)
    _attention(pytester, opt, SCALE=", scale=1.0")
    result = run_suite(pytester, "--precision-configs=fp32")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*attn-fp32-trajectory*FAIL regression (golden: the fp32 reference moved against cpu-*'s (relative tolerance "
        "1e-05): first-step gradient norm * x the golden's, loss 1.00 x; first-step gradient norm of * vs * (*%), * vs "
        "* (*%), * vs * (*%)*; step 0 loss * vs *: the model, data, optimizer, training loop or torch changed the fp32 "
        "run itself, not its precision)"])
    assert "qkv.weight" in next(line for line in result.outlines if "fp32 reference moved" in line)


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_gradients_lost_to_fp16_are_caught_and_exactly_zero_ones_are_not(pytester, opt):
    """The correct loop (the key bias's exactly-zero gradient included) passed above; a loop that
    scales its loss by 1e-6 and skips the GradScaler loses its fp16 gradients: it ran at scale 1,
    where they are below float16's range, and that scale is what fails."""
    _attention(pytester, opt, LOSS_SCALE="1e-6", BACKWARD="loss.backward()", FIRST="", SECOND="", STEP="optimizer.step()")
    result = run_suite(pytester, "--precision-configs=amp-fp16", "-k", "amp-fp16-trajectory")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*attn-amp-fp16-trajectory*FAIL underflow*; loss scale 1 at step 0 (no GradScaler scaled the loss at any step: "
        "loss.backward() without scaler.scale(loss)) leaves * of * (100 %) of *",
        "*first underflow in aten::* under amp-fp16: produced 0 from nonzero inputs where the reference is *"])
    assert "the loss scale 1" not in result.stdout.str()  # no "1 / the loss scale" read from a step that ran at 1


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_a_batch_fn_that_does_not_repeat_itself_is_named_and_nothing_is_written(pytester, opt):
    _attention(pytester, opt, BATCH="lambda i: (torch.randint(0, 32, (4, 16)), torch.randint(0, 32, (4, 16)))")
    result = run_suite(pytester, "--precision-configs=fp32,amp-fp16", "--precision-update-baselines", "-k", "not ddp")
    result.assert_outcomes(failed=3)
    result.stdout.fnmatch_lines(["*target 'attn' (train_step): batch_fn(0) returned different data on two calls: each "
                                 "config must see the same batches*nothing was run or written*"])
    assert not (pytester.path / "precision_baselines").exists()


LOG_SOFTMAX = """
import torch
import torch.nn.functional as F
from torch import nn
import pytest_precision
from pytest_precision.numerics.inputs import seeded_normal


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
    accept_then_run(pytester, "--precision-configs=fp32,amp-fp16").assert_outcomes(passed=3)


def test_log_of_softmax_in_fp16_is_caught(pytester):
    pytester.makeconftest(LOG_SOFTMAX.format(
        LOSS="return -torch.log(torch.softmax(logits, -1)).gather(1, labels[:, None]).mean()"))
    result = run_suite(pytester, "--precision-configs=amp-fp16", "-k", "amp-fp16-trajectory")
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
    result = accept_then_run(pytester, "--precision-configs=fp32,bf16", "-k", "not ddp and not fsdp")
    result.assert_outcomes(passed=3)
    # weights at 1.0 in bf16 ignore any change below 2^-8: round to nearest loses every update,
    # stochastic rounding keeps them in expectation
    result.stdout.fnmatch_lines(["| ones *| bf16 *|*| 100 % (256/256) w *| *0 |*| pass *|"])
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
    accept_then_run(pytester, "--precision-configs=fp32,amp-bf16").assert_outcomes(passed=2)


def test_master_weights_rounded_to_bf16_lose_updates(pytester):
    pytester.makeconftest(ROUNDED_WEIGHTS.format(LR="0.1", STEP="rounding_step"))
    result = run_suite(pytester, "--precision-configs=amp-bf16")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*ones-amp-bf16-trajectory*FAIL accuracy*update-lost rate 256 of 256 elements (100 %) in w > 5 % allowed (up to 28 elements: *"])


def test_update_lost_regression_is_caught(pytester):
    pytester.makeconftest(PURE_BF16.format(LR="1.0"))  # updates of about 1 ULP: kept
    run_suite(pytester, "--precision-update-baselines", "--precision-configs=fp32,bf16",
              "-k", "bf16-trajectory and not ddp and not fsdp")
    pytester.makeconftest(PURE_BF16.format(LR="0.1"))
    result = run_suite(pytester, "--precision-configs=fp32,bf16", "-k", "bf16-trajectory and not ddp and not fsdp")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*ones-bf16-trajectory*FAIL *golden: update-lost rate 256 of 256 elements (100 %) in w > budget 13 elements (5.08 %)*"])


def test_missing_and_corrupt_training_golden(pytester):
    pytester.makeconftest(HEADER + """
pytest_precision.register("net", pytest_precision.TrainSpec(Net, sgd, batch, steps=2), kind="train_step")
""")
    result = run_suite(pytester, "--precision-configs=fp32")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*FAIL baseline*no golden baseline at *train_step/net/trajectory/fp32.npz*",
                                 "*if this run is right, accept it with: pytest --precision-suite -k *net-fp32-trajectory* --precision-update-baselines*"])
    run_suite(pytester, "--precision-configs=fp32", "--precision-update-baselines").assert_outcomes(passed=1)
    meta = pytester.path / "precision_baselines" / "train_step" / "net" / "trajectory" / "fp32.json"
    meta.write_text("{not json")
    result = run_suite(pytester, "--precision-configs=fp32")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"*{meta}: corrupt baseline metadata*"])


NET3 = HEADER + """
pytest_precision.register("net", pytest_precision.TrainSpec(Net, {OPTIMIZER}, batch, steps=3), kind="train_step")
"""


def _accept_then_change_the_optimizer(pytester, between=lambda: None):
    """The fp32 golden of the Net under SGD at lr 0.1, then the session's run at lr 0.2."""
    pytester.makeconftest(NET3.format(OPTIMIZER="sgd"))
    run_suite(pytester, "--precision-configs=fp32", "--precision-update-baselines").assert_outcomes(passed=1)
    between()
    pytester.makeconftest(NET3.format(OPTIMIZER="lambda p: torch.optim.SGD(p, lr=0.2)"))
    result = run_suite(pytester, "--precision-configs=fp32")
    result.assert_outcomes(failed=1)
    return result


def test_changed_model_moves_the_fp32_trajectory(pytester):
    result = _accept_then_change_the_optimizer(pytester)
    result.stdout.fnmatch_lines(["*FAIL regression*golden: the fp32 reference moved against cpu-*'s (relative tolerance "
                                 "1e-05): step 1 loss * vs *: the model, data, optimizer, training loop or torch changed the "
                                 "fp32 run itself, not its precision*"])


def _rename_key(path, new: str) -> None:
    """The golden as another machine of the same device type recorded it."""
    import json

    meta = json.loads(path.read_text())
    meta["budgets"] = {new: record for record in meta["budgets"].values()}
    path.write_text(json.dumps(meta))


def test_a_machine_without_its_own_key_still_checks_the_fp32_reference(pytester):
    def as_another_machine():
        _rename_key(pytester.path / "precision_baselines" / "train_step" / "net" / "trajectory" / "fp32.json",
                    "cpu-elsewhere")
        run_suite(pytester, "--precision-configs=fp32").assert_outcomes(passed=1)  # within 1e-4 of its fp32 run

    result = _accept_then_change_the_optimizer(pytester, as_another_machine)
    result.stdout.fnmatch_lines(["*FAIL regression*golden: the fp32 reference moved against cpu-elsewhere's (relative "
                                 "tolerance 0.0001): step 1 loss * vs *",
                                 "*no budget recorded for cpu-*: judged by the widest recorded for cpu-elsewhere, its fp32 "
                                 "reference held to theirs within 0.0001; if this run is right, accept it with: *"])


def test_a_golden_of_an_earlier_format_says_to_re_accept(pytester):
    import json

    pytester.makeconftest(HEADER + """
pytest_precision.register("net", pytest_precision.TrainSpec(Net, sgd, batch, steps=2), kind="train_step")
""")
    run_suite(pytester, "--precision-configs=amp-bf16", "--precision-update-baselines").assert_outcomes(passed=1)
    path = pytester.path / "precision_baselines" / "train_step" / "net" / "trajectory" / "amp-bf16.json"
    meta = json.loads(path.read_text())
    for record in meta["budgets"].values():  # as the budgets were before gradient SQNR had one
        del record["outputs"]["trajectory"]["budget"]["min_grad_sqnr_db"]
    path.write_text(json.dumps(meta))
    result = run_suite(pytester, "--precision-configs=amp-bf16")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"*FAIL baseline ({path}: the budget recorded for cpu-* is of an earlier format (no "
                                 "min_grad_sqnr_db per parameter group): if this run is right, accept it with: pytest --precision-suite "
                                 "-k *net-amp-bf16-trajectory* --precision-update-baselines)"])
    # re-accepted here: this machine's record is current; another machine's old one is that
    # machine's to re-accept and does not stop this one
    run_suite(pytester, "--precision-configs=amp-bf16", "--precision-update-baselines").assert_outcomes(passed=1)
    meta = json.loads(path.read_text())
    (mine,) = meta["budgets"]
    meta["budgets"]["cpu-other"] = json.loads(json.dumps(meta["budgets"][mine]))
    del meta["budgets"]["cpu-other"]["outputs"]["trajectory"]["budget"]["min_grad_sqnr_db"]
    path.write_text(json.dumps(meta))
    run_suite(pytester, "--precision-configs=amp-bf16").assert_outcomes(passed=1)


def test_step_that_raises_names_target_config_and_step(pytester):
    pytester.makeconftest(HEADER + """
def broken(model, optimizer, scaler, batch, autocast):
    raise RuntimeError("boom")


pytest_precision.register("broken", pytest_precision.TrainSpec(Net, sgd, batch, steps=2, step_fn=broken),
                          kind="train_step")
""")
    result = run_suite(pytester, "--precision-configs=fp32")
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
from pytest_precision.numerics.inputs import seeded_normal


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


def test_ddp_compression_hooks_pass_a_model_with_an_exactly_zero_gradient(pytester):
    """The attention model (its key bias's exact gradient is 0: fp32 holds noise there, the fp16 hook
    sends 0), its loss from loss_fn, its batches from MarkovText: module-level model_fn and loss_fn,
    which the two spawned ranks import from the conftest."""
    _attention(pytester, "adamw")
    run_suite(pytester, "--precision-update-baselines", "--precision-configs=fp16,bf16", "-k", "ddp").assert_outcomes(passed=2)
    result = run_suite(pytester, "--precision-configs=fp16,bf16", "-k", "ddp")  # against the goldens just recorded
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["| attn *| ddp-fp16 *|*| - *|*| pass *|", "| attn *| ddp-bf16 *|*| - *|*| pass *|"])


def test_ddp_cases_skip_a_forward_that_is_not_a_loss_saying_what_to_add(pytester):
    """A step_fn runs the whole step and cannot be split; without a loss_fn the DDP cases say so."""
    pytester.makeconftest(ATTENTION.format(**{**CORRECT, "OPT": "adamw"}).replace(", loss_fn=loss_fn)", ")"))
    result = run_suite(pytester, "--precision-configs=fp16", "-k", "ddp", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*attn: the DDP cases run forward and loss under DDP, not the step_fn, and the model "
                                 "returned tuple of 2 (Tensor, Tensor), not a scalar loss tensor*give the TrainSpec a "
                                 "loss_fn(model, batch)*"])


def test_ddp_fp16_hook_loses_small_gradients(pytester):
    # gradients of about 1e-9: below fp16's range (the hook has no loss scaling), well inside bf16's;
    # lost below the range is shown, and the SQNR fails it
    pytester.makeconftest(DDP.format(SCALE="1e-8"))
    result = run_suite(pytester, "--precision-configs=fp16,bf16", "-k", "ddp")
    result.assert_outcomes(failed=2)  # no golden yet: both fail on it, only fp16 on the numerics
    result.stdout.fnmatch_lines(["*small_net-ddp-fp16-trajectory*: FAIL accuracy,baseline (gradient SQNR 0 dB < 54.21 dB, "
                                 "what fp16 keeps in a correct all-reduce*",
                                 "*lost below fp16's normal range (the hook has no loss scaling; shown): fc.weight 128 of 128 elements (100 %)*"])
    result.stdout.fnmatch_lines(["*small_net-ddp-bf16-trajectory*: FAIL baseline (no golden baseline at *"])


def test_ddp_fp16_hook_overflows_large_gradients(pytester):
    # gradients of about 1e7: past fp16's 65504 even after the hook divides by the world size
    pytester.makeconftest(DDP.format(SCALE="1e9"))
    result = run_suite(pytester, "--precision-configs=fp16", "-k", "ddp")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*small_net-ddp-fp16-trajectory*: FAIL overflow,* gradient elements not finite with the "
                                 "hook, finite without*"])


def test_ddp_cases_skip_a_spec_the_ranks_cannot_import(pytester):
    pytester.makeconftest(HEADER + """
pytest_precision.register("lambdas", pytest_precision.TrainSpec(lambda: Net(), sgd, batch, steps=2), kind="train_step")
""")
    result = run_suite(pytester, "--precision-configs=fp16", "-k", "ddp", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*lambdas: *model_fn*module-level*"])


# a model_fn that returns its model in bfloat16 (as one loaded with torch_dtype=torch.bfloat16)
BUILT_IN_BF16 = HEADER + """
def model():
    net = Net()
    return net.to(torch.bfloat16) if {BF16} else net


pytest_precision.register("net", pytest_precision.TrainSpec(model, sgd, batch, steps=2), kind="train_step")
"""


def test_a_model_built_in_bf16_is_said_and_its_goldens_hold(pytester):
    """Cast to float32 master weights, the same start in every config: said in a warning and
    under the table, and its goldens pass twice in a row."""
    pytester.makeconftest(BUILT_IN_BF16.format(BF16=True))
    args = ("--precision-configs=fp32,bf16", "-k", "not ddp and not fsdp")
    run_suite(pytester, "--precision-update-baselines", *args).assert_outcomes(passed=3, warnings=1)
    result = run_suite(pytester, *args)
    result.assert_outcomes(passed=3, warnings=1)
    result.stdout.fnmatch_lines([
        "*ModelDtypeWarning: target 'net' (train_step): model_fn() built the model in bfloat16 (4 of 4 parameter "
        "tensors: fc1.weight, fc1.bias and 2 more): every config starts from these weights cast to float32 master "
        "weights (exact; pure bf16 casts them to bfloat16, the float64 step to float64), so all configs and machines "
        "start from the same weights and its goldens stay comparable. The fp32 and amp-* rows train float32 from "
        "these values; a bf16 training of yours is the bf16 and bf16-sr rows. To start from a float32 "
        "initialisation, return the model in float32 (drop .to(torch.bfloat16) or torch_dtype=torch.bfloat16)",
        "net: model_fn() built parameters in bfloat16; every config started from them cast to float32 master weights*"])


def test_a_model_switched_to_bf16_names_the_switch_against_its_golden(pytester):
    """Goldens accepted from a float32 model, then model_fn returns it in bf16: the run starts from
    other weights, and the golden says why (not "the initial parameters changed")."""
    pytester.makeconftest(BUILT_IN_BF16.format(BF16=False))
    run_suite(pytester, "--precision-configs=fp32", "--precision-update-baselines").assert_outcomes(passed=1)
    run_suite(pytester, "--precision-configs=fp32").assert_outcomes(passed=1, warnings=0)  # a float32 model: no warning
    pytester.makeconftest(BUILT_IN_BF16.format(BF16=True))
    result = run_suite(pytester, "--precision-configs=fp32")
    result.assert_outcomes(failed=1, warnings=1)
    result.stdout.fnmatch_lines([
        "*net-fp32-trajectory*: FAIL baseline (*fp32.json: model_fn() now builds the model's parameters in bfloat16 "
        "(not float32); when the golden was accepted on cpu-* it built them in float32. Every config starts from the "
        "built weights cast to float32, so the run starts from other weights: not a precision regression. Return the "
        "model as it was to keep this golden, or if this run is right, accept it with: pytest --precision-suite -k *",
        "    model_fn() built the model in bfloat16 (4 of 4 parameter tensors*"])
    assert "initial parameters" not in result.stdout.str()


def test_with_dropout_the_first_fault_is_named_at_the_op_that_lost_it(pytester):
    """Dropout before the output layer: the traced re-runs draw the run's mask, so the loop that
    skips its GradScaler is named at the backward matmul, not at the dropout's bernoulli_."""
    _attention(pytester, "adamw", LOSS_SCALE="1e-6", BACKWARD="loss.backward()", FIRST="", SECOND="",
               STEP="optimizer.step()")
    conftest = pytester.path / "conftest.py"
    source = conftest.read_text()
    for old, new in (("        self.head = nn.Linear(16, 32)\n",
                      "        self.head = nn.Linear(16, 32)\n        self.drop = nn.Dropout(0.1)\n"),
                     ("logits = self.head(x + a.transpose(1, 2).reshape(b, s, w))",
                      "logits = self.head(self.drop(x + a.transpose(1, 2).reshape(b, s, w)))")):
        assert old in source
        source = source.replace(old, new)
    conftest.write_text(source)
    result = run_suite(pytester, "--precision-configs=amp-fp16", "-k", "amp-fp16-trajectory")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*attn-amp-fp16-trajectory*FAIL underflow*gradient norm 0 x fp32's at step 0 (*): every gradient the optimizer "
        "applied is 0;*",
        "*first underflow in aten::mm (backward (AddmmBackward0)) at conftest.py:* under amp-fp16: produced 0 from nonzero "
        "inputs where the reference is *"])
    assert "bernoulli" not in result.stdout.str()


# a loss that grows its own exponent: exp(8) at step 0, exp(14) after one SGD step, past float16's
# 65504 (exp(11.09)) and within float32's
EXP_AT_STEP_1 = """
import torch
from torch import nn
import pytest_precision


class Exp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)
        with torch.no_grad():
            self.fc.weight.fill_(2.0)
            self.fc.bias.zero_()

    def forward(self, x):
        return -torch.exp(self.fc(x)).mean()


pytest_precision.register("exp", pytest_precision.TrainSpec(
    Exp, lambda p: torch.optim.SGD(p, lr=4e-4), lambda i: torch.ones(8, 4), steps=2), kind="train_step")
"""


def test_a_value_that_goes_non_finite_after_the_first_step_is_located_at_its_step(pytester):
    """Before, only the first step was traced: an overflow at step 1 read 'non-finite loss at step 1'
    with no op. The run is replayed to step 1, which is traced beside the same step in float64 from
    the parameters the run had there."""
    pytester.makeconftest(EXP_AT_STEP_1)
    result = run_suite(pytester, "--precision-configs=amp-fp16", "-k", "amp-fp16-noscale-trajectory")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*exp-amp-fp16-noscale-trajectory*FAIL overflow*non-finite loss at step 1 (loss -inf)*",
        # the float64 step from the run's parameters at step 1: exp(13.96), the fp32 run's loss there
        "*first overflow in aten::exp at conftest.py:15 under amp-fp16-noscale at step 1: produced inf from finite "
        "inputs where the reference is 1.16e+06*"])
