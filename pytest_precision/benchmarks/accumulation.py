"""The accumulation and checkpointing verdicts on the built-in GPT, for correct loops and planted
defects, under every single-process training config: ``python -m pytest_precision.benchmarks.accumulation``.

Accumulation (``training.accumulation``, 2 micro-batches): the accumulated first-step gradient's
SQNR against the float64 gradient of the whole batch's mean loss, its floor, its size along it and
the micro-batches' shares, for the standard step, the standard step clipping, a loss not divided,
``optimizer.step()`` per micro-batch, ``zero_grad`` inside the loop and a GradScaler made and
unscaled per micro-batch. Checkpointing (``training.checkpointing``): the checkpointed first step's
gradients against the same step without checkpointing, for torch's checkpoint on the blocks, a
``context_fn`` that leaves autocast in the recompute and a hand-written checkpoint whose backward
does not re-enter autocast. Each row prints the verdict's problem, or ``pass``. A few minutes on a
2-core CPU (``--configs fp32,amp-bf16`` is faster).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses

import torch

from pytest_precision import standard_step
from pytest_precision.kinds.registry import get_kind
from pytest_precision.training import TRAIN_CONFIGS, TrainingError, run_training
from pytest_precision.training import split_batch
from pytest_precision.training.accumulation import exact_batch_gradients, judge_accumulation
from pytest_precision.training.checkpointing import checkpoint_blocks, judge_checkpoint

N = 2
SINGLE = ("fp32", "amp-bf16", "amp-fp16", "amp-fp16-noscale", "bf16", "bf16-sr", "fp8-e4m3")


def _finish(scaler, optimizer):
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()


def clipped(model, optimizer, scaler, batch, autocast):
    return standard_step(model, optimizer, scaler, batch, autocast, accumulate=N, max_norm=0.05)


def not_divided(model, optimizer, scaler, batch, autocast):
    optimizer.zero_grad()
    for micro in split_batch(batch, N):
        with autocast():
            loss = model(*micro)
        scaler.scale(loss).backward()
    _finish(scaler, optimizer)
    return loss


def steps_per_micro_batch(model, optimizer, scaler, batch, autocast):
    for micro in split_batch(batch, N):
        optimizer.zero_grad()
        with autocast():
            loss = model(*micro) / N
        scaler.scale(loss).backward()
        _finish(scaler, optimizer)
    return loss


def zero_grad_inside(model, optimizer, scaler, batch, autocast):
    for micro in split_batch(batch, N):
        optimizer.zero_grad()
        with autocast():
            loss = model(*micro) / N
        scaler.scale(loss).backward()
    _finish(scaler, optimizer)
    return loss


def scaler_per_micro_batch(model, optimizer, scaler, batch, autocast):
    optimizer.zero_grad()
    for micro in split_batch(batch, N):
        scaler = torch.amp.GradScaler(next(model.parameters()).device.type, enabled=scaler.is_enabled())
        with autocast():
            loss = model(*micro) / N
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    return loss


LOOPS = {"standard": None, "clipped": clipped, "not_divided": not_divided,
         "steps_per_micro_batch": steps_per_micro_batch, "zero_grad_inside": zero_grad_inside,
         "scaler_per_micro_batch": scaler_per_micro_batch}


def recompute_without_autocast():
    return contextlib.nullcontext(), torch.autocast("cpu", enabled=False)


class HandCheckpoint(torch.autograd.Function):
    """A block recomputed in the backward under autograd's autocast state (off), not the forward's."""

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


CHECKPOINTS = {"torch_checkpoint": True,
               "context_fn_without_autocast": lambda m: checkpoint_blocks(m, context_fn=recompute_without_autocast),
               "hand_written": hand_written}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(SINGLE))
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    configs = args.configs.split(",")
    gpt = next(t.fn for t in get_kind("train_step").default_targets() if t.name == "tiny_gpt")
    base = dataclasses.replace(gpt, steps=1)
    print(f"accumulation, {N} micro-batches (the built-in GPT, {args.device}, torch {torch.__version__}):")
    for name, fn in LOOPS.items():
        spec = dataclasses.replace(base, step_fn=fn, accumulate=N)
        truth = None
        for cid in configs:
            run = run_training(spec, TRAIN_CONFIGS[cid], args.device)
            if truth is None:
                step = run.first_step
                truth = exact_batch_gradients(spec, step, args.device, rng_state=run.rng_states[step])
            c = judge_accumulation(spec, TRAIN_CONFIGS[cid], run, truth)
            shares = ", ".join(f"{s:.4f}" for s in c.shares)
            print(f"  {name:24s} {cid:18s} SQNR {c.sqnr_db:8.2f} dB (floor {c.floor_db:5.1f}) {c.ratio:7.4f} x, shares "
                  f"{shares}: {c.problem.sentence if c.problem else 'pass'}")
    print(f"checkpointing (the built-in GPT, {args.device}):")
    for name, how in CHECKPOINTS.items():
        spec = dataclasses.replace(base, checkpoint=how)
        for cid in configs:
            run = run_training(spec, TRAIN_CONFIGS[cid], args.device)
            try:
                c = judge_checkpoint(spec, TRAIN_CONFIGS[cid], run, args.device)
                print(f"  {name:28s} {cid:18s} {c.detail}: {c.problem.sentence if c.problem else 'pass'}")
            except TrainingError as e:
                print(f"  {name:28s} {cid:18s} raised: {e}")


if __name__ == "__main__":
    main()
