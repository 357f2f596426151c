"""Two training-loop defects a golden recorded from the defective code would accept, caught or
named: a float16 loss scale stuck where gradients underflow (judged with no golden, against the
float64 first step: ``training.loss_scale``), and a gradient-accumulation change that moves the
fp32 reference, read from the first step's gradient-norm and loss ratios against the golden's
(``training.moved``). Small models, few steps: each pytester session takes about a second."""
import math

import pytest
import torch
import torch.nn.functional as F

from training_helpers import HEADER, run_suite

pytest_plugins = ["pytester"]

# the Net's loss times 1e-2: gradients of 1e-5 to 1e-3, where float16 needs a loss scale (a scale
# of 1 costs only 4 dB of gradient SQNR here, 62.8 dB against 66.7, inside fp16's 48.2 dB floor)
SCALERS = HEADER + """
OWN = {}


def own_scaler(init_scale, growth_interval=10**9):
    # the loop's own GradScaler, not the one the harness hands the step (as a training script builds
    # it): one per optimizer, so each run (fp32, the float64 step, amp-fp16) starts from init_scale
    def step(model, optimizer, scaler, batch, autocast):
        scaler = OWN.setdefault(optimizer, torch.amp.GradScaler("cpu", init_scale=init_scale,
                                                                growth_interval=growth_interval))
        optimizer.zero_grad()
        with autocast():
            loss = model(*batch)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        return loss
    return step


def spec(step_fn=None):
    return pytest_precision.TrainSpec(lambda: Net(1e-2), sgd, batch, steps=4, step_fn=step_fn)


pytest_precision.register("default_scaler", spec(), kind="train_step")
pytest_precision.register("stuck_at_1", spec(own_scaler(1.0)), kind="train_step")
pytest_precision.register("stuck_at_65536", spec(own_scaler(2.0 ** 16)), kind="train_step")


def ignores_the_scaler(model, optimizer, scaler, batch, autocast):
    optimizer.zero_grad()
    with autocast():
        loss = model(*batch)
    loss.backward()  # the defect: the scaler handed to the step is never used
    optimizer.step()
    return loss


pytest_precision.register("no_scaler", spec(ignores_the_scaler), kind="train_step")
for init in (1.0, 16.0):  # 1, 2, 4, 8 and 16, 32, 64, 128 over the 4 steps
    pytest_precision.register(f"grows_from_{init:g}", spec(own_scaler(init, growth_interval=1)), kind="train_step")
"""


WORKING = ("that 65536, the scale a working GradScaler runs at here, keeps in it > 5 % allowed (up to 46 elements); in "
           "all {below} of 808 significant gradients below it at {scale} (0 flushed to 0), 0 at 65536; torch's default "
           "GradScaler starts at 65536 and backs off only on an overflow, and these parameter gradients stay finite in "
           "float16 up to 2^25 (an activation's gradient can overflow lower, where a step would be skipped): ")


def test_a_loss_scale_stuck_where_gradients_underflow_fails_with_no_golden(pytester):
    pytester.makeconftest(SCALERS)
    # a first run: no golden exists, and the update accepts what passes the absolute verdicts
    result = run_suite(pytester, "--precision-configs=amp-fp16", "-k", "amp-fp16-trajectory",
                       "--precision-update-baselines")
    result.assert_outcomes(passed=3, failed=3)
    result.stdout.fnmatch_lines([
        "*train_step[[]stuck_at_1-amp-fp16-trajectory[]]: FAIL underflow (loss scale 1 at step 0 (history 1, 1, 1, 1, "
        "never grew) leaves 336 of 512 elements (65.6 %) of fc1.weight's float64 first-step gradients below float16's "
        "normal range (6.1e-05) " + WORKING.format(below=408, scale=1) + "use the default GradScaler, or one that grows "
        "(growth_interval) from a lower init_scale)",
        "    loss scale: 1, 1, 1, 1, never grew; at step 0, 408 of 808 significant float64 gradients below float16's "
        "normal range, 0 at 65536 (a working GradScaler's scale here)",
        # loss.backward() without the scaler: the same numbers as a scaler stuck at 1, judged at 1
        "*train_step[[]no_scaler-amp-fp16-trajectory[]]: FAIL underflow (loss scale 1 at step 0 (no GradScaler scaled "
        "the loss at any step: loss.backward() without scaler.scale(loss)) leaves 336 of 512 elements (65.6 %) of "
        "fc1.weight's float64 first-step gradients below float16's normal range (6.1e-05) "
        + WORKING.format(below=408, scale=1) + "scale the loss with the GradScaler the step is handed "
        "(scaler.scale(loss).backward(), scaler.step(optimizer), scaler.update()))",
        "    loss scale: 1, 1, 1, 1: no GradScaler scaled the loss; at step 0, 408 of 808 *",
        # a scaler that grows is judged at the scale it reached, on the first step's float64 gradients
        "*train_step[[]grows_from_1-amp-fp16-trajectory[]]: FAIL underflow (loss scale 8 at step 3, the largest the run "
        "reached (from 1 at step 0; history 1, 2, 4, 8), still leaves 49 of 512 elements (9.57 %) of fc1.weight's "
        "float64 first-step gradients below float16's normal range (6.1e-05) " + WORKING.format(below=57, scale=8)
        + "the scaler grows, but over these 4 steps not to a scale that keeps them; start it higher (init_scale; torch's "
        "default is 65536))",
    ])
    # the loss-scale column: the scale each step ran with (before the scaler's update)
    lines = result.stdout.lines
    start = next(i for i, line in enumerate(lines) if line.startswith("precision-suite::train_step[grows_from_1-"))
    table = lines[lines.index("  amp-fp16: fp32 params, autocast float16, GradScaler; against the fp32 run from the same "
                              "seed, 4 steps:", start) + 2:][:4]
    assert [row.split()[-1] for row in table] == ["1", "2", "4", "8"], table
    result.stdout.fnmatch_lines(["    loss scale: 1, 2, 4, 8; at step 3 (8, the largest it reached), 57 of 808 "
                                 "significant float64 gradients below *"])
    # a scale that never grows but keeps every gradient in range is not a defect: a correct
    # GradScaler does not grow in 4 steps either; one that grew to 128 keeps all but 3 of 808
    result.stdout.fnmatch_lines(["| default_scaler *| amp-fp16 *|*| pass *|", "| grows_from_1 *| amp-fp16 *|*| FAIL underflow*|",
                                 "| grows_from_16 *| amp-fp16 *|*| pass *|", "| no_scaler *| amp-fp16 *|*| FAIL underflow*|",
                                 "| stuck_at_1 *| amp-fp16 *|*| FAIL underflow*|", "| stuck_at_65536 *| amp-fp16 *|*| pass *|"])
    written = sorted(p.parents[1].name for p in pytester.path.rglob("amp-fp16.json"))
    assert written == ["default_scaler", "grows_from_16", "stuck_at_65536"]  # no golden for the failing loops


def test_the_working_scale_is_below_any_scale_the_run_overflowed_at():
    from pytest_precision.training import TRAIN_CONFIGS
    from pytest_precision.training.loss_scale import scale_health, scale_problem

    exact = {"w": torch.logspace(-9, -2, 1000, dtype=torch.float64)}
    amp = TRAIN_CONFIGS["amp-fp16"]
    # backed off from 65536 to 1024 by overflows at steps 0 to 5 (as a default scaler does): working
    backed_off = scale_health(amp, [2.0 ** (16 - i) for i in range(7)], 6, [0, 1, 2, 3, 4, 5], exact)
    assert backed_off.working == 1024 and scale_problem(backed_off) is None
    stuck = scale_health(amp, [1024.0] * 7, 0, [], exact)
    assert stuck.working == 65536 and stuck.finite_up_to == 2 ** 22
    assert scale_problem(stuck).sentence.startswith("loss scale 1024 at step 0 (history 1024, 1024, 1024, 1024, 1024, 1024, "
                                           "1024, never grew) leaves 254 of 1000 elements (25.4 %) of w's float64")
    # a scaler that grows is judged at the largest scale an applied step ran with, not its first
    grown = scale_health(amp, [2.0 ** (10 + i) for i in range(7)], 0, [], exact)
    assert (grown.step, grown.scale, grown.grew) == (6, 65536, True) and scale_problem(grown) is None
    growing = scale_health(amp, [2.0 ** i for i in range(7)], 0, [], exact)
    assert scale_problem(growing).sentence.startswith("loss scale 64 at step 6, the largest the run reached (from 1 at step 0; "
                                             "history 1, 2, 4, 8, 16, 32, 64), still leaves ")
    # a scale a step overflowed at is not the one reached: the skipped step's scale was never applied
    peaked = scale_health(amp, [1024.0, 2048.0, 4096.0, 2048.0], 0, [2], exact)
    assert (peaked.step, peaked.scale, peaked.working) == (1, 2048, 2048) and scale_problem(peaked) is None
    never = scale_health(amp, [1.0] * 3, 0, [], exact, unscaled=[0, 1, 2])
    assert scale_problem(never).sentence.startswith("loss scale 1 at step 0 (no GradScaler scaled the loss at any step: ")
    assert scale_health(TRAIN_CONFIGS["amp-bf16"], [1.0] * 7, 0, [], exact) is None  # bf16 needs no scale
    assert scale_health(amp, [None] * 7, 0, [], exact) is None  # no scaler


ACCUMULATION = HEADER + """
MICRO = 2


def accumulate(model, optimizer, scaler, batch, autocast):
    optimizer.zero_grad()
    total = 0.0
    for x, y in zip(*(t.chunk(MICRO) for t in batch)):
        {ZERO_GRAD}
        with autocast():
            loss = model(x, y){DIVIDE}
        scaler.scale(loss).backward()
        total = total + loss.detach()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    return total


pytest_precision.register("accumulated", pytest_precision.TrainSpec(
    Net, lambda p: torch.optim.AdamW(p, lr=1e-3), batch, steps=3, step_fn=accumulate), kind="train_step")
"""
CORRECT = dict(ZERO_GRAD="pass", DIVIDE=" / MICRO")
MOVED = "*FAIL accuracy,regression (golden: the fp32 reference moved against cpu-*'s (relative tolerance 1e-05): first-step gradient norm"


def test_an_accumulation_change_names_what_moved_in_the_fp32_reference(pytester):
    def session(**planted):
        pytester.makeconftest(ACCUMULATION.format(**{**CORRECT, **planted}))
        return run_suite(pytester, "--precision-configs=fp32")

    pytester.makeconftest(ACCUMULATION.format(**CORRECT))
    run_suite(pytester, "--precision-configs=fp32", "--precision-update-baselines").assert_outcomes(passed=1)
    undivided = session(DIVIDE="")
    undivided.assert_outcomes(failed=1)
    undivided.stdout.fnmatch_lines([MOVED + " 2.00 x the golden's, loss 2.00 x: exactly the 2 micro-batches a step "
                                    "accumulates: the loss is no longer divided by the number of micro-batches; "
                                    "first-step gradient norm of fc*: the model, data, optimizer, training loop or torch "
                                    "changed the fp32 run itself, not its precision; 2 backward passes per "
                                    "optimizer.step() with no accumulate= declared (judged as TrainSpec(accumulate=2), "
                                    "the batch split in 2 along dim 0): *the loss of each micro-batch was not divided "
                                    "by the 2 micro-batches (loss / 2))"])
    inside = session(ZERO_GRAD="optimizer.zero_grad()")
    inside.assert_outcomes(failed=1)
    inside.stdout.fnmatch_lines([MOVED + " 0.64 x the golden's, loss 1.00 x: near 1/2 to 1/sqrt(2) for the 2 "
                                 "micro-batches a step accumulates, with the loss unchanged: as when only the last "
                                 "micro-batch's gradient is kept (zero_grad inside the accumulation loop), or gradients "
                                 "now clipped (clip_grad_norm_ with a max_norm below their norm); *"])
    session().assert_outcomes(passed=1)  # the loop as it was


@pytest.mark.parametrize("grad, loss, micro, reading", [
    (3.0000001, 3.0, 3, "exactly the 3 micro-batches a step accumulates: the loss is no longer divided by the number of "
                        "micro-batches"),
    (2.0, 1.0, 1, "exactly 2: the loss is no longer divided by 2, as when a loop of 2 micro-batches no longer divides "
                  "their loss by their number"),
    (4.0, 4.0, 2, "exactly 4: the loss (or its gradient) is no longer divided by 4"),
    (0.25, 0.25, 4, "exactly 1/4: the loss (or its gradient) is divided by 4 once more (by the number of micro-batches, "
                    "4, twice)"),
    (0.31, 1.0, 4, "near 1/4 to 1/sqrt(4) for the 4 micro-batches a step accumulates, with the loss unchanged: as when "
                   "only the last micro-batch's gradient is kept (zero_grad inside the accumulation loop), or gradients "
                   "now clipped (clip_grad_norm_ with a max_norm below their norm)"),
    # a clip that happens to halve the norm: the loss is unchanged, so clipping is named beside the division
    (0.5, 1.0, 2, "exactly 1/2: the loss (or its gradient) is divided by 2 once more (by the number of micro-batches, "
                  "2, twice); or, with the loss unchanged, gradients now clipped (clip_grad_norm_) to 1/2 of their norm"),
    (0.31, 1.0, 1, None),  # no accumulation: nothing to read
    (1.37, 1.37, 1, "loss and gradient by the same factor: the loss is multiplied by 1.37"),
    (1.004, 0.99998, 1, None),  # a model change: the ratios alone
    # the undivided loss of 2 micro-batches whose gradients clip_grad_norm_ brings back to max_norm
    (1.0, 2.0, 2, "the loss exactly the 2 micro-batches a step accumulates and the applied gradient unchanged: the "
                  "loss is no longer divided by the number of micro-batches, and clip_grad_norm_ clips both runs' "
                  "gradients to its max_norm"),
    (1.0, 2.0, 1, None),  # no accumulation: nothing to read
])
def test_first_step_ratios_read_as_a_loop_change(grad, loss, micro, reading):
    from pytest_precision.training.moved import ratio_reading

    assert ratio_reading(grad, loss, micro) == reading


def test_no_ratio_is_read_where_the_first_step_did_not_move():
    from pytest_precision.training.moved import first_step_ratios

    recorded = {"fp32_loss": [3.0, 2.9], "fp32_grad_norm": [1.0, 0.9]}
    assert first_step_ratios(dict(recorded, fp32_loss=[3.0, 2.95]), recorded) is None  # a later step moved
    assert first_step_ratios({"fp32_loss": [6.0, 5.8], "fp32_grad_norm": [2.0, 1.8]}, recorded, 2) == (
        "first-step gradient norm 2.00 x the golden's, loss 2.00 x: exactly the 2 micro-batches a step accumulates: the "
        "loss is no longer divided by the number of micro-batches")
    assert first_step_ratios({"fp32_loss": [math.nan, 1], "fp32_grad_norm": [1.0, 1]}, recorded) is None


SCALER_MISUSE = HEADER + """
def optimizer_step_not_scaler(model, optimizer, scaler, batch, autocast):
    optimizer.zero_grad()
    with autocast():
        loss = model(*batch)
    scaler.scale(loss).backward()
    optimizer.step()  # the defect, in place of scaler.step and scaler.update: gradients still scaled
    return loss


def update_per_micro_batch(model, optimizer, scaler, batch, autocast):
    optimizer.zero_grad()
    for micro in split_batch(batch, 2):
        with autocast():
            loss = model(*micro) / 2
        scaler.scale(loss).backward()
        scaler.update()  # the defect: per micro-batch, before scaler.step
    scaler.step(optimizer)
    scaler.update()
    return loss


from pytest_precision.training import split_batch

def adam(params):  # its update's size does not follow the gradient's: the run stays finite
    return torch.optim.Adam(params, lr=1e-3)


def clip_before_unscale(model, optimizer, scaler, batch, autocast):
    optimizer.zero_grad()
    with autocast():
        loss = model(*batch)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the defect: on the scaled gradients
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    return loss


class HeadInFloat32(Net):  # the README's idiom: the head in float32, autocast off around it
    def forward(self, x, y):
        h = torch.relu(self.fc1(x))
        with torch.autocast(h.device.type, enabled=False):
            return F.mse_loss(self.fc2(h.float()), y)


for model, prefix in ((Net, ""), (HeadInFloat32, "float_head.")):
    for name, fn in (("optimizer_step", optimizer_step_not_scaler), ("update_per_micro_batch", update_per_micro_batch),
                     ("clip_before_unscale", clip_before_unscale)):
        pytest_precision.register(prefix + name, pytest_precision.TrainSpec(model, adam, batch, steps=2, step_fn=fn),
                                  kind="train_step")
"""


def test_a_misused_gradscaler_is_named_with_its_cause(pytester):
    """Before, the first read 'gradient norm 6.55e+04 x fp32's' without naming the loss scale, and the
    second surfaced as torch's 'No inf checks were recorded prior to update' alone. Each is named in a
    model that keeps its head in float32 with h.float() too, as is clipping before unscale_."""
    pytester.makeconftest(SCALER_MISUSE)
    result = run_suite(pytester, "--precision-configs=amp-fp16", "-k", "amp-fp16-trajectory")
    result.assert_outcomes(failed=6)
    for prefix in ("", "float_head."):  # a plain model, and one with its head in float32 the README's way
        result.stdout.fnmatch_lines([f"*[[]{prefix}optimizer_step-amp-fp16-trajectory*FAIL accuracy*gradient norm "
                                     "6.55e+04 x fp32's at step * (*), about the loss scale 65536: the optimizer applied "
                                     "gradients still multiplied by it; step through the scaler (scaler.step(optimizer), "
                                     "which unscales first)*"])
        result.stdout.fnmatch_lines([f"*[[]{prefix}update_per_micro_batch*No inf checks were recorded prior to update*; "
                                     "scaler.update() ran with no scaler.step(optimizer) before it, as when it is called "
                                     "per micro-batch*"])
        result.stdout.fnmatch_lines([f"*[[]{prefix}clip_before_unscale-amp-fp16-trajectory*FAIL accuracy*gradient norm * "
                                     "x fp32's at step * (*): * clipped to norm 1 before scaler.unscale_(optimizer)*"])


# ---- a loss computed on 16-bit logits (training.loss_precision): the verdict names its dtype and line

class _Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 1000)

    def forward(self, x):
        return self.fc(x)


def _classes(i):
    g = torch.Generator().manual_seed(200 + i)
    return torch.randn(64, 64, generator=g), torch.randint(0, 1000, (64,), generator=g)


def _loss_outside_autocast(upcast):
    import torch.nn.functional as F

    def step(model, optimizer, scaler, batch, autocast):
        x, y = batch
        with autocast():
            logits = model(x)
        loss = F.cross_entropy(logits.float() if upcast else logits, y)  # outside autocast: no upcast of its own
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss
    return step


@pytest.mark.parametrize("upcast", [False, True])
def test_a_loss_on_16_bit_logits_is_named_with_its_dtype_and_line(upcast):
    import dataclasses

    from pytest_precision.training import TRAIN_CONFIGS, TrainSpec, compare_trajectories, run_training
    from pytest_precision.training.verdicts import judge_run

    spec = TrainSpec(_Classifier, lambda p: torch.optim.SGD(p, lr=1e-3), _classes, steps=2,
                     step_fn=_loss_outside_autocast(upcast))
    fp32 = run_training(spec, TRAIN_CONFIGS["fp32"], "cpu")
    run = run_training(spec, TRAIN_CONFIGS["amp-fp16"], "cpu")
    assert fp32.low_precision_loss is None
    if upcast:  # the careful loop: nothing to name
        assert run.low_precision_loss is None
        return
    found = run.low_precision_loss
    assert (found.op, found.dtype) == ("cross_entropy", "float16")
    assert found.where.startswith("test_training_loop_checks.py:")
    # a config held to a loss limit the 16-bit loss misses: the verdict on the loss says why
    strict = dataclasses.replace(TRAIN_CONFIGS["amp-fp16"], loss_rtol=1e-9)
    verdict = judge_run(compare_trajectories(run, fp32, strict), strict, None, None, found)
    loss = next(p for p in verdict.problems if p.sentence.startswith("loss deviates"))
    assert loss.sentence.endswith(f"; the loss's cross_entropy computed in float16 at {found.where}, on float16 logits: "
                                  "compute it on logits.float() (float32), as careful training code does")
    assert sum("computed in float16" in p.sentence for p in verdict.problems) == 1  # named once


# ---- a step_fn against the careful loop on the same model (training.peer)

LOOP_PEER = HEADER + """

def own_loop(model, optimizer, scaler, batch, autocast):
    # correct: two micro-batches, clipped after unscale_
    optimizer.zero_grad(set_to_none=True)
    for x, y in zip(*(t.chunk(2) for t in batch)):
        with autocast():
            loss = model(x, y) / 2
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
    scaler.step(optimizer)
    scaler.update()
    return loss


def grads_to_bf16(model, optimizer, scaler, batch, autocast):
    optimizer.zero_grad(set_to_none=True)
    with autocast():
        loss = model(*batch)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    for p in model.parameters():  # the defect: a bfloat16 "compression" of float16's gradients
        p.grad = p.grad.to(torch.bfloat16).to(p.grad.dtype)
    scaler.step(optimizer)
    scaler.update()
    return loss


def named_batch(i):
    return {"pair": batch(i)}


def unpacks(model, optimizer, scaler, batch, autocast):
    optimizer.zero_grad(set_to_none=True)
    with autocast():
        loss = model(*batch["pair"])  # only this loop knows how to feed the model
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss


for name, fn, data in (("own_loop", own_loop, batch), ("grads_to_bf16", grads_to_bf16, batch),
                       ("unpacks", unpacks, named_batch)):
    pytest_precision.register(name, pytest_precision.TrainSpec(Net, sgd, data, steps=2, step_fn=fn), kind="train_step")
"""


def test_a_step_fn_is_judged_against_the_careful_loop_on_the_same_model(pytester):
    """A bfloat16 cast of float16's gradients keeps 51.8 dB, inside float16's floor (48.2 dB) and past
    3 x the careful loop's error plus a rounding (54.5 dB): red on a first run; a correct loop of
    its own is green, and one the careful loop cannot feed is judged by the floors alone, said."""
    pytester.makeconftest(LOOP_PEER)
    first = run_suite(pytester, "--precision-configs=amp-fp16", "-k", "amp-fp16-trajectory")
    first.stdout.fnmatch_lines(["*[[]unpacks-amp-fp16-trajectory[]]: FAIL baseline (no golden*",
                                "  the step_fn's loop was not compared with the careful loop: the careful loop "
                                "(standard_step) could not run: step 0 raised TypeError: *unexpected keyword argument "
                                "'pair'; the format's floors judge its gradients alone"])
    result = run_suite(pytester, "--precision-configs=amp-fp16", "-k", "amp-fp16-trajectory", "--precision-update-baselines")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines([
        "*[[]grads_to_bf16-amp-fp16-trajectory[]]: FAIL accuracy (gradient SQNR 51.8 dB in all parameters at the first "
        "step < 54.5 dB, what the step_fn's loop may lose: the careful loop (standard_step) keeps 66.7 dB of it on the "
        "same model, loss, batch and config, and a loop is allowed 3 x its error plus one rounding of float16 "
        "(0.000488); the step_fn loses precision the model does not (a cast of its gradients to a coarser format, say))"])
    written = sorted(p.parents[1].name for p in pytester.path.rglob("amp-fp16.json"))
    assert written == ["own_loop", "unpacks"]


# ---- later steps against the careful loop's own drift (training.peer, training.verdicts.LaterSteps)

def _own_loop(model, optimizer, scaler, batch, autocast):
    optimizer.zero_grad(set_to_none=True)
    with autocast():
        loss = F.mse_loss(model(batch[0]), batch[1])
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def _regression(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(64, 16, generator=g), torch.randn(64, 8, generator=g)


def _later_step_case():
    """A step_fn's amp-bf16 run of 3 steps against fp32, and its careful loop."""
    from pytest_precision.training import TRAIN_CONFIGS, TrainSpec, compare_trajectories, run_training
    from pytest_precision.training.peer import run_peer

    spec = TrainSpec(_mlp, lambda p: torch.optim.SGD(p, lr=0.1), _regression, steps=3,
                     loss_fn=lambda model, batch: F.mse_loss(model(batch[0]), batch[1]), step_fn=_own_loop)
    config = TRAIN_CONFIGS["amp-bf16"]
    fp32, run = run_training(spec, TRAIN_CONFIGS["fp32"], "cpu"), run_training(spec, config, "cpu")
    return compare_trajectories(run, fp32, config), config, run_peer(spec, config, "cpu", "t", 1)


def test_the_careful_loop_measures_its_own_drift_from_its_fp32_run_at_every_step():
    from pytest_precision.training.peer import LoopPeer

    _, _, peer = _later_step_case()
    assert isinstance(peer, LoopPeer) and peer.step == 0
    drift = peer.drift
    assert len(drift.grads) == len(drift.loss) == 3 and drift.multiple == 3
    # its first step is the error the first-step budget reads; the drift only grows (the largest so far)
    assert drift.grads[0]["all parameters"] == pytest.approx(peer.group_error["all parameters"])
    assert 0 < drift.grads[0]["all parameters"] <= drift.grads[1]["all parameters"] <= drift.grads[2]["all parameters"]
    assert 0 < drift.loss[2] and 0 < drift.params


def test_a_later_step_is_judged_against_the_careful_loops_drift_and_names_its_parameter():
    """A later step whose gradients have left fp32's further than the format's later-step floor: red
    judged against fp32 alone, naming the parameter that holds the error; green where the careful
    loop on the same model and steps drifted as far; red again where it stayed close."""
    import dataclasses

    from pytest_precision.training.drift import Drift
    from pytest_precision.training.limits import db_to_error
    from pytest_precision.training.verdicts import judge_run

    m, config, peer = _later_step_case()
    collapsed = dict(m.grad_sqnr_by_step)
    collapsed[2] = {"all parameters": 3.0}  # 71 % of the gradient's size in error by step 2
    m = dataclasses.replace(m, grad_sqnr_by_step=collapsed, grad_error_in={2: {"all parameters": "2.weight"}})
    alone = [p.sentence for p in judge_run(m, config, None, None).problems]
    assert alone == ["gradient SQNR 3 dB in all parameters at step 2 < 12.1 dB (most of it in 2.weight), what "
                     "bfloat16 keeps in a correct step"]

    def drifted(db):
        grads = [dict(g) for g in peer.drift.grads]
        grads[2] = {"all parameters": db_to_error(db)}
        return dataclasses.replace(peer, drift=dataclasses.replace(peer.drift, grads=grads))

    assert judge_run(m, config, None, None, peer=drifted(2.0)).problems == []
    # a careful loop that kept nothing by then: only an error larger than the gradient fails, said
    nothing = judge_run(m, config, None, None, peer=drifted(-2.0))
    assert nothing.problems == [] and any("itself kept nothing of the gradient by then (step 2: all parameters)" in d
                                          for d in nothing.details)
    # a careful loop whose GradScaler skipped another step is an update behind: its drift widens nothing
    behind = judge_run(m, config, None, None, peer=dataclasses.replace(drifted(2.0), skipped=[0]))
    assert [p.sentence for p in behind.problems] == alone
    assert "later steps not widened by the careful loop's drift: it skipped steps 0 where this run skipped none, " \
           "so its steps are not this run's" in behind.details
    [close] = judge_run(m, config, None, None, peer=drifted(40.0)).problems
    assert close.sentence == ("gradient SQNR 3 dB in all parameters at step 2 < 11.1 dB (most of it in 2.weight), what "
                              "bfloat16 keeps in a correct step; the careful loop (standard_step) itself had left its "
                              "fp32 run by a gradient error of 0.01 by step 2 on the same model and steps, and the "
                              "limit grows by 3 x that")
    # the peer widens only after the first step; a careful loop that overflowed later widens nothing
    assert isinstance(peer.drift, Drift)
    assert judge_run(m, config, None, None, peer=drifted(float("-inf"))).problems[0].sentence == alone[0]


def test_no_step_is_held_tighter_than_its_groups_first_step_floor():
    """A group whose conditioning leaves bf16 less than the later-step floor (12.1 dB): its first step,
    and the steps after, are held to its first-step floor (8 dB here) where the later-step check read
    the format's floor at every step, the first included (a correct step at 10 dB was red there while
    the first-step check passed it). Below the group's floor it stays red."""
    import dataclasses

    from pytest_precision.training.verdicts import judge_run

    m, config, _ = _later_step_case()
    group = "all parameters"

    def at(db_by_step, floor=8.0):
        by_step = {i: {group: db_by_step.get(i, v[group])} for i, v in m.grad_sqnr_by_step.items()}
        return judge_run(dataclasses.replace(m, grad_sqnr_by_step=by_step, group_grad_sqnr_db={group: db_by_step[0]},
                                             group_floor_db={group: floor}), config, None, None).problems

    assert at({0: 10.0, 2: 10.0}) == []
    assert at({0: 10.0, 2: 10.0}, floor=40.0)  # the format's floors where the group's are higher
    [below] = at({0: 10.0, 2: 6.0})
    assert below.sentence.startswith("gradient SQNR 6 dB in all parameters at step 2 < 8")


def test_the_gradient_norm_band_is_never_narrower_than_the_models_least_first_step_floor():
    """A norm is off by at most the gradient's relative error: where a group's floor (8 dB, an error of
    0.4) is below bf16's later-step floor (12.1 dB, 0.25), a norm 1.3 x fp32's is within what a correct
    step keeps; 1.5 x is not."""
    import dataclasses

    from pytest_precision.training.verdicts import judge_run

    m, config, _ = _later_step_case()
    group = "all parameters"

    def norm(ratio, floor):
        ratios = [ratio if i == 0 else r for i, r in enumerate(m.grad_norm_ratio)]
        return [p.sentence for p in judge_run(dataclasses.replace(m, grad_norm_ratio=ratios, group_floor_db={group: floor},
                                                                  group_grad_sqnr_db={group: 20.0}),
                                              config, None, None).problems]

    assert norm(1.3, 8.0) == []
    assert norm(1.3, 40.0)[0].startswith("gradient norm 1.3 x fp32's at step 0 (a correct step stays within 0.802 to 1.25 in bfloat16)")
    assert norm(1.5, 8.0)[0].startswith("gradient norm 1.5 x fp32's at step 0 (a correct step stays within 0.715 to 1.4")


def test_a_group_with_nothing_to_judge_at_the_first_step_is_not_judged_later():
    import dataclasses

    from pytest_precision.training.verdicts import judge_run

    m, config, _ = _later_step_case()
    collapsed = dict(m.grad_sqnr_by_step)
    collapsed[2] = {"all parameters": 3.0}
    noise = dataclasses.replace(m, grad_sqnr_by_step=collapsed, unresolved={"all parameters": 4.0})
    verdict = judge_run(noise, config, None, None)
    assert verdict.problems == []
    assert any(d.startswith("gradient SQNR not judged at step 0 or later in all parameters (4 dB)")
               for d in verdict.details)
