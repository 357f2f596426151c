"""The typed training budgets (``training.budget``): each reads and writes the JSON a golden holds
byte for byte, widens across machines and judges as the dict budgets before them did, and a golden
written before the types judges the same."""
import dataclasses
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from pytest_precision.baselines.lifecycle import BaselineCheck
from pytest_precision.baselines.schema import UNLIMITED_WHEN, unlimited
from pytest_precision.baselines.store import BaselineStore
from pytest_precision.baselines.writing import json_bytes
from pytest_precision.numerics.problem import Problem
from pytest_precision.training import TRAIN_CONFIGS
from pytest_precision.training.baseline import DDPEntry, TrajectoryEntry
from pytest_precision.training.budget import (DistributedAccepted, DistributedBudget, TrajectoryAccepted,
                                              TrajectoryBudget)
from pytest_precision.training.distributed import HookComparison

GOLDENS = Path(__file__).resolve().parents[1] / "baselines" / "train_step" / "tiny_gpt" / "trajectory"
TYPES = {False: (TrajectoryAccepted, TrajectoryBudget), True: (DistributedAccepted, DistributedBudget)}


def _distributed(path: Path) -> bool:
    return path.stem.startswith(("ddp-", "fsdp-"))


def _outputs(path: Path) -> dict[str, dict]:
    return {k: r["outputs"]["trajectory"] for k, r in json.loads(path.read_text())["budgets"].items()}


ACCEPTED = TrajectoryAccepted(max_loss_deviation=1e-4, grad_sqnr_db={"group 0": 45.0, "group 1": 50.0},
                              worst_grad_sqnr_db=30.0, param_sqnr_db=40.0, grad_norm_ratio=0.99, update_ratio=1.02,
                              underflow_rate={"w": (0.1, 1000)}, update_lost_rate={"b": (0.2, 1000)}, skipped_steps=1,
                              first_nonfinite_step=None)


# ---- JSON: the keys, values and order a golden holds ---------------------------------------------

@pytest.mark.parametrize("path", sorted(GOLDENS.glob("*.json")), ids=lambda p: p.stem)
def test_every_committed_golden_reads_and_rewrites_byte_for_byte(path):
    """Each key's accepted metrics and budget through the types, and the budget derived again from
    the accepted metrics: the file's bytes, as the golden store writes them."""
    accepted_type, budget_type = TYPES[_distributed(path)]
    meta = json.loads(path.read_text())
    for record in meta["budgets"].values():
        out = record["outputs"]["trajectory"]
        acc = accepted_type.from_json(out["accepted"])
        assert acc.to_json() == out["accepted"]
        assert budget_type.from_json(out["budget"]).to_json() == out["budget"]
        out["accepted"], out["budget"] = acc.to_json(), budget_type.from_accepted(acc).to_json()
    assert json_bytes(meta) == path.read_bytes()


@pytest.mark.parametrize("value", [
    ACCEPTED,
    dataclasses.replace(ACCEPTED, grad_norm_ratio=None, update_ratio=math.inf, param_sqnr_db=math.nan,
                        worst_grad_sqnr_db=-math.inf, first_nonfinite_step=3, grad_sqnr_db={}),
    TrajectoryBudget.from_accepted(ACCEPTED),
    TrajectoryBudget.from_accepted(dataclasses.replace(ACCEPTED, grad_norm_ratio=0.0, param_sqnr_db=-math.inf,
                                                       first_nonfinite_step=2)),
    DistributedAccepted(grad_sqnr_db=70.0, underflow_rate={"w": (0.001, 4096), "b": (0.0, 64)}, overflow=2),
    DistributedBudget.from_accepted(DistributedAccepted(grad_sqnr_db=-math.inf, underflow_rate={}, overflow=0)),
], ids=lambda v: type(v).__name__)
def test_a_round_trip_through_json_is_the_identity(value):
    stored = json.loads(json_bytes(value.to_json()))  # as written and read back
    again = type(value).from_json(stored)
    assert json_bytes(again.to_json()) == json_bytes(value.to_json())
    # the fields in their order are the keys in theirs (a rewrite's "changed" line lists them so)
    assert list(value.to_json()) == [f.name for f in dataclasses.fields(value)]
    # per-parameter rates are [rate, elements] lists in the file
    for v in value.to_json().values():
        if isinstance(v, dict):
            assert all(isinstance(x, (int, float, list)) for x in v.values())


def test_accepted_metrics_are_read_from_a_run_as_before():
    m = SimpleNamespace(max_loss_deviation=2e-5, group_grad_sqnr_db={"all parameters": 60.0}, worst_grad_sqnr_db=35.0,
                        param_sqnr_db=45.0, worst_grad_norm_ratio=1.001, update_ratio=None,
                        underflow_rate={"w": 0.25, "b": 0.0}, underflow_elements={"w": 8},
                        update_lost_rate={"w": 0.5}, update_elements={"w": 4}, skipped=[1, 3], first_nonfinite=(4, "w"))
    assert json.dumps(TrajectoryAccepted.from_metrics(m).to_json()) == json.dumps({
        "max_loss_deviation": 2e-5, "grad_sqnr_db": {"all parameters": 60.0}, "worst_grad_sqnr_db": 35.0,
        "param_sqnr_db": 45.0, "grad_norm_ratio": 1.001, "update_ratio": None,
        "underflow_rate": {"w": [0.25, 8], "b": [0.0, 0]}, "update_lost_rate": {"w": [0.5, 4]}, "skipped_steps": 2,
        "first_nonfinite_step": 4})


def test_a_budget_of_the_earlier_format_says_what_it_lacks():
    assert TrajectoryBudget.earlier_format({"max_loss_deviation": 0.1}) == "no min_grad_sqnr_db per parameter group"
    assert TrajectoryBudget.earlier_format(TrajectoryBudget.from_accepted(ACCEPTED).to_json()) is None
    assert DistributedBudget.earlier_format({"max_underflow_rate": 0.1}) == "no max_underflow_rate per parameter"
    assert DistributedBudget.earlier_format({"max_underflow_rate": {}}) is None
    # the first non-finite step came later: a budget without it allows none
    old = TrajectoryBudget.from_accepted(ACCEPTED).to_json()
    del old["first_nonfinite_step"]
    assert TrajectoryBudget.from_json(old).first_nonfinite_step is None


def test_a_hand_edited_budget_raises_what_the_lifecycle_calls_corrupt():
    good = TrajectoryBudget.from_accepted(ACCEPTED).to_json()
    with pytest.raises(KeyError):
        TrajectoryBudget.from_json({k: v for k, v in good.items() if k != "min_param_sqnr_db"})
    with pytest.raises((TypeError, ValueError)):
        TrajectoryBudget.from_json(dict(good, max_underflow_rate=0.5))
    with pytest.raises((TypeError, ValueError)):
        DistributedAccepted.from_json({"grad_sqnr_db": 1.0, "underflow_rate": {"w": [0.1]}, "overflow": 0})


def test_the_limits_written_unlimited_are_those_the_schema_reads():
    """A golden may hold an infinite limit only where what it accepted was not finite
    (``baselines.schema.UNLIMITED_WHEN``, which cannot import the training layer): each accepted
    metric made non-finite makes exactly the limits the schema names for it infinite, and the
    schema reads them so."""
    def infinite(budget: dict) -> set[str]:
        return {f"{k}.{n}" if n else k for k, v in budget.items()
                for n, x in (v.items() if isinstance(v, dict) else [(None, v)])
                if isinstance(x, float) and math.isinf(x) and (x < 0) == k.startswith("min_")}

    edits = {"max_loss_deviation": math.inf, "grad_sqnr_db": {"group 0": -math.inf, "group 1": 50.0},
             "worst_grad_sqnr_db": math.nan, "param_sqnr_db": -math.inf, "grad_norm_ratio": math.inf,
             "update_ratio": 0.0}
    for field, value in edits.items():
        acc = dataclasses.replace(ACCEPTED, **{field: value})
        entry = {"budget": TrajectoryBudget.from_accepted(acc).to_json(), "accepted": acc.to_json()}
        made = infinite(entry["budget"])
        assert {m.split(".")[0] for m in made} == {k for k, v in UNLIMITED_WHEN.items() if v == field}, field
        assert len(unlimited(entry)) == len(made), field
    acc = DistributedAccepted(grad_sqnr_db=-math.inf, underflow_rate={}, overflow=0)
    entry = {"budget": DistributedBudget.from_accepted(acc).to_json(), "accepted": acc.to_json()}
    assert infinite(entry["budget"]) == {"min_grad_sqnr_db"} and UNLIMITED_WHEN["min_grad_sqnr_db"] == "grad_sqnr_db"
    assert unlimited(entry) == ["min_grad_sqnr_db (accepted grad_sqnr_db -inf)"]


# ---- widest: the loosest limit of the machines of a device type ------------------------------------

def test_the_widest_trajectory_budget_takes_each_limit_at_its_loosest():
    a = TrajectoryBudget(max_loss_deviation=1e-4, min_grad_sqnr_db={"g0": 40.0, "g1": 50.0}, min_worst_grad_sqnr_db=30.0,
                         min_param_sqnr_db=35.0, max_grad_norm_log_ratio=0.01, max_update_log_ratio=0.02,
                         max_underflow_rate={"w": 0.1}, max_update_lost_rate={"w": 0.2}, skipped_steps=1,
                         first_nonfinite_step=None)
    b = TrajectoryBudget(max_loss_deviation=2e-4, min_grad_sqnr_db={"g0": 45.0}, min_worst_grad_sqnr_db=25.0,
                         min_param_sqnr_db=38.0, max_grad_norm_log_ratio=0.005, max_update_log_ratio=0.03,
                         max_underflow_rate={"w": 0.05, "b": 0.5}, max_update_lost_rate={"w": 0.3}, skipped_steps=3,
                         first_nonfinite_step=4)
    c = dataclasses.replace(a, first_nonfinite_step=2)
    assert TrajectoryBudget.widest([a, b]) == TrajectoryBudget(
        max_loss_deviation=2e-4, min_grad_sqnr_db={"g0": 40.0, "g1": 50.0}, min_worst_grad_sqnr_db=25.0,
        min_param_sqnr_db=35.0, max_grad_norm_log_ratio=0.01, max_update_log_ratio=0.03,
        max_underflow_rate={"w": 0.1, "b": 0.5}, max_update_lost_rate={"w": 0.3}, skipped_steps=3,
        first_nonfinite_step=4)
    assert TrajectoryBudget.widest([b, c]).first_nonfinite_step == 2  # the earliest any machine allows
    assert TrajectoryBudget.widest([a]) == a


def test_the_widest_distributed_budget_takes_each_limit_at_its_loosest():
    a = DistributedBudget(min_grad_sqnr_db=60.0, max_underflow_rate={"w": 0.1}, overflow=0)
    b = DistributedBudget(min_grad_sqnr_db=55.0, max_underflow_rate={"w": 0.05, "b": 0.2}, overflow=2)
    assert DistributedBudget.widest([a, b]) == DistributedBudget(55.0, {"w": 0.1, "b": 0.2}, 2)


def test_the_count_slack_raises_a_rate_limit_to_what_the_accepted_count_gives():
    """A golden accepted under the two-element floor: 0 of 12288 lost allows 13 elements now."""
    acc = dataclasses.replace(ACCEPTED, underflow_rate={"w": (0.0, 12288)}, update_lost_rate={"w": (0.0, 64)})
    old = dataclasses.replace(TrajectoryBudget.from_accepted(acc), max_underflow_rate={"w": 2 / 12288, "gone": 0.5},
                              max_update_lost_rate={"w": 2 / 64})
    slack = old.with_count_slack(acc)
    assert slack.max_underflow_rate == {"w": 13 / 12288, "gone": 0.5} and slack.max_update_lost_rate == {"w": 13 / 64}
    assert dataclasses.replace(slack, max_underflow_rate=old.max_underflow_rate,
                               max_update_lost_rate=old.max_update_lost_rate) == old
    d = DistributedBudget(60.0, {"w": 2 / 4096}, 0).with_count_slack(
        DistributedAccepted(70.0, {"w": (0.0, 4096)}, 0))
    assert d == DistributedBudget(60.0, {"w": 13 / 4096}, 0)


# ---- violations: the sentences and categories of the golden check ----------------------------------

def test_a_run_within_its_trajectory_budget_has_no_violations_and_one_past_it_says_each():
    budget = TrajectoryBudget.from_accepted(ACCEPTED)
    assert budget.violations(ACCEPTED) == []
    worse = dataclasses.replace(ACCEPTED, max_loss_deviation=1e-3, grad_sqnr_db={"group 0": 20.0, "group 2": 10.0},
                                worst_grad_sqnr_db=10.0, param_sqnr_db=20.0, grad_norm_ratio=2.0, update_ratio=0.5,
                                underflow_rate={"w": (0.5, 1000)}, update_lost_rate={"b": (0.9, 1000)},
                                skipped_steps=5, first_nonfinite_step=1)
    floor = budget.min_grad_sqnr_db
    problems = budget.violations(worse)
    assert all(isinstance(p, Problem) and p.check == "golden" and p.declaration is None for p in problems)
    said = [(p.category, p.sentence) for p in problems]
    assert said[:2] == [
        ("accuracy", f"max loss deviation from fp32 0.001 > budget {budget.max_loss_deviation:.3g}"),
        # a group the budget does not know is held to the tightest floor
        ("accuracy", f"gradient SQNR 20 dB in group 0 at the first step < budget {floor['group 0']:.4g} dB, 10 dB in "
                     f"group 2 at the first step < budget {floor['group 1']:.4g} dB, 10 dB at the worst step < budget "
                     f"{budget.min_worst_grad_sqnr_db:.4g} dB")]
    assert [c for c, _ in said[2:]] == ["accuracy", "accuracy", "accuracy", "underflow", "accuracy", "overflow", "nan"]
    assert said[2][1].startswith("final-parameter SQNR 20 dB < budget ")
    assert said[3][1].startswith("gradient-norm ratio 2 x fp32's, outside the budget 0.9")
    assert said[4][1].startswith("update ratio 0.5 x fp32's, outside the budget 0.9")
    assert said[5][1].startswith("gradient-underflow rate 500 of 1000 elements (50 %) in w > budget ")
    assert said[6][1].startswith("update-lost rate 900 of 1000 elements (90 %) in b > budget ")
    assert said[7:] == [("overflow", "5 steps skipped by the GradScaler > budget 2"),
                        ("nan", "non-finite at step 1, accepted none")]
    # nothing measured (NaN) is not judged; a non-finite step later than the accepted one is allowed
    later = dataclasses.replace(budget, first_nonfinite_step=2)
    assert later.violations(dataclasses.replace(ACCEPTED, worst_grad_sqnr_db=math.nan, param_sqnr_db=math.nan,
                                                first_nonfinite_step=3)) == []
    assert [p.sentence for p in later.violations(dataclasses.replace(ACCEPTED, first_nonfinite_step=1))] == [
        "non-finite at step 1, accepted from step 2"]


def test_a_step_within_its_distributed_budget_has_no_violations_and_one_past_it_says_each():
    acc = DistributedAccepted(grad_sqnr_db=70.0, underflow_rate={"w": (0.0, 1000)}, overflow=0)
    budget = DistributedBudget.from_accepted(acc)
    assert budget.violations(acc) == []
    problems = budget.violations(DistributedAccepted(grad_sqnr_db=40.0, underflow_rate={"w": (0.3, 1000)}, overflow=2))
    assert all(p.check == "golden" for p in problems)
    assert [(p.category, p.sentence) for p in problems] == [
        ("accuracy", f"gradient SQNR 40 dB < budget {budget.min_grad_sqnr_db:.4g} dB"),
        ("underflow", "gradient-underflow rate 300 of 1000 elements (30 %) in w > budget 13 elements (1.3 %)"),
        ("overflow", "overflow 2 > 0 allowed")]


# ---- a golden written before the typed budgets judges the same --------------------------------------
# (the sentences below were given by the string-keyed budgets of c0af0d8 on the same golden and run)

def test_a_trajectory_golden_from_before_judges_the_same():
    outputs = _outputs(GOLDENS / "amp-fp16.json")
    own = outputs["cpu-avx512"]
    acc = json.loads(json.dumps(own["accepted"]))
    acc.update(max_loss_deviation=1e-4, worst_grad_sqnr_db=20.0, grad_norm_ratio=1.01, skipped_steps=3,
               first_nonfinite_step=2)
    acc["underflow_rate"]["head.weight"] = [0.01, 16384]
    worse = TrajectoryAccepted.from_json(acc)
    rest = [("underflow", "gradient-underflow rate 164 of 16384 elements (1 %) in head.weight > budget 13 elements "
                          "(0.0793 %)"),
            ("overflow", "3 steps skipped by the GradScaler > budget 1"), ("nan", "non-finite at step 2, accepted none")]
    judged = TrajectoryEntry.budget_from(None, "trajectory", [own], False)
    assert [(p.category, p.sentence) for p in judged.violations(worse)] == [
        ("accuracy", "max loss deviation from fp32 0.0001 > budget 1.6e-05"),
        ("accuracy", "gradient SQNR 20 dB at the worst step < budget 30.17 dB"),
        ("accuracy", "gradient-norm ratio 1.01 x fp32's, outside the budget 0.99848 to 1.00152"), *rest]
    borrowed = TrajectoryEntry.budget_from(None, "trajectory", list(outputs.values()), True)
    assert [(p.category, p.sentence) for p in borrowed.violations(worse)] == [
        ("accuracy", "max loss deviation from fp32 0.0001 > budget 3.07e-05"),
        ("accuracy", "gradient SQNR 20 dB at the worst step < budget 30.16 dB"),
        ("accuracy", "gradient-norm ratio 1.01 x fp32's, outside the budget 0.998402 to 1.0016"), *rest]
    assert judged.violations(TrajectoryAccepted.from_json(own["accepted"])) == []
    assert TrajectoryEntry.describe(None, {"trajectory": own}) == (
        "max loss deviation 1.6e-05, gradient SQNR >= 61.8 dB (first step), 30.17 dB (worst step), parameter SQNR >= "
        "43.52 dB, gradient underflow 0 accepted, budget 13 elements where none was accepted, update lost 0 accepted, "
        "budget 13 elements where none was accepted, skipped steps 1")
    # rewritten on this key from another key's accepted metrics: the line that reports the rewrite
    other = TrajectoryAccepted.from_json(outputs["cpu-avx2"]["accepted"])
    rewrite = {"budget": TrajectoryBudget.from_accepted(other).to_json(), "accepted": other.to_json()}
    assert TrajectoryEntry.changes(None, {"trajectory": own}, {"trajectory": rewrite}) == [
        "max_loss_deviation 1.604e-05 -> 1.659e-05", "min_grad_sqnr_db {all parameters: 61.8} -> {all parameters: 61.82}",
        "min_worst_grad_sqnr_db 30.17 -> 30.16", "min_param_sqnr_db 43.52 -> 43.26",
        "max_grad_norm_log_ratio 0.001521 -> 0.001599", "max_update_log_ratio 0.0008484 -> 0.0008844"]


def test_a_ddp_golden_from_before_judges_the_same(tmp_path):
    """Through the golden lifecycle on a copy of the committed golden: this machine's own key or,
    on another, the widest of its device type judge the same."""
    key = "train_step/tiny_gpt/trajectory"
    for suffix in (".json", ".npz"):
        (tmp_path / key).mkdir(parents=True, exist_ok=True)
        shutil.copy(GOLDENS / f"ddp-fp16{suffix}", tmp_path / key / f"ddp-fp16{suffix}")
    outputs = _outputs(GOLDENS / "ddp-fp16.json")
    acc = DistributedAccepted.from_json(outputs["cpu-avx512"]["accepted"])
    elements = {n: count for n, (_, count) in acc.underflow_rate.items()}

    def golden(update: bool) -> BaselineCheck:
        return BaselineCheck(BaselineStore(tmp_path), key, "ddp-fp16", "cpu", update, "pytest ... --update")

    def check(update: bool, sqnr: float, rates: dict[str, float], overflow: int):
        case = golden(update)
        result = HookComparison("fp16", sqnr, 0.01, rates, overflow, 1.0, 1.0, underflow_elements=elements)
        res = case.check(DDPEntry(TRAIN_CONFIGS["ddp-fp16"], result))
        case.commit()
        return res

    same = check(False, acc.grad_sqnr_db, {n: r for n, (r, _) in acc.underflow_rate.items()}, acc.overflow)
    assert same.error is None and same.problems == [], same.error
    worse = check(False, 60.0, {**{n: r for n, (r, _) in acc.underflow_rate.items()}, "tok.weight": 0.01}, 1)
    assert worse.error is None and worse.problems == [
        ("accuracy", "gradient SQNR 60 dB < budget 66.19 dB"),
        ("underflow", "gradient-underflow rate 150 of 15032 elements (0.998 %) in tok.weight > budget 13 elements "
                      "(0.0865 %)"),
        ("overflow", "overflow 1 > 0 allowed")]
    # rewritten from the same accepted metrics: the same budget, under whichever key this machine writes
    rewritten = check(True, acc.grad_sqnr_db, {n: r for n, (r, _) in acc.underflow_rate.items()}, acc.overflow)
    assert rewritten.updated is not None
    written = _outputs(tmp_path / key / "ddp-fp16.json")[golden(False).budget_key]
    assert json_bytes(written) == json_bytes(outputs["cpu-avx512"])
