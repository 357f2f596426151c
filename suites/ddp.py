"""The train_step kind's DDP cases (configs ``ddp-fp16`` and ``ddp-bf16``): a target's gradients
all-reduced through DDP's fp16 or bf16 compression hook against uncompressed DDP, on the real
engine (pytest_precision.training.distributed: two processes, gloo on the CPU, nccl on GPUs).

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

from pytest_precision.baselines.lifecycle import BaselineCheck
from pytest_precision.kinds.cases import Case
from pytest_precision.kinds.kind import skip
from pytest_precision.kinds.outcome import Evidence, Outcome, baseline_problems
from pytest_precision.kinds.target import TargetError
from pytest_precision.training import LossContractError, TrainConfig, TrainingError, TrainSpec
from pytest_precision.training.baseline import DDPEntry, rates_line
from pytest_precision.training.distributed import HookComparison, RankRunError, compare_ddp_hooks
from pytest_precision.training.limits import DDP_MARGIN_DB, UNDERFLOW_LIMIT, limit_sentence, sqnr_floor_db as _floor

__all__ = ["DDPEvidence", "run_case", "sqnr_floor_db"]

# the session's memo (Case.state): (spec, device) -> {hook: HookComparison} or the reason the spec
# cannot run under DDP; one group of processes serves both hooks
RESULTS = "train_step.ddp"


def sqnr_floor_db(dtype: torch.dtype) -> float:
    """The least SQNR a correct compressed all-reduce keeps (the module docstring)."""
    return _floor(dtype, DDP_MARGIN_DB)


def _comparisons(case: Case, spec: TrainSpec, where: str) -> dict | str:
    runs, key = case.state.memo(RESULTS), (spec, case.device)
    if key not in runs:
        try:
            runs[key] = compare_ddp_hooks(spec, device=case.device)
        except LossContractError as e:  # the forward is not a loss: the step_fn cannot be split
            runs[key] = (f"the DDP cases run forward and loss under DDP, not the step_fn, and {e}")
        except TypeError as e:  # callables the spawned processes cannot import
            runs[key] = str(e)
        except (RankRunError, TrainingError) as e:  # TrainingError: a callable changed torch's state
            raise TargetError(f"{where}: {e}") from e
    return runs[key]


def worst_rate(rates: dict[str, float]) -> tuple[str, float]:
    """The parameter with the highest underflow rate and the rate, or ("-", 0.0) where none lost any."""
    name = max(rates, key=lambda n: (rates[n], n)) if rates else None
    return (name, rates[name]) if name is not None and rates[name] > 0 else ("-", 0.0)


def one_step_record(rates: dict[str, float], elements: dict, grad_sqnr_db: float, **fields) -> dict:
    """The training table's record of a case that judges one distributed step (DDP, FSDP2): no
    trajectory, its gradients' SQNR and worst underflow rate; ``fields`` adds or overrides."""
    name, rate = worst_rate(rates)
    return {"training": {"steps": 1, "max_loss_deviation": None, "grad_sqnr_db": grad_sqnr_db,
                         "underflow_elements": elements.get(name), "param_sqnr_db": None, "max_underflow_rate": rate,
                         "underflow_param": name, "max_update_lost_rate": 0.0, "update_lost_param": "-",
                         "update_ratio": None, "skipped_steps": [], "first_nonfinite": None, "step_time_s": None,
                         "fp32_step_time_s": None, **fields}}


class DDPEvidence(Evidence):
    """A compression hook's all-reduced gradients against uncompressed DDP."""

    def __init__(self, config: TrainConfig, result: HookComparison):
        self.config, self.result = config, result

    def record_fields(self, outcome) -> dict:
        r = self.result
        return one_step_record(r.underflow_rate, r.underflow_elements, r.grad_sqnr_db, ddp=r.as_dict())

    def message_lines(self, outcome) -> list[str]:
        r, c = self.result, self.config
        lines = [f"  {c.id}: {c.description}:",
                 f"    gradients: SQNR {r.grad_sqnr_db:.4g} dB (floor {sqnr_floor_db(c.compute_dtype):.4g} dB), max rel "
                 f"{r.max_rel:.4g}, overflow {r.overflow}, norm {r.grad_norm:.4g} vs {r.ref_grad_norm:.4g} uncompressed",
                 rates_line("gradient-underflow rate (0 with the hook, significant in the exact all-reduced gradient)",
                            r.underflow_rate, r.underflow_elements)]
        if any(r.below_range_underflow.values()):
            lines.append(rates_line(f"lost below {c.ddp_hook}'s normal range (the hook has no loss scaling; shown)",
                                    r.below_range_underflow, r.below_range_elements))
        return lines


def run_case(kind, case: Case, spec: TrainSpec, baseline: BaselineCheck) -> Outcome:
    config = case.config
    where = f"target {case.target.name!r} (train_step) under config {config.id}"
    results = _comparisons(case, spec, where)
    if isinstance(results, str):
        skip(f"{case.target.name}: {results}")
    r = results[config.ddp_hook]
    evidence = DDPEvidence(config, r)
    outcome = Outcome(kind.suite, kind.name, case.target.name, config.id, case.regime, evidence,
                      baseline.check(DDPEntry(config, r)))
    if r.overflow:
        outcome.add("oracle", "overflow", f"{r.overflow} gradient elements not finite with the hook, finite without")
    sentence = limit_sentence("gradient-underflow rate", r.underflow_rate, r.underflow_elements, UNDERFLOW_LIMIT)
    if sentence:
        outcome.add("oracle", "underflow", sentence)
    floor = sqnr_floor_db(config.compute_dtype)
    if not r.overflow and not r.grad_sqnr_db >= floor:
        outcome.add("oracle", "accuracy", f"gradient SQNR {r.grad_sqnr_db:.4g} dB < {floor:.4g} dB, what "
                                          f"{config.ddp_hook} keeps in a correct all-reduce")
    outcome.problems += baseline_problems(outcome.baseline)
    return outcome
