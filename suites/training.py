"""The train_step kind: ``TrainSpec`` targets x training configs, each run for the spec's steps and
compared with the fp32 run from the same seed (``pytest_precision.training`` has the contract).

Configs (``training.TRAIN_CONFIGS``; ``--precision-configs`` selects them by their matrix config:
``amp-fp16`` runs both amp-fp16 recipes, ``bf16`` both pure-bf16 ones and the bf16 DDP case):
fp32, tf32 (CUDA), amp-bf16, amp-fp16 with a GradScaler, amp-fp16 without one, pure bf16, pure
bf16 with stochastic rounding, fp8 Linear emulation, fp8 Linears on ``torch._scaled_mm`` with
current and delayed scaling; ``ddp-fp16``, ``ddp-bf16``, DDP's gradient-compression hooks against
uncompressed DDP (ddp.py has their verdicts); and ``fsdp-bf16``, ``fsdp-bf16-reduce-bf16``,
``fsdp-fp16-reduce-fp16``, FSDP2 mixed precision against single-process fp32 (fsdp.py).

Before anything runs, ``model_fn`` and every ``batch_fn(i)`` are called twice and compared: a spec
that does not repeat itself is an error of the target, and nothing is written. Every call of the
spec's code (those, ``optimizer_fn`` and each step) is taken between two snapshots of torch's
process-wide state (``training.run.judged_state``): a callable that leaves it changed fails the
case naming itself and the change, the state is restored, and nothing is written.

A case fails when, against the fp32 run of this session (floors from ``training.limits``, drawn
from the compute format's mantissa bits):

- a loss is not finite (the scaler scales only the backward: a non-finite loss is the forward's
  own), or a gradient is not finite at a step the GradScaler did not skip;
- a step's loss deviates by more than the config's ``loss_rtol``;
- the gradients' SQNR in some optimizer parameter group is below the first-step floor at the first
  step the optimizer ran, or below the later-step floor at some step; the gradient norm leaves its
  band at some step; the final parameters' SQNR is below the later-step floor (gradients clipped
  before ``scaler.unscale_`` are 1/loss-scale of fp32's: about 0 dB, and the message says so);
- the parameter update is far from fp32's (median over steps of |update| / |fp32 update| outside
  [1/2, 2]);
- in some parameter more than 5 % of the significant gradients underflowed (0 here, within the
  format's range at the loop's loss scale in the float64 step), or more than 5 % of the updates the
  float64 step makes and fp32 weights keep were never made (counted in elements, past a count's
  spread between machines: ``training.limits.limit_count``), except in the configs that exist to
  show that (amp-fp16 without a scaler shows underflow and what follows from it, pure bf16 lost
  updates): those report it, and the regression budget holds it where it was accepted;
- a spec that declares ``accumulate=N``: its accumulated first-step gradient is off the float64
  gradient of the whole batch's mean loss, or its step ran optimizer.step, unscale_ or backward
  another number of times (training.accumulation); a spec with a ``checkpoint``: its checkpointed
  first step's gradients differ from the same step's without checkpointing (training.checkpointing);
- under an fp8 recipe on ``torch._scaled_mm``, more than 2 % of one Linear's input, weight or
  output gradient saturated at the format's max, or more than 0.1 % of its significant values
  lost to 0, over the run (``training.fp8.fp8_problems``);
- and against the golden (training/baseline.py): the fp32 reference moved, or a metric grew past
  its accepted budget.

A failing case with a non-finite value or an underflow re-runs the step that went non-finite (else
its first step) traced, beside the same step in float64 from the parameters the run had there, and
names the first op that lost the value and the step (training_faults.step_fault); both re-runs draw
the random numbers the run drew at that step, so dropout draws the run's masks. A model_fn that builds its model in another dtype than float32 is said once per target (a
``ModelDtypeWarning``), under the table and in each failing case's message.

A spec with ``seeds=N`` (N > 1; ``--precision-train-seeds`` sets it for every spec) has one more
case per config, regime ``seedsN``: its failure rate over N seeds against fp32's (training_seeds.py).
"""
from __future__ import annotations

import dataclasses
import warnings

from pytest_precision.kinds import (BaselineCheck, Case, Kind, Memo, Outcome, Target, TargetError, baseline_problems,
                                    bf16_as_on_gpu, skip)
from pytest_precision.training import (TRAIN_CONFIGS, ExactStep, TrainConfig, TrainingError, TrainSpec, Trajectory,
                                       check_determinism, compare_trajectories, exact_first_step, run_training)
from pytest_precision.kinds.training import (GlobalStateError, LoopPeer, ModelDtypeWarning, TrajectoryEntry,
                                             built_dtype_note, ddp_skip_reason, exact_batch_gradients, float64_step,
                                             fp32_first_step, fp32_whole_run, fsdp_skip_reason, judge_accumulation,
                                             judge_checkpoint, judge_run, judged_state, run_peer, scale_health)

from . import ddp, fsdp, training_seeds
from .training_faults import step_fault, traced_step
from .training_report import TRAINING_TABLE, TrainingEvidence

__all__ = ["TRAIN_STEP", "TrainStepKind", "judge"]

# the session's memos (Case.state), shared by a spec's configs; keyed by the spec, never by id(),
# which a later spec reuses
CHECKED: Memo[TrainSpec, str | None] = Memo("spec -> whether it repeats itself (None, or why not)")
REFERENCES: Memo[tuple[TrainSpec, str], Trajectory] = Memo("(spec, device) -> its fp32 run")
EXACT: Memo[tuple, ExactStep | str] = Memo("(spec, device, step, random state) -> the float64 step, or why not")
BATCH_GRADIENTS: Memo[tuple, object] = Memo("(spec, device, step, random state) -> accumulation's float64 truth")
FLOAT64_RUNS: Memo[tuple[TrainSpec, str], Trajectory | str] = Memo("(spec, device) -> its whole run in float64, or why not")
PEER_FP32_RUNS: Memo[tuple[TrainSpec, str], Trajectory] = Memo("(careful loop, device) -> its fp32 run (training.peer)")
PEER_FP32_STEPS: Memo[tuple, Trajectory] = Memo("(careful loop, device, step, random state) -> its fp32 step")


def judge(outcome: Outcome) -> None:
    """The absolute verdicts (``training.verdicts``), then the golden's."""
    ev: TrainingEvidence = outcome.evidence
    verdict = judge_run(ev.metrics, ev.config, ev.scale, ev.fp8, ev.low_precision_loss, ev.peer)
    outcome.problems += verdict.problems
    outcome.details += verdict.details
    outcome.problems += baseline_problems(outcome.baseline)


def _undeclared_passes(spec: TrainSpec, run: Trajectory) -> int | None:
    """N where the run's first applied step ran N > 1 backward passes (its closure evaluated at most
    once) and the spec declares no ``accumulate=``: a loop that accumulates as users write it; else None."""
    step = run.first_step
    passes = run.backward_passes[step] if step is not None and step < len(run.backward_passes) else 1
    return passes if spec.accumulate == 1 and passes > 1 and not run.closure else None


class TrainStepKind(Kind):
    name = "train_step"
    suite = "training"
    contract = ("TrainSpec(model_fn, optimizer_fn, batch_fn, steps=8, step_fn=None, seed=0, loss_fn=None, "
                "keep_fp32=(), accumulate=1, checkpoint=None, seeds=1, fp8=None) (pytest_precision.training)")
    table = TRAINING_TABLE
    audit_regime = "trajectory"
    REGIME = "trajectory"  # no input regimes: a run is the spec's own batches

    def check_target(self, name: str, fn) -> None:
        if not isinstance(fn, TrainSpec):
            raise TypeError(f"target {name!r}: kind train_step takes a pytest_precision.TrainSpec, got {fn!r}")

    def default_targets(self) -> list[Target]:
        from . import tiny_gpt

        return [Target("tiny_gpt", tiny_gpt.SPEC, "train_step", origin="built-in")]

    def configs(self, selected) -> list[TrainConfig]:
        """The training configs whose matrix config (``base``) the run selected, in table order."""
        chosen = {c.id for c in selected}
        return [c for c in TRAIN_CONFIGS.values() if c.base in chosen]

    def target_configs(self, target: Target, configs: list) -> list:
        """fp8-own only for a spec that declares its own fp8 conversion (``TrainSpec(fp8=...)``)."""
        own = isinstance(target.fn, TrainSpec) and target.fn.fp8 is not None
        return [c for c in configs if own or not getattr(c, "own_fp8", False)]

    compiles = False  # a run is the spec's own loop: --precision-compile adds no compiled variant

    def session_target(self, target: Target, state) -> Target:
        """--precision-train-seeds=N: every spec runs from N seeds (its ``seeds`` replaced)."""
        if state.train_seeds is None or not isinstance(target.fn, TrainSpec):
            return target
        return dataclasses.replace(target, fn=dataclasses.replace(target.fn, seeds=state.train_seeds))

    def regime_names(self, target=None) -> tuple[str, ...]:
        seeds = training_seeds.regime_of(target.fn) if target is not None and isinstance(target.fn, TrainSpec) else None
        return (self.REGIME,) if seeds is None else (self.REGIME, seeds)  # TrainSpec(seeds=N): training_seeds.py

    def skip_reason(self, case: Case) -> str | None:
        if (case.config.ddp_hook is not None or case.config.fsdp is not None) and training_seeds.seeds_of(case.regime):
            what = "a DDP case compares one all-reduce" if case.config.ddp_hook else "an FSDP2 case compares one step"
            return f"{case.config.id}: {what}; the success rate over seeds runs step loops"
        if case.config.ddp_hook is not None:
            reason = ddp_skip_reason(case.device)
            if reason:
                return f"{case.config.id}: {reason}"
        if case.config.fsdp is not None:
            reason = fsdp_skip_reason(case.device)
            if reason:
                return f"{case.config.id}: {reason}"
        return super().skip_reason(case)

    @staticmethod
    def _where(target: Target, config: TrainConfig) -> str:
        return f"target {target.name!r} (train_step) under config {config.id}"

    @staticmethod
    def _spec(target: Target) -> TrainSpec:
        if not isinstance(target.fn, TrainSpec):
            raise TargetError(f"target {target.name!r} (train_step) is a {type(target.fn).__name__}, expected a "
                              "pytest_precision.TrainSpec")
        return target.fn

    def check_spec(self, case: Case) -> TrainSpec:
        """The case's spec, once per session found to repeat itself (``check_determinism``); a
        TargetError otherwise, before anything runs or is written."""
        spec = self._spec(case.target)
        checked = case.state.memo(CHECKED)
        if spec not in checked:
            try:
                check_determinism(spec, f"target {case.target.name!r} (train_step)")
                checked[spec] = None
            except TrainingError as e:
                checked[spec] = str(e)
        if checked[spec] is not None:
            raise TargetError(checked[spec])
        return spec

    def _reference(self, case: Case) -> Trajectory:
        spec = self._spec(case.target)
        runs, key = case.state.memo(REFERENCES), (spec, case.device)
        if key not in runs:
            fp32 = TRAIN_CONFIGS["fp32"]
            try:
                runs[key] = run_training(spec, fp32, case.device, self._where(case.target, fp32))
            except TrainingError as e:
                raise TargetError(str(e)) from e.__cause__
            ref = runs[key]
            note = built_dtype_note(ref.built_dtypes, len(ref.initial))
            if note:  # once per target and session: the table's line points here
                warnings.warn(ModelDtypeWarning(f"target {case.target.name!r} (train_step): {note}"), stacklevel=2)
        return runs[key]

    def _float64_run(self, case: Case, spec: TrainSpec) -> Trajectory | str:
        """The spec's whole run in float64 (once per session), or why it could not run: fp32's own drift
        from it widens the later steps' limits (training.drift), and its first step is the float64
        step of a run that applied its first step."""
        runs, key = case.state.memo(FLOAT64_RUNS), (spec, case.device)
        if key not in runs:
            try:
                runs[key] = float64_step(spec, case.device, f"target {case.target.name!r}: the float64 run")
            except GlobalStateError as e:  # the target's error, not a reason to judge against fp32
                raise TargetError(str(e)) from None
            except TrainingError as e:
                runs[key] = str(e)
        return runs[key]

    def _exact(self, case: Case, spec: TrainSpec, run: Trajectory) -> ExactStep | str:
        """The float64 first step of ``run`` (cached per step index and the random state the run
        had there: it draws the run's dropout masks), or why it could not run. A run that applied
        its first step from the state every run starts from takes it from the whole float64 run."""
        step = run.first_step
        if step is None:
            return "no step ran"
        rng = run.rng_states[step]
        whole = self._float64_run(case, spec)
        if isinstance(whole, Trajectory) and step == 0 == whole.first_step and whole.rng_states[0].digest == rng.digest:
            return ExactStep.first_of(whole)
        cache = case.state.memo(EXACT)
        key = (spec, case.device, step, rng.digest)
        if key not in cache:
            try:
                cache[key] = exact_first_step(spec, step, case.device,
                                              f"target {case.target.name!r}: the float64 step {step}", rng)
            except GlobalStateError as e:  # the target's error, not a reason to judge against fp32
                raise TargetError(str(e)) from None
            except TrainingError as e:
                cache[key] = str(e)
        return cache[key]

    def run(self, case: Case, baseline: BaselineCheck) -> Outcome:
        reason = self.skip_reason(case)
        if reason:
            skip(reason)
        # interpreted Triton kernels in the model compute bfloat16 as a GPU does where the interpreter's
        # is wrong, in every run of the case (the configs, the float64 step, the first-fault re-runs)
        with bf16_as_on_gpu():
            return self._run(case, baseline)

    def _run(self, case: Case, baseline: BaselineCheck) -> Outcome:
        config = case.config
        spec = self.check_spec(case)
        if config.ddp_hook is not None:
            return ddp.run_case(self, case, spec, baseline)
        if training_seeds.seeds_of(case.regime):
            return training_seeds.run_case(case, spec)
        if config.fsdp is not None:
            return fsdp.run_case(self, case, spec, baseline)
        ref = self._reference(case)
        try:
            run = ref if config.id == "fp32" else run_training(spec, config, case.device, self._where(case.target, config))
        except TrainingError as e:
            raise TargetError(str(e)) from e.__cause__
        changed = next((i for i, (a, b) in enumerate(zip(run.batch_digests, ref.batch_digests)) if a != b), None)
        if changed is not None:
            raise TargetError(f"{self._where(case.target, config)}: batch_fn({changed}) returned other data than it "
                              "did for the fp32 run: each config must see the same batches; nothing was written")
        exact = self._exact(case, spec, run)
        whole = self._float64_run(case, spec)
        metrics = compare_trajectories(run, ref, config, exact if isinstance(exact, ExactStep) else None,
                                       "float64" if isinstance(exact, ExactStep) else f"the fp32 run ({exact})",
                                       whole if isinstance(whole, Trajectory) else None)
        try:
            with judged_state("batch_fn(0)", self._where(case.target, config)):
                batch0 = spec.batch_fn(0)
        except GlobalStateError as e:
            raise TargetError(str(e)) from None
        result = baseline.check(TrajectoryEntry(config, run, ref, metrics, batch0, spec.seed, baseline.budget_key))
        truth = exact.grads if isinstance(exact, ExactStep) else ref.grads.get(run.first_step, {})
        scale = scale_health(config, run.scales_used, run.first_step, run.skipped, truth,
                             "float64" if isinstance(exact, ExactStep) else "fp32", run.unscaled)
        outcome = Outcome(self.suite, self.name, case.target.name, config.id, case.regime,
                          TrainingEvidence(config, metrics, scale, run.fp8, run.low_precision_loss,
                                           self._peer(case, spec, run), shipped=spec.ships == config.id), result)
        judge(outcome)
        outcome.problems += run.module_failures  # where its modules ran against what was meant (module_dtypes)
        outcome.details += run.module_notes
        self._judge_step_features(case, spec, run, outcome)
        if any(p.category in ("overflow", "nan", "underflow") for p in outcome.problems):
            # the step that went non-finite (else the first), replayed to and traced beside float64; both
            # draw the random numbers the run drew there (dropout masks)
            step = run.first_nonfinite[0] if run.first_nonfinite is not None else 0
            try:
                outcome.fault = step_fault(spec, config, case.device, step, run.rng_states[0])
            except GlobalStateError as e:  # a re-run's step left torch's state changed (restored)
                raise TargetError(str(e)) from None
            except TrainingError:  # a model that cannot run in float64 still fails; only the fault is unnamed
                outcome.fault = None
        return outcome

    def _peer(self, case: Case, spec: TrainSpec, run: Trajectory) -> LoopPeer | str | None:
        """A step_fn's careful-loop peer under the case's config (training.peer), its fp32 step memoised
        for the session; None where there is nothing to compare (no step_fn, fp32, no finite first step)."""
        if spec.step_fn is None or case.config.id == "fp32" or run.first_step is None or run.first_nonfinite is not None:
            return None
        steps, runs = case.state.memo(PEER_FP32_STEPS), case.state.memo(PEER_FP32_RUNS)

        def fp32_step(careful, k, rng, device, where):
            key = (careful, device, k, rng.digest)
            if key not in steps:
                steps[key] = fp32_first_step(careful, k, rng, device, where)
            return steps[key]

        def fp32_run(careful, device, where):
            key = (careful, device)
            if key not in runs:
                runs[key] = fp32_whole_run(careful, device, where)
            return runs[key]
        try:
            return run_peer(spec, case.config, case.device, self._where(case.target, case.config),
                            _undeclared_passes(spec, run) or spec.accumulate, fp32_step, fp32_run)
        except GlobalStateError as e:
            raise TargetError(str(e)) from None

    def _judge_step_features(self, case: Case, spec: TrainSpec, run: Trajectory, outcome: Outcome) -> None:
        """The verdicts of a spec that accumulates micro-batches (training.accumulation), declared or
        not, or checkpoints activations (training.checkpointing)."""
        where = self._where(case.target, case.config)
        try:
            if run.first_step is not None:
                self._judge_accumulation(case, spec, run, outcome, where)
            if spec.checkpoint is not None and run.first_step is not None:
                check = judge_checkpoint(spec, case.config, run, case.device, where)
                outcome.details.append(check.detail)
                if check.problem:
                    outcome.problems.append(check.problem)
        except (TrainingError, ValueError) as e:
            raise TargetError(str(e)) from e.__cause__

    @staticmethod
    def _judge_accumulation(case: Case, spec: TrainSpec, run: Trajectory, outcome: Outcome, where: str) -> None:
        """A declared ``accumulate=N``, or a step that ran N > 1 backward passes before its one
        ``optimizer.step()`` and declares nothing (a loop that accumulates as users write it): judged
        as ``TrainSpec(accumulate=N)``, its batch split in N along dim 0, against the whole batch's
        float64 gradient."""
        step, passes = run.first_step, _undeclared_passes(spec, run)
        undeclared = passes is not None and step < len(run.optimizer_steps) and run.optimizer_steps[step] == 1
        if spec.accumulate == 1 and not undeclared:
            return
        judged = dataclasses.replace(spec, accumulate=passes) if undeclared else spec
        n = judged.accumulate
        said = (f"{n} backward passes per optimizer.step() with no accumulate= declared (judged as "
                f"TrainSpec(accumulate={n}), the batch split in {n} along dim 0)")
        rng = run.rng_states[step]
        cache, key = case.state.memo(BATCH_GRADIENTS), (judged, case.device, step, rng.digest)
        if key not in cache:
            try:
                cache[key] = exact_batch_gradients(judged, step, case.device, f"{where}: the float64 gradients", rng)
            except GlobalStateError:
                raise
            except TrainingError as e:  # no float64 gradient, or a batch that does not split (split_batch's error)
                cache[key] = str(e)
        if isinstance(cache[key], str):
            if undeclared:  # the split cannot be known: the declaration that says it is the fix
                outcome.add("oracle", "contract", f"{said}, and that could not be judged ({cache[key]}): declare "
                            f"TrainSpec(accumulate={n}) and take accumulate= in step_fn, with a batch of the whole "
                            "step that splits along dim 0 and a loss_fn for one micro-batch")
            else:
                outcome.not_judged.append(f"accumulation ({cache[key]})")
            return
        metrics = outcome.evidence.metrics
        floors = metrics.group_floor_db
        accum = judge_accumulation(judged, case.config, run, cache[key], min(floors.values()) if floors else None,
                                   noise=bool(metrics.unresolved) and not floors)
        outcome.details.append(accum.detail + (f" ({said})" if undeclared else ""))
        problem = accum.problem
        if problem and undeclared:
            problem = dataclasses.replace(problem, sentence=f"{said}: {problem.sentence}")
        if problem and accum.shown:
            outcome.details.append(f"{case.config.id} shows this: {problem.sentence} (reported, not held to it)")
        elif problem:
            outcome.problems.append(problem)

    def bench_call(self, case: Case):
        return None  # steps are timed inside the run and shown against fp32, not gated

    def trace_call(self, case: Case):
        """--precision-trace and --precision-audit: the first step under the config."""
        if case.config.ddp_hook is not None or case.config.fsdp is not None:
            return None  # the DDP and FSDP2 cases run in other processes
        return traced_step(self._spec(case.target), case.config, case.device)


TRAIN_STEP = TrainStepKind()
