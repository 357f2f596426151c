"""The train_step kind's DDP cases (configs ``ddp-fp16`` and ``ddp-bf16``): a target's gradients
all-reduced through DDP's fp16 or bf16 compression hook against uncompressed DDP, on the real
engine (pytest_precision.training.distributed: two processes, gloo on the CPU, nccl on GPUs). One
group of processes serves both hooks; the memo, the skips and the shared checks are the
distributed one-step case's (distributed_case.py).

The ranks run the spec's own forward and loss (``TrainSpec.loss``: its ``loss_fn``, else the
model's output), never its ``step_fn``; a model whose output is not a loss and a spec the spawned
ranks cannot import (``model_fn`` or ``loss_fn`` not module-level) are skipped with the reason and
what to add.

A case fails when a compressed gradient is not finite where the uncompressed one is; when more
than 5 % of a parameter's significant gradients within the hook dtype's normal range are 0 with
the hook (counted in elements, past a count's spread between machines: training.limits) (judged against the exact all-reduced gradient: a parameter whose exact gradient is 0,
such as the key part of an attention bias, is not counted; gradients below the range are shown);
when the SQNR of the gradients is below what the format's precision gives a correct all-reduce
(6.02 dB per mantissa bit, less 6 dB for the 16-bit sum and the division by the world size:
54 dB for fp16, 36 dB for bf16); and against the golden (``training.baseline.DDPEntry``).
"""
from __future__ import annotations

import torch

from pytest_precision.kinds import Memo
from pytest_precision.training import TrainConfig, TrainSpec
from pytest_precision.kinds.training import (DDP_MARGIN_DB, HookComparison, compare_ddp_hooks, rates_line,
                                             sqnr_floor_db as _floor)

from .distributed_case import DistributedCase, OneStepEvidence, SqnrFloor, below_range_lines, one_step_record

__all__ = ["DDPCase", "DDP_CASE", "DDPEvidence", "run_case", "sqnr_floor_db"]


def sqnr_floor_db(dtype: torch.dtype) -> float:
    """The least SQNR a correct compressed all-reduce keeps (the module docstring)."""
    return _floor(dtype, DDP_MARGIN_DB)


class DDPEvidence(OneStepEvidence):
    """A compression hook's all-reduced gradients against uncompressed DDP."""

    result: HookComparison

    def record_fields(self, outcome) -> dict:
        r = self.result
        return one_step_record(r.underflow_rate, r.underflow_elements, r.grad_sqnr_db, ddp=r.as_dict())

    def message_lines(self, outcome) -> list[str]:
        r, c = self.result, self.config
        return [f"  {c.id}: {c.description}:",
                f"    gradients: SQNR {r.grad_sqnr_db:.4g} dB (floor {sqnr_floor_db(c.compute_dtype):.4g} dB), max rel "
                f"{r.max_rel:.4g}, overflow {r.overflow}, norm {r.grad_norm:.4g} vs {r.ref_grad_norm:.4g} uncompressed",
                rates_line("gradient-underflow rate (0 with the hook, significant in the exact all-reduced gradient)",
                           r.underflow_rate, r.underflow_elements),
                *below_range_lines(r, f"lost below {c.ddp_hook}'s normal range (the hook has no loss scaling; shown)")]


class DDPCase(DistributedCase):
    """The DDP cases: one ``compare_ddp_hooks`` per spec and device, a result per hook."""

    engine, memo = "DDP", Memo("(spec, device) -> {hook: HookComparison} or why not")
    ran, reference = "with the hook", "without"

    def compare(self, spec: TrainSpec, device: str) -> dict[str, HookComparison]:
        return compare_ddp_hooks(spec, device=device)

    def result_key(self, config: TrainConfig) -> str:
        return config.ddp_hook

    def sqnr_floor(self, config: TrainConfig, result: HookComparison) -> SqnrFloor:
        return SqnrFloor({"": result.grad_sqnr_db}, sqnr_floor_db(config.compute_dtype),
                         f"{config.ddp_hook} keeps in a correct all-reduce")

    def evidence(self, config: TrainConfig, result: HookComparison) -> DDPEvidence:
        return DDPEvidence(config, result)


DDP_CASE = DDPCase()
run_case = DDP_CASE.run_case
