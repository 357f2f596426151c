"""The distributed one-step case (suites/distributed_case.py) without spawning a rank: the DDP and
FSDP2 cases' comparisons replaced by canned results. One comparison per spec and device serves
every config; a spec that cannot run is skipped with its reason, a failed run is the target's
error; the shared gradient checks and each engine's own give their problems in order, the golden's
last (tests/test_training_suite.py and tests/test_fsdp.py run the real engines)."""
import math
from types import SimpleNamespace

import pytest

from pytest_precision.baselines.lifecycle import BaselineCheck
from pytest_precision.baselines.store import BaselineStore
from pytest_precision.kinds.session import RunState
from pytest_precision.kinds.target import TargetError
from pytest_precision.numerics.problem import Problem
from pytest_precision.suites.ddp import DDPCase
from pytest_precision.suites.fsdp import FSDPCase
from pytest_precision.training import TRAIN_CONFIGS, LossContractError
from pytest_precision.training.compare import unresolved_reason
from pytest_precision.training.distributed import HookComparison, RankRunError
from pytest_precision.training.fsdp import BatchShardError, FSDPComparison
from pytest_precision.training.limits import UNDERFLOW_LIMIT, limit_count

KIND = SimpleNamespace(suite="precision", name="train_step")
SPEC = object()  # the memo's key; the canned comparisons never read it


def _gradients(sqnr_db=70.0, rate=0.0, overflow=0, below=0.0):
    return HookComparison("fp16", sqnr_db, 0.01, {"w": rate}, overflow, 1.0, 1.0, below_range_underflow={"w": below},
                          underflow_elements={"w": 1000}, below_range_elements={"w": 10})


def _fsdp(gradients, groups, loss=1.0, deviation=0.0, own=None, unresolved=None):
    return FSDPComparison("fsdp-fp16-reduce-fp16", "float16", "float16", gradients, groups, 60.0, loss, 1.0, deviation,
                          group_floor_db=own or {}, unresolved=unresolved or {})


class Canned:
    """An engine's case whose comparison returns ``results`` (or raises it), counting the runs."""

    def __init__(self, results):
        self.results, self.runs = results, 0

    def compare(self, spec, device):
        self.runs += 1
        if isinstance(self.results, Exception):
            raise self.results
        return self.results


class CannedDDP(Canned, DDPCase):
    pass


class CannedFSDP(Canned, FSDPCase):
    pass


def _run(engine, config_id, tmp_path, state=None):
    config = TRAIN_CONFIGS[config_id]
    case = SimpleNamespace(target=SimpleNamespace(name="t"), config=config, device="cpu", regime="trajectory",
                           state=state or RunState())
    golden = BaselineCheck(BaselineStore(tmp_path), "train_step/t/trajectory", config_id, "cpu", False,
                           "pytest --update")
    return engine.run_case(KIND, case, SPEC, golden)


def _judged(outcome):
    """The problems the case found, the golden's (no golden here) apart."""
    assert [p.category for p in outcome.problems][-1:] == ["baseline"]
    return [(p.check, p.category, p.sentence) for p in outcome.problems[:-1]]


def test_one_comparison_serves_every_config_of_a_spec(tmp_path):
    engine = CannedDDP({"fp16": _gradients(), "bf16": _gradients(sqnr_db=20.0)})
    state = RunState()
    fp16, bf16 = _run(engine, "ddp-fp16", tmp_path, state), _run(engine, "ddp-bf16", tmp_path, state)
    assert engine.runs == 1
    assert _judged(fp16) == []
    assert _judged(bf16) == [("oracle", "accuracy", "gradient SQNR 20 dB < 36.14 dB, what bf16 keeps in a correct "
                                                    "all-reduce")]
    assert bf16.categories == ["accuracy", "baseline"]
    assert bf16.record().training["grad_sqnr_db"] == 20.0 and bf16.record().training["steps"] == 1


def test_ddp_gradient_checks_in_order_and_no_sqnr_once_a_gradient_overflowed(tmp_path):
    engine = CannedDDP({"fp16": _gradients(sqnr_db=-math.inf, rate=0.3, overflow=2)})
    assert _judged(_run(engine, "ddp-fp16", tmp_path)) == [
        ("oracle", "overflow", "2 gradient elements not finite with the hook, finite without"),
        ("oracle", "underflow", f"gradient-underflow rate 300 of 1000 elements (30 %) in w > 5 % allowed (up to "
                                f"{limit_count(UNDERFLOW_LIMIT, 1000)} elements: the limit and a count's spread "
                                "between machines)")]


def test_fsdp_checks_the_loss_around_the_gradients(tmp_path):
    nan_loss = _fsdp(_gradients(overflow=3), {"group 0": 20.0}, loss=math.nan, deviation=math.nan)
    assert _judged(_run(CannedFSDP({"fsdp-fp16-reduce-fp16": nan_loss}), "fsdp-fp16-reduce-fp16", tmp_path)) == [
        ("oracle", "nan", "non-finite loss nan under FSDP2"),
        ("oracle", "overflow", "3 gradient elements not finite under FSDP2, finite in fp32")]
    off = _fsdp(_gradients(), {"group 0": 20.0, "group 1": 50.0, "group 2": 10.0}, deviation=0.5,
                unresolved={"group 3": 2.0})
    outcome = _run(CannedFSDP({"fsdp-fp16-reduce-fp16": off}), "fsdp-fp16-reduce-fp16", tmp_path)
    assert _judged(outcome) == [
        ("oracle", "accuracy", "gradient SQNR 20 dB in group 0, 10 dB in group 2 < 48.21 dB, what float16 keeps in a "
                               "correct step"),
        ("oracle", "accuracy", "loss deviates from fp32 by 0.5 (relative) > 0.005 allowed for fsdp-fp16-reduce-fp16")]
    assert outcome.details == [f"gradient SQNR not judged in group 3 (2 dB): {unresolved_reason('float16')}"]
    # a group whose own conditioning sets a lower floor is held to it, and the sentence names each floor
    own = _fsdp(_gradients(), {"group 0": 20.0, "group 1": 30.0}, own={"group 0": 25.0, "group 1": 25.0})
    assert _judged(_run(CannedFSDP({"fsdp-fp16-reduce-fp16": own}), "fsdp-fp16-reduce-fp16", tmp_path)) == [
        ("oracle", "accuracy", "gradient SQNR 20 dB in group 0 < 25 dB, what float16 keeps in a correct step")]


def test_a_spec_that_cannot_run_is_skipped_once_with_the_reason(tmp_path):
    engine = CannedDDP(LossContractError("the model returned a tuple"))
    state = RunState()
    for config in ("ddp-fp16", "ddp-bf16"):
        with pytest.raises(pytest.skip.Exception, match="^t: the DDP cases run forward and loss under DDP, not the "
                                                        "step_fn, and the model returned a tuple$"):
            _run(engine, config, tmp_path, state)
    assert engine.runs == 1
    shard = CannedFSDP(BatchShardError("batch_fn(0)'s tensors have [3] rows"))
    with pytest.raises(pytest.skip.Exception, match=r"^t: batch_fn\(0\)'s tensors have \[3\] rows$"):
        _run(shard, "fsdp-bf16", tmp_path)
    with pytest.raises(BatchShardError):  # not DDP's: its comparison never splits a batch
        _run(CannedDDP(BatchShardError("odd")), "ddp-fp16", tmp_path)


def test_a_failed_run_of_the_ranks_is_the_targets_error(tmp_path):
    engine = CannedFSDP(RankRunError("FSDP2 comparison (gloo, 2 ranks) failed: rank 1: model_fn() raised"))
    with pytest.raises(TargetError, match=r"^target 't' \(train_step\) under config fsdp-bf16: FSDP2 comparison "
                                          r"\(gloo, 2 ranks\) failed: rank 1"):
        _run(engine, "fsdp-bf16", tmp_path)


def test_problems_are_problem_objects():
    floor = DDPCase().sqnr_floor(TRAIN_CONFIGS["ddp-fp16"], _gradients(sqnr_db=math.nan))
    assert floor.problems() == [Problem("oracle", "accuracy", "gradient SQNR nan dB < 54.21 dB, what fp16 keeps in a "
                                                              "correct all-reduce")]
