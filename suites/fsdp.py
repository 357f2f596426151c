"""The train_step kind's FSDP2 cases (configs ``fsdp-bf16``, ``fsdp-bf16-reduce-bf16``,
``fsdp-fp16-reduce-fp16``): one forward/backward of a target under
``fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype, reduce_dtype))`` on two processes
(gloo on the CPU, nccl on GPUs), each on half of ``batch_fn(0)``, against the same data in one
process in fp32, the rates against float64 (pytest_precision.training.fsdp). One group of
processes serves every FSDP2 config of a target.

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

from pytest_precision.baselines.lifecycle import BaselineCheck
from pytest_precision.kinds.cases import Case
from pytest_precision.kinds.kind import skip
from pytest_precision.kinds.outcome import Evidence, Outcome, baseline_problems
from pytest_precision.kinds.target import TargetError
from pytest_precision.training import TRAIN_CONFIGS, LossContractError, TrainConfig, TrainingError, TrainSpec
from pytest_precision.training.baseline import DDPEntry, rates_line
from pytest_precision.training.compare import unresolved_reason
from pytest_precision.training.distributed import RankRunError
from pytest_precision.training.fsdp import BatchShardError, FSDPComparison, compare_fsdp
from pytest_precision.training.limits import UNDERFLOW_LIMIT, first_step_floor_db, limit_sentence

from .ddp import one_step_record

__all__ = ["FSDPEvidence", "run_case"]

# the session's memo (Case.state): (spec, device) -> {config id: FSDPComparison} or the reason the
# spec cannot run under FSDP2; one group of processes serves every FSDP2 config
RESULTS = "train_step.fsdp"


def _comparisons(case: Case, spec: TrainSpec, where: str) -> dict | str:
    runs, key = case.state.memo(RESULTS), (spec, case.device)
    if key not in runs:
        policies = {c.id: c.fsdp for c in TRAIN_CONFIGS.values() if c.fsdp is not None}
        try:
            runs[key] = compare_fsdp(spec, policies, device=case.device)
        except LossContractError as e:  # the forward is not a loss: the step_fn cannot be split
            runs[key] = f"the FSDP2 cases run forward and loss under FSDP2, not the step_fn, and {e}"
        except BatchShardError as e:
            runs[key] = str(e)
        except TypeError as e:  # callables the spawned processes cannot import
            runs[key] = str(e)
        except (RankRunError, TrainingError) as e:  # TrainingError: a callable changed torch's state
            raise TargetError(f"{where}: {e}") from e
    return runs[key]


def _g(v: float) -> str:
    return f"{v:.4g}"


class FSDPEvidence(Evidence):
    """An FSDP2 policy's gathered gradients against single-process fp32."""

    def __init__(self, config: TrainConfig, result: FSDPComparison):
        self.config, self.result = config, result

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
        lines = [f"  {c.id}: {c.description}, each rank on half of batch_fn(0), one step:",
                 f"    gradients: SQNR {groups} (floor {floor:.3g} dB for {r.param_dtype}), "
                 f"{_g(r.exact_grad_sqnr_db)} dB against float64; max rel {_g(g.max_rel)}, overflow {g.overflow}, norm {_g(g.grad_norm)} vs "
                 f"{_g(g.ref_grad_norm)} fp32",
                 f"    loss (the ranks' mean) {_g(r.loss)} vs {_g(r.ref_loss)} fp32: deviation {r.loss_deviation:.3g} "
                 f"(limit {c.loss_rtol:g})",
                 rates_line(f"gradient-underflow rate (0 here, significant in float64, within {r.param_dtype}'s range)",
                            g.underflow_rate, g.underflow_elements)]
        if any(g.below_range_underflow.values()):
            lines.append(rates_line(f"lost below {r.param_dtype}'s normal range (no loss scaling; shown)",
                                    g.below_range_underflow, g.below_range_elements))
        return lines


def run_case(kind, case: Case, spec: TrainSpec, baseline: BaselineCheck) -> Outcome:
    config = case.config
    where = f"target {case.target.name!r} (train_step) under config {config.id}"
    results = _comparisons(case, spec, where)
    if isinstance(results, str):
        skip(f"{case.target.name}: {results}")
    r = results[config.id]
    g = r.gradients
    outcome = Outcome(kind.suite, kind.name, case.target.name, config.id, case.regime, FSDPEvidence(config, r),
                      baseline.check(DDPEntry(config, g)))
    if not math.isfinite(r.loss):
        outcome.add("oracle", "nan" if math.isnan(r.loss) else "overflow", f"non-finite loss {r.loss:g} under FSDP2")
    if g.overflow:
        outcome.add("oracle", "overflow", f"{g.overflow} gradient elements not finite under FSDP2, finite in fp32")
    sentence = limit_sentence("gradient-underflow rate", g.underflow_rate, g.underflow_elements, UNDERFLOW_LIMIT)
    if sentence:
        outcome.add("oracle", "underflow", sentence)
    floor = first_step_floor_db(config.compute_dtype)
    floors = {name: min(floor, r.group_floor_db.get(name, floor)) for name in r.group_grad_sqnr_db}
    low = {name: v for name, v in r.group_grad_sqnr_db.items() if not v >= floors[name]}
    if low and not g.overflow:
        if all(floors[name] == floor for name in low):
            parts = ", ".join(f"{v:.4g} dB in {name}" for name, v in sorted(low.items())) + f" < {floor:.4g} dB"
        else:  # a group's own conditioning set its floor (compare.group_floors)
            parts = ", ".join(f"{v:.4g} dB in {name} < {floors[name]:.4g} dB" for name, v in sorted(low.items()))
        outcome.add("oracle", "accuracy", f"gradient SQNR {parts}, what {r.param_dtype} keeps in a correct step")
    if r.unresolved:
        groups = ", ".join(f"{name} ({v:.3g} dB)" for name, v in sorted(r.unresolved.items()))
        outcome.details.append(f"gradient SQNR not judged in {groups}: {unresolved_reason(r.param_dtype)}")
    if math.isfinite(r.loss) and not r.loss_deviation <= config.loss_rtol:
        outcome.add("oracle", "accuracy", f"loss deviates from fp32 by {r.loss_deviation:.3g} (relative) > "
                                          f"{config.loss_rtol:g} allowed for {config.id}")
    outcome.problems += baseline_problems(outcome.baseline)
    return outcome
