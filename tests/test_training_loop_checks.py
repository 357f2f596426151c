"""Two training-loop defects a golden recorded from the defective code would accept, caught or
named: a float16 loss scale stuck where gradients underflow (judged with no golden, against the
float64 first step: ``training.loss_scale``), and a gradient-accumulation change that moves the
fp32 reference, read from the first step's gradient-norm and loss ratios against the golden's
(``training.moved``). Small models, few steps: each pytester session takes about a second."""
import math

import pytest
import torch

from test_training_suite import HEADER, _run

pytest_plugins = ["pytester"]

# the Net's loss times 1e-2: gradients of 1e-5 to 1e-3, where float16 needs a loss scale (a scale
# of 1 costs only 4 dB of gradient SQNR here, 62.8 dB against 66.7, inside fp16's 48.2 dB floor)
SCALERS = HEADER + """
OWN = {}


def own_scaler(init_scale):
    # the loop's own GradScaler, not the one the harness hands the step (as a training script builds it)
    def step(model, optimizer, scaler, batch, autocast):
        scaler = OWN.setdefault(init_scale, torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=10**9))
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
"""


def test_a_loss_scale_stuck_where_gradients_underflow_fails_with_no_golden(pytester):
    pytester.makeconftest(SCALERS)
    # a first run: no golden exists, and the update accepts what passes the absolute verdicts
    result = _run(pytester, "--precision-configs=amp-fp16", "-k", "amp-fp16-trajectory", "--precision-update-baselines")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines([
        "*train_step[[]stuck_at_1-amp-fp16-trajectory[]]: FAIL underflow* (loss scale 1 at step 0 (history 1, 1, 1, 1, "
        "never grew) leaves 336 of 512 elements (65.6 %) of fc1.weight's float64 first-step gradients below float16's "
        "normal range (6.1e-05) that 65536, the scale a working GradScaler runs at here, keeps in it > 5 % allowed (up "
        "to 46 elements); in all 408 of 808 significant gradients below it at 1 (0 flushed to 0), 0 at 65536; torch's "
        "default GradScaler starts at 65536 and backs off only on an overflow, and these gradients stay finite in "
        "float16 up to 2^25: use the default GradScaler, or one that grows (growth_interval) from a lower init_scale*",
        "    loss scale: 1, 1, 1, 1, never grew; at step 0, 408 of 808 significant float64 gradients below float16's "
        "normal range, 0 at 65536 (a working GradScaler's scale here)",
    ])
    # a scale that never grows but keeps every gradient in range is not a defect: a correct
    # GradScaler does not grow in 4 steps either
    result.stdout.fnmatch_lines(["| default_scaler *| amp-fp16 *|*| pass *|", "| stuck_at_1 *| amp-fp16 *|*| FAIL underflow*|",
                                 "| stuck_at_65536 *| amp-fp16 *|*| pass *|"])


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
    assert scale_problem(stuck).startswith("loss scale 1024 at step 0 (history 1024, 1024, 1024, 1024, 1024, 1024, "
                                           "1024, never grew) leaves 254 of 1000 elements (25.4 %) of w's float64")
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
MOVED = "*FAIL regression (golden: the fp32 reference moved against cpu-*'s (relative tolerance 1e-05): first-step gradient norm"


def test_an_accumulation_change_names_what_moved_in_the_fp32_reference(pytester):
    def session(**planted):
        pytester.makeconftest(ACCUMULATION.format(**{**CORRECT, **planted}))
        return _run(pytester, "--precision-configs=fp32")

    pytester.makeconftest(ACCUMULATION.format(**CORRECT))
    _run(pytester, "--precision-configs=fp32", "--precision-update-baselines").assert_outcomes(passed=1)
    undivided = session(DIVIDE="")
    undivided.assert_outcomes(failed=1)
    undivided.stdout.fnmatch_lines([MOVED + " 2.00 x the golden's, loss 2.00 x: exactly the 2 micro-batches a step "
                                    "accumulates: the loss is no longer divided by the number of micro-batches; "
                                    "first-step gradient norm of fc*: the model, data, optimizer, training loop or torch "
                                    "changed the fp32 run itself, not its precision)"])
    inside = session(ZERO_GRAD="optimizer.zero_grad()")
    inside.assert_outcomes(failed=1)
    inside.stdout.fnmatch_lines([MOVED + " 0.64 x the golden's, loss 1.00 x: near 1/2 to 1/sqrt(2) for the 2 "
                                 "micro-batches a step accumulates, with the loss unchanged: as when only the last "
                                 "micro-batch's gradient is kept (zero_grad inside the accumulation loop); *"])
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
                   "only the last micro-batch's gradient is kept (zero_grad inside the accumulation loop)"),
    (0.31, 1.0, 1, None),  # no accumulation: nothing to read
    (1.37, 1.37, 1, "loss and gradient by the same factor: the loss is multiplied by 1.37"),
    (1.004, 0.99998, 1, None),  # a model change: the ratios alone
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
