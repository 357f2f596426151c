"""The train_step kind's distributed one-step cases, written once: DDP's compression hooks
(ddp.py) and FSDP2 mixed precision (fsdp.py) each judge one forward/backward of a target on
spawned ranks (pytest_precision.training.distributed: gloo on the CPU, nccl on GPUs) against a
reference, and supply only what differs (a :class:`DistributedCase`: how the comparison runs, the
floor its gradients are held to, its evidence lines, any check of its own).

One comparison per (spec, device) in the session serves every config of the engine (one group of
processes; the session's memo, ``Case.state``). The ranks run the spec's own forward and loss
(``TrainSpec.loss``), never its ``step_fn``: a model whose output is not a loss, callables the
spawned ranks cannot import (``model_fn`` or ``loss_fn`` not module-level) and what an engine
adds (FSDP2: a batch that does not split evenly) are skipped with the reason and what to change.
A rank that fails or runs out of time (``training.distributed.RankRunError``) and a callable that
changes torch's process-wide state (``TrainingError``) are errors of the target.

The gradient checks both engines make, in this order after the engine's own first ones: a
gradient not finite where the reference's is (``overflow``); more than 5 % of a parameter's
significant gradients within the format's normal range 0 (``underflow``, counted in elements,
past a count's spread between machines: training.limits); the gradients' SQNR below the engine's
floor (``accuracy``; not judged once a gradient overflowed). Then the engine's later checks, and
the golden (``training.baseline.DDPEntry``, on the gradients' comparison). Each check returns
``Problem`` objects, which the case adds to its outcome.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pytest_precision.kinds import (BaselineCheck, Case, Evidence, Memo, Outcome, Problem, TargetError,
                                    baseline_problems, skip)
from pytest_precision.training import LossContractError, TrainConfig, TrainingError, TrainSpec
from pytest_precision.kinds.training import (DDPEntry, HookComparison, RankRunError, UNDERFLOW_LIMIT, limit_problem,
                                             rates_line)

__all__ = ["DistributedCase", "OneStepEvidence", "SqnrFloor", "gradient_problems", "one_step_record",
           "worst_rate", "below_range_lines"]


@dataclass(frozen=True)
class SqnrFloor:
    """What the accuracy check holds the gradients' SQNR to: the SQNR by where it was measured (an
    optimizer parameter group's name, or "" for all gradients together), the format's floor, a lower
    floor where a group's own conditioning sets one, and what keeps it ("fp16 keeps in a correct
    all-reduce"), which ends the sentence."""

    measured: dict[str, float]
    floor: float
    keeps: str
    own: dict[str, float] = field(default_factory=dict)

    def problems(self) -> list[Problem]:
        floors = {name: min(self.floor, self.own.get(name, self.floor)) for name in self.measured}
        low = {name: v for name, v in self.measured.items() if not v >= floors[name]}
        if not low:
            return []

        def at(name: str) -> str:
            return f" in {name}" if name else ""

        if all(floors[name] == self.floor for name in low):
            parts = ", ".join(f"{v:.4g} dB{at(name)}" for name, v in sorted(low.items())) + f" < {self.floor:.4g} dB"
        else:  # a group's own conditioning set its floor (compare.group_floors)
            parts = ", ".join(f"{v:.4g} dB{at(name)} < {floors[name]:.4g} dB" for name, v in sorted(low.items()))
        return [Problem("oracle", "accuracy", f"gradient SQNR {parts}, what {self.keeps}")]


def gradient_problems(g: HookComparison, floor: SqnrFloor, ran: str, reference: str) -> list[Problem]:
    """The checks both engines make on the gradients (the module docstring): overflow, the
    underflow limit, the SQNR floor. ``ran`` and ``reference`` name the two sides in the overflow
    sentence ("with the hook", "without")."""
    out = []
    if g.overflow:
        out.append(Problem("oracle", "overflow", f"{g.overflow} gradient elements not finite {ran}, "
                                                 f"finite {reference}"))
    underflow = limit_problem("gradient-underflow rate", g.underflow_rate, g.underflow_elements, UNDERFLOW_LIMIT,
                              "underflow")
    if underflow:
        out.append(underflow)
    if not g.overflow:
        out += floor.problems()
    return out


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


def below_range_lines(g: HookComparison, label: str) -> list[str]:
    """The rates lost below the format's normal range, where any (shown, not judged)."""
    if any(g.below_range_underflow.values()):
        return [rates_line(label, g.below_range_underflow, g.below_range_elements)]
    return []


class OneStepEvidence(Evidence):
    """One config's comparison, from the engine's comparison of every config."""

    def __init__(self, config: TrainConfig, result):
        self.config, self.result = config, result


class DistributedCase:
    """One distributed engine's cases. A subclass sets the class attributes and supplies
    ``compare``, ``result_key``, ``gradients``, ``sqnr_floor`` and ``evidence``; ``problems`` and
    ``details`` where it checks more than the gradients."""

    engine: str  # "DDP", "FSDP2": in the skip reason of a forward that is not a loss
    memo: Memo  # (spec, device) -> {result_key: result} or why the spec cannot run
    skip_errors: tuple[type[Exception], ...] = (TypeError,)  # what ``compare`` raises for a spec it cannot run
    ran, reference = "", ""  # the two sides in the overflow sentence

    def compare(self, spec: TrainSpec, device: str) -> dict:
        """Every config's result of one run of ``spec`` on ``device``."""
        raise NotImplementedError

    def result_key(self, config: TrainConfig) -> str:
        """The key of ``config``'s result in what ``compare`` returns."""
        raise NotImplementedError

    def gradients(self, result) -> HookComparison:
        """The gradients' comparison: what the shared checks and the golden judge."""
        return result

    def sqnr_floor(self, config: TrainConfig, result) -> SqnrFloor:
        raise NotImplementedError

    def evidence(self, config: TrainConfig, result) -> Evidence:
        raise NotImplementedError

    def problems(self, config: TrainConfig, result) -> list[Problem]:
        """The case's problems, the golden's aside: the shared gradient checks."""
        return gradient_problems(self.gradients(result), self.sqnr_floor(config, result), self.ran, self.reference)

    def details(self, config: TrainConfig, result) -> list[str]:
        """Lines the case shows after its fault (what it could not judge)."""
        return []

    def comparisons(self, case: Case, spec: TrainSpec, where: str) -> dict | str:
        """The session's comparison of ``spec`` on the case's device, run once; or why it cannot run."""
        runs, key = case.state.memo(self.memo), (spec, case.device)
        if key not in runs:
            try:
                runs[key] = self.compare(spec, case.device)
            except LossContractError as e:  # the forward is not a loss: the step_fn cannot be split
                runs[key] = (f"the {self.engine} cases run forward and loss under {self.engine}, not the step_fn, "
                             f"and {e}")
            except self.skip_errors as e:  # TypeError: callables the spawned processes cannot import
                runs[key] = str(e)
            except (RankRunError, TrainingError) as e:  # TrainingError: a callable changed torch's state
                raise TargetError(f"{where}: {e}") from e
        return runs[key]

    def run_case(self, kind, case: Case, spec: TrainSpec, baseline: BaselineCheck) -> Outcome:
        config = case.config
        where = f"target {case.target.name!r} (train_step) under config {config.id}"
        results = self.comparisons(case, spec, where)
        if isinstance(results, str):
            skip(f"{case.target.name}: {results}")
        r = results[self.result_key(config)]
        outcome = Outcome(kind.suite, kind.name, case.target.name, config.id, case.regime, self.evidence(config, r),
                          baseline.check(DDPEntry(config, self.gradients(r))))
        outcome.problems += self.problems(config, r)
        outcome.details += self.details(config, r)
        outcome.problems += baseline_problems(outcome.baseline)
        return outcome
