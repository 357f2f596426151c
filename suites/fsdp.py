"""The train_step kind's FSDP2 cases (configs ``fsdp-bf16``, ``fsdp-bf16-reduce-bf16``,
``fsdp-fp16-reduce-fp16``): one forward/backward of a target under
``fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype, reduce_dtype))`` on two processes
(gloo on the CPU, nccl on GPUs), each on half of ``batch_fn(0)``, against the same data in one
process in fp32, the rates against float64 (pytest_precision.training.fsdp). One group of
processes serves every FSDP2 config of a target; the memo, the skips and the shared checks are
the distributed one-step case's (distributed_case.py).

The ranks run the spec's own forward and loss (``TrainSpec.loss``), never its ``step_fn``; a model
whose output is not a loss, a spec the spawned ranks cannot import and a batch whose tensors do not
split evenly between the ranks are skipped with the reason and what to change.

A case fails when a gradient is not finite where fp32's is, or the loss is not finite; when more
than 5 % of a parameter's significant gradients within ``param_dtype``'s normal range are 0
(counted in elements, past a count's spread between machines: training.limits; gradients below
the range are shown: fp16 without loss scaling cannot hold them); when the gradients' SQNR in some
optimizer parameter group is below the first-step floor of ``param_dtype`` (what a correct step
keeps: ``limits.first_step_floor_db``, 30.1 dB for bf16, 48.2 dB for fp16); when the loss
deviates from fp32's by more than the config's ``loss_rtol``; and against the golden
(``training.baseline.DDPEntry``: the SQNR of all gradients, the rates, the overflow count).
"""
from __future__ import annotations

import math

from pytest_precision.kinds import Memo, Problem
from pytest_precision.training import TRAIN_CONFIGS, TrainConfig, TrainSpec
from pytest_precision.kinds.training import (BatchShardError, FSDPComparison, HookComparison, compare_fsdp,
                                             first_step_floor_db, rates_line, unresolved_reason)

from .distributed_case import DistributedCase, OneStepEvidence, SqnrFloor, below_range_lines, one_step_record

__all__ = ["FSDPCase", "FSDP_CASE", "FSDPEvidence", "run_case"]


def _g(v: float) -> str:
    return f"{v:.4g}"


class FSDPEvidence(OneStepEvidence):
    """An FSDP2 policy's gathered gradients against single-process fp32."""

    result: FSDPComparison

    def record_fields(self, outcome) -> dict:
        g, groups = self.result.gradients, self.result.group_grad_sqnr_db
        return one_step_record(g.underflow_rate, g.underflow_elements, min(groups.values(), default=g.grad_sqnr_db),
                               max_loss_deviation=self.result.loss_deviation, group_grad_sqnr_db=dict(groups),
                               fsdp=self.result.as_dict())

    def message_lines(self, outcome) -> list[str]:
        r, c = self.result, self.config
        g = r.gradients
        floor = first_step_floor_db(c.compute_dtype)
        groups = ", ".join(f"{name} {_g(v)} dB" for name, v in r.group_grad_sqnr_db.items())
        return [f"  {c.id}: {c.description}, each rank on half of batch_fn(0), one step:",
                f"    gradients: SQNR {groups} (floor {floor:.3g} dB for {r.param_dtype}), "
                f"{_g(r.exact_grad_sqnr_db)} dB against float64; max rel {_g(g.max_rel)}, overflow {g.overflow}, norm {_g(g.grad_norm)} vs "
                f"{_g(g.ref_grad_norm)} fp32",
                f"    loss (the ranks' mean) {_g(r.loss)} vs {_g(r.ref_loss)} fp32: deviation {r.loss_deviation:.3g} "
                f"(limit {c.loss_rtol:g})",
                rates_line(f"gradient-underflow rate (0 here, significant in float64, within {r.param_dtype}'s range)",
                           g.underflow_rate, g.underflow_elements),
                *below_range_lines(g, f"lost below {r.param_dtype}'s normal range (no loss scaling; shown)")]


class FSDPCase(DistributedCase):
    """The FSDP2 cases: one ``compare_fsdp`` per spec and device over every FSDP2 config's policy,
    a result per config; the loss judged besides the gradients."""

    engine, memo = "FSDP2", Memo("(spec, device) -> {config id: FSDPComparison} or why not")
    skip_errors = (BatchShardError, TypeError)
    ran, reference = "under FSDP2", "in fp32"

    def compare(self, spec: TrainSpec, device: str) -> dict[str, FSDPComparison]:
        policies = {c.id: c.fsdp for c in TRAIN_CONFIGS.values() if c.fsdp is not None}
        return compare_fsdp(spec, policies, device=device)

    def result_key(self, config: TrainConfig) -> str:
        return config.id

    def gradients(self, result: FSDPComparison) -> HookComparison:
        return result.gradients

    def sqnr_floor(self, config: TrainConfig, result: FSDPComparison) -> SqnrFloor:
        """Per optimizer parameter group, below the format's floor where the group's own conditioning
        sets a lower one (compare.group_floors)."""
        return SqnrFloor(result.group_grad_sqnr_db, first_step_floor_db(config.compute_dtype),
                         f"{result.param_dtype} keeps in a correct step", own=result.group_floor_db)

    def evidence(self, config: TrainConfig, result: FSDPComparison) -> FSDPEvidence:
        return FSDPEvidence(config, result)

    def problems(self, config: TrainConfig, result: FSDPComparison) -> list[Problem]:
        """A non-finite loss, the gradients' checks, then the loss against fp32's."""
        loss, out = result.loss, []
        if not math.isfinite(loss):
            out.append(Problem("oracle", "nan" if math.isnan(loss) else "overflow",
                               f"non-finite loss {loss:g} under FSDP2"))
        out += super().problems(config, result)
        if math.isfinite(loss) and not result.loss_deviation <= config.loss_rtol:
            out.append(Problem("oracle", "accuracy", f"loss deviates from fp32 by {result.loss_deviation:.3g} "
                                                     f"(relative) > {config.loss_rtol:g} allowed for {config.id}"))
        return out

    def details(self, config: TrainConfig, result: FSDPComparison) -> list[str]:
        if not result.unresolved:
            return []
        groups = ", ".join(f"{name} ({v:.3g} dB)" for name, v in sorted(result.unresolved.items()))
        return [f"gradient SQNR not judged in {groups}: {unresolved_reason(result.param_dtype)}"]


FSDP_CASE = FSDPCase()
run_case = FSDP_CASE.run_case
