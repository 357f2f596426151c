"""Activation checkpointing (``training.checkpointing``): a spec with ``TrainSpec(checkpoint=...)``
runs its first step checkpointed and compares the gradients with the same step without
checkpointing, in the same config: torch's checkpoint on the model's blocks gives the same bits;
a recompute outside the forward's autocast state (a hand-written checkpoint whose backward does not
re-enter autocast, a ``context_fn`` that leaves it) fails naming the cause. Two blocks, 2 steps."""
import pytest
from torch import nn

from training_helpers import run_suite

pytest_plugins = ["pytester"]

BLOCKS = """
import contextlib
import torch
import torch.nn.functional as F
from torch import nn
import pytest_precision
from pytest_precision.numerics.inputs import seeded_normal
from pytest_precision.training import checkpoint_blocks


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + self.fc(torch.relu(self.norm(x)))


class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(16, 8)

    def forward(self, x, y):
        x = self.inp(x).float()  # the residual stream in float32, as GPTs keep it
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(x), y)


def batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return seeded_normal(g, 64, 16), seeded_normal(g, 64, 8)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


class HandCheckpoint(torch.autograd.Function):
    # a hand-written checkpoint: the forward keeps only the block's input; the backward recomputes the
    # block under autograd's autocast state (off), not the forward's, and casts to make the dtypes meet
    @staticmethod
    def forward(ctx, x, block):
        ctx.block = block
        ctx.save_for_backward(x)
        with torch.no_grad():
            return block.plain_forward(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            y = ctx.block.plain_forward(x)
        params = list(ctx.block.parameters())
        grads = torch.autograd.grad(y, [x] + params, grad.to(y.dtype))
        for p, g in zip(params, grads[1:]):
            p.grad = g if p.grad is None else p.grad + g
        return grads[0].to(x.dtype), None


def hand_written(model):
    for block in model.blocks:
        block.plain_forward = block.forward
        block.forward = lambda x, block=block: HandCheckpoint.apply(x, block)


def recompute_without_autocast():
    return contextlib.nullcontext(), torch.autocast("cpu", enabled=False)


def spec(checkpoint):
    return pytest_precision.TrainSpec(Deep, sgd, batch, steps=2, checkpoint=checkpoint)


pytest_precision.register("blocks_found", spec(True), kind="train_step")
pytest_precision.register("blocks_named", spec("blocks"), kind="train_step")
pytest_precision.register("hand_written", spec(hand_written), kind="train_step")
pytest_precision.register("context_fn", spec(lambda m: checkpoint_blocks(m, context_fn=recompute_without_autocast)),
                          kind="train_step")
"""


def test_checkpointed_steps_against_the_same_step_without_checkpointing(pytester):
    pytester.makeconftest(BLOCKS)
    result = run_suite(pytester, "--precision-configs=fp32,amp-bf16", "--precision-update-baselines")
    result.stdout.fnmatch_lines([
        # a recompute in float32 of what the forward ran in bfloat16: other gradients, and the cause
        "*train_step[[]hand_written-amp-bf16-trajectory[]]: FAIL accuracy (checkpointed step 0's gradients differ from "
        "the same step without checkpointing under amp-bf16: SQNR * dB, max abs *, most in * (expected bit for bit, as "
        "the step without checkpointing repeats itself): the recompute of blocks.1.norm ran with autocast off where "
        "its forward ran under autocast bfloat16: a recompute outside the forward's autocast state computes in other "
        "dtypes than the forward did; recompute under the forward's autocast state (torch.utils.checkpoint restores "
        "it; a "
        "context_fn or a hand-written checkpoint must keep it))",
        # torch's own check refuses the recompute's other dtypes: the same cause, with torch's words
        "*train_step[[]context_fn-amp-bf16-trajectory[]]: FAIL accuracy (the checkpointed step 0 under amp-bf16 raised "
        "CheckpointError: torch.utils.checkpoint: Recomputed values for the following tensors have different metadata "
        "than during the forward pass.: the recompute of blocks.1.norm ran with autocast off where its forward ran "
        "under autocast bfloat16: a recompute outside the forward's autocast state *",
    ])
    # without autocast the recompute's state is the forward's: every checkpoint is right in fp32
    result.stdout.fnmatch_lines(["| blocks_found *| fp32 *|*| pass *|", "| blocks_found *| amp-bf16 *|*| pass *|",
                                 "| blocks_named *| fp32 *|*| pass *|", "| blocks_named *| amp-bf16 *|*| pass *|",
                                 "| context_fn *| fp32 *|*| pass *|", "| context_fn *| amp-bf16 *|*| FAIL accuracy *|",
                                 "| hand_written *| fp32 *|*| pass *|",
                                 "| hand_written *| amp-bf16 *|*| FAIL accuracy *|"])
    result.assert_outcomes(passed=6, failed=2)


def test_checkpoint_blocks_finds_the_block_list_and_says_when_there_is_none():
    from pytest_precision.training.checkpointing import apply_checkpoint, find_blocks

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList([nn.Linear(2, 2)])
            self.h = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    assert find_blocks(Model())[0] == "h"  # the list of one class holding the most parameters
    with pytest.raises(ValueError, match="has no nn.ModuleList of blocks to checkpoint; name the list"):
        apply_checkpoint(True, nn.Linear(2, 2))
    with pytest.raises(ValueError, match="has no submodule 'transformer.h'"):
        apply_checkpoint("transformer.h", Model())
    with pytest.raises(TypeError, match="TrainSpec.checkpoint must be True, the name"):
        from pytest_precision import TrainSpec
        TrainSpec(lambda: None, lambda p: None, lambda i: None, checkpoint=3)
