"""The tensor template: :class:`TensorKind`, a :class:`~..kind.Kind` whose targets take tensors and
return one, judged from a core of hooks (abstract where required) and the hooks of its roles
(``roles``: drawn inputs, batch invariance, conventions, golden inputs).

The core says

- inputs: named, seeded :class:`~..cases.Regime` s (the same bits on every machine), ``for_target``
  (the inputs as a target reads them), ``floating_inputs`` (what a config rounds);
- numerics: a float64 ``reference`` in the kind's calling convention (the oracle runs it on the
  config's *rounded* inputs), a ``peer`` (a trusted implementation run in the same config), an
  :class:`~.measurement.OutputRule` per output (``output_rule``, from a
  :class:`~.measurement.MeasureContext` and the facts ``rule_facts`` computes once per
  measurement) and ``grad_inputs`` (inputs whose gradients are outputs);
- running: ``invoke`` (the call in the kind's convention) and ``validate`` (its output contract:
  type, ``expected_shape``, and ``output_dtypes``, the dtypes a config can produce).

The template methods (``run``, ``measure``, ``call``, ``bench_call``, ``trace_call``,
``why_skipped``) are final: a case is judged three ways, against the float64 oracle with the peer
budget, against the golden with the regression budget, and by its overflow / underflow / NaN
counts, and a failure with a lost value names the first op that lost it (``fault``).
"""
from __future__ import annotations

import contextlib
from abc import abstractmethod
from dataclasses import dataclass, replace
from typing import Any, Callable, final

import torch

from ...baselines.entry import BaselineResult
from ...baselines.lifecycle import BaselineCheck
from ...baselines.tensors import TensorOutput
from ...numerics.budgets import violations
from ...numerics.rng import RngState
from ...platform.launches import watch_launches
from ...platform.triton import interpreted, interpreter_excuse
from ...speed.timing import Bench
from ..cases import NO_VARIANT, Case, Regime
from .contract import CONTRACT_DECLARATIONS, other_tensor_fields
from .contract_checks import check_contract
from ..declarations import Declaration
from .drawn import attack
from ..fresh import FRESH, fresh_regime_of, fresh_result, is_fresh, note_fresh
from .fault import locate_fault
from ..kind import Kind, skip, xfail
from .measurement import MeasureContext, Measurement, OutputResult, OutputRule, TensorEvidence, upstream_gradient
from ..outcome import Outcome, Problem, baseline_problems
from ..target import Target, TargetError
from .roles import BatchInvariance, Conventions, DrawnInputs, GoldenInputs
from .target_call import call_target

__all__ = ["TensorKind", "CaseInputs", "TEMPLATE_METHODS"]

# the template methods (typing.final): a subclass that overrides one is refused when it is defined,
# as a type checker would refuse it (typing.final alone does nothing at run time)
TEMPLATE_METHODS = ("case_inputs", "why_skipped", "run", "measure", "rule", "call", "reference_outputs", "outcome",
                    "bench_call", "trace_call")


@dataclass(frozen=True)
class CaseInputs:
    """A case's seeded inputs as its target reads them, or why the case does not run here."""

    skipped: str | None = None  # the skip's reason (then nothing else is set)
    regime: Regime | None = None  # None (and not skipped): the drawn regime, whose inputs are drawn
    inputs: Any = None


class TensorKind(DrawnInputs, BatchInvariance, Conventions, GoldenInputs, Kind):
    """A kind whose targets take tensors and return one (module docstring): subclasses set the
    identity and the inputs and implement the core hooks (``floating_inputs``, ``invoke``,
    ``expected_shape``, ``reference``, ``peer``: abstract), override the others they need, and the
    hooks of the roles they have (``roles``); the template methods are final."""

    tensor_template = True  # Kind names the required hooks a subclass leaves unwritten
    compiles = True  # --precision-compile adds a compiled variant of each (cases go through ``call``)
    fresh = FRESH  # inputs from each target's own seed (kinds.fresh), by ``fresh_regime``
    declarations = {**Kind.declarations, **CONTRACT_DECLARATIONS}
    # numerics
    peer_name: str = "torch's op"
    forward_output: str = "reference"  # the forward output's name (the golden's array name)
    grad_inputs: tuple[str, ...] = ()  # inputs whose gradients are outputs, named "d" + input
    # a peer for the target that *is* ``peer`` (the built-in torch target): another correct
    # implementation of the same math, so that the oracle check can fail; None where there is none
    independent_peer: Callable | None = None
    independent_peer_name = "an independent implementation"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        overridden = [m for m in TEMPLATE_METHODS if m in vars(cls)]
        if overridden:
            raise TypeError(f"{cls.__name__} overrides TensorKind's template method {', '.join(overridden)}: override "
                            "its hooks instead (output_rule with rule_facts for what a measurement needs), or "
                            "subclass pytest_precision.Kind and implement run, bench_call and trace_call")

    def for_target(self, case: Case, inputs: Any) -> Any:
        """The regime's inputs as the case's target reads them (attention: its causal alignment)."""
        return inputs

    @abstractmethod
    def floating_inputs(self, inputs: Any) -> dict[str, torch.Tensor]:
        """The input tensors a config rounds, by name (the rest of ``inputs`` passes as it is)."""

    def other_tensors(self, inputs: Any) -> dict[str, torch.Tensor]:
        """The other tensors the target is handed (masks, labels: checked left alone, kinds.tensor.contract)."""
        return other_tensor_fields(inputs, self.floating_inputs(inputs))

    def case_grad_inputs(self, case: Case, inputs: Any = None) -> tuple[str, ...]:
        """The inputs whose gradients the case judges: none for a forward-only target."""
        return () if case.target.declared.get("forward_only") else self.grad_inputs

    @abstractmethod
    def invoke(self, fn: Callable, values: dict[str, torch.Tensor], inputs: Any, device: str) -> torch.Tensor:
        """Call ``fn`` in the kind's convention on ``values`` (and the non-tensor parts of ``inputs``)."""

    @abstractmethod
    def expected_shape(self, values: dict[str, torch.Tensor], inputs: Any) -> tuple[int, ...]:
        """The shape the forward output must have for ``values``."""

    def output_dtypes(self, config: Any, values: dict[str, torch.Tensor]) -> tuple[torch.dtype, ...]:
        """The dtypes the forward output may have under ``config``: the dtype of the first floating
        input (the kind's output is typed as its input: softmax's x, attention's q); under
        autocast also the autocast dtype (an op autocast lowers returns it); under an fp8 recipe
        also the fp8 format (a kernel may return it quantised; the callable itself sees fp32).
        Anything else, float64 included, is a break of the kind's contract in every config."""
        dtypes = [next(iter(values.values())).dtype]
        for extra in (getattr(config, "autocast_dtype", None), getattr(config, "fp8", None)):
            if extra is not None and extra not in dtypes:
                dtypes.append(extra)
        return tuple(dtypes)

    def validate(self, case: Case, out: Any, values: dict[str, torch.Tensor], inputs: Any, where: str,
                 wider: bool = False) -> None:
        """Raise TargetError when ``out`` breaks the kind's output contract: its type, its shape
        (``expected_shape``) or its dtype (``output_dtypes``); with ``wider`` (a peer's output), a
        floating dtype more precise than the contract's is allowed too (``measure`` rounds it once to
        the target's: a float64 result rounded to the config's dtype is the best peer there is)."""
        if not isinstance(out, torch.Tensor):
            raise TargetError(f"{where} returned {type(out).__name__}, expected a tensor")
        expect = tuple(self.expected_shape(values, inputs))
        if tuple(out.shape) != expect:
            raise TargetError(f"{where}: shape mismatch, output {tuple(out.shape)}, expected {expect}")
        allowed = self.output_dtypes(case.config, values)
        if wider and out.is_floating_point() and any(out.dtype.itemsize > d.itemsize for d in allowed):
            return
        if out.dtype not in allowed:
            what = " or ".join(str(d) for d in allowed)
            raise TargetError(f"{where}: output dtype {out.dtype}, the kind gives {what} under {case.config.id}")

    @abstractmethod
    def reference(self, *args, **kwargs) -> torch.Tensor:
        """The exact result in the kind's convention, run in float64 on the rounded inputs."""

    @abstractmethod
    def peer(self, *args, **kwargs) -> torch.Tensor:
        """A trusted implementation in the kind's convention, run in the same config."""

    def peer_for(self, target: Target) -> tuple[Callable, str]:
        """The peer a target is held against, and its name for messages: ``peer``, or the
        independent peer when the target is ``peer`` itself (comparing it with itself could not fail)."""
        if target.fn == self.peer and self.independent_peer is not None:
            return self.independent_peer, self.independent_peer_name
        return self.peer, self.peer_name

    def peer_is_exact(self, case: Case, inputs: Any) -> bool:
        """Whether the case's peer is the exact result itself (rounded by ``output_rule``), so that
        no peer runs: the op kind's, for a target that declares neither peer nor reference."""
        return False

    def rule_facts(self, ctx: MeasureContext) -> Any:
        """What ``output_rule`` needs of a measurement beyond its context, computed once before the
        target runs (``ctx.facts``; norm: the oracle's sensitivity), or None."""
        return None

    def output_rule(self, ctx: MeasureContext, name: str, out: torch.Tensor, peer: torch.Tensor,
                    ref: torch.Tensor) -> OutputRule:
        """How output ``name`` is compared. The default: the forward output in the ULPs of what the
        config produced (fp8 dequantised), gradients in the autocast dtype under autocast and in
        e5m2 under fp8; ULP budgets, peer factor 2."""
        config = ctx.case.config
        if name == self.forward_output:
            o, scale = config.finish(out)
            p, peer_scale = config.finish(peer)
            return OutputRule(config.ulp_dtype(out), scale, out=o, peer=p, peer_scale=peer_scale)
        from ...numerics.configs import fp8_roundtrip

        if config.fp8 is not None:  # fp8 recipes carry gradients in e5m2
            o, scale = fp8_roundtrip(out, torch.float8_e5m2)
            p, peer_scale = fp8_roundtrip(peer, torch.float8_e5m2)
            return OutputRule(torch.float8_e5m2, scale, out=o, peer=p, peer_scale=peer_scale)
        if config.autocast_dtype is not None:  # gradients of fp32 leaves under autocast are computed in it
            dtype = config.autocast_dtype
        else:
            dtype = out.dtype if out.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) \
                else torch.float32
        return OutputRule(dtype, out=out, peer=peer)

    # ---- template methods ------------------------------------------------------------------------

    @final
    def case_inputs(self, case: Case) -> CaseInputs:
        """The case's seeded inputs as its target reads them, or why it does not run here (the
        config, a variant, or what the target declared about the config or the inputs)."""
        reason = self.skip_reason(case)
        if reason:
            return CaseInputs(reason)
        reason = self.unsupported(case)
        if not reason:
            regime = self.regimes_for(case.target).get(case.regime) or fresh_regime_of(self, case)
            if regime is None:
                drawn = self.drawn_for(case.target)
                if drawn is None or case.regime != drawn.name:
                    raise KeyError(f"{case.regime!r} is no regime of target {case.target.name!r} ({self.name})")
                return CaseInputs()
            inputs = self.for_target(case, regime.inputs())
            reason = self.unsupported(case, inputs)
            if not reason:
                return CaseInputs(None, regime, inputs)
        return CaseInputs(f"{case.target.name}: {reason}")

    @final
    def why_skipped(self, case: Case) -> str | None:
        return self.case_inputs(case).skipped

    @final
    def run(self, case: Case, baseline: BaselineCheck) -> Outcome:
        """Judge one case three ways: against the float64 oracle with the peer budget, against the
        golden with the regression budget, and by its overflow / underflow / NaN counts."""
        got = self.case_inputs(case)
        if got.skipped:
            skip(got.skipped)
        if got.regime is None:
            return attack(self, case)
        regime, inputs = got.regime, got.inputs
        try:
            m = self.measure(case, inputs, grad_seed=regime.seed + 1)
        except TargetError as e:
            if e.from_target and not e.declarations:
                e.declarations, e.features = self._lacking(case, inputs)
            raise
        check_contract(self, case, inputs, m, regime.seed + 1)
        result = fresh_result(self, case) or baseline.check_outputs(
            m.goldens(), inputs=self.checksum_input(inputs), seed=regime.seed, input_spec=self.input_spec(regime, inputs))
        outcome = self.outcome(case, m, result, self.magnitude_input(inputs))
        # the declarations that would skip this case: one the run finds elsewhere is not offered when it
        # would skip a case that passes (reporting.declarations)
        outcome.skipped_by = list(self._lacking(case, inputs, self.skipping_declarations(case.target))[0])
        if not outcome.passed:
            excuse = interpreter_excuse(m.launches)
            if excuse:
                xfail(excuse)
            hint = None if self._by_convention(case, regime, m, inputs, outcome) else self.hint(case, m, inputs)
            if hint:
                outcome.details.append(hint)
            note_fresh(self, case, regime, inputs, outcome.details)
            if m.lost or "underflow" in outcome.categories:
                outcome.fault = locate_fault(self, case, m, inputs, regime.seed + 1, outcome)
        return outcome

    @final
    def measure(self, case: Case, inputs: Any, grad_seed: int = 0) -> Measurement:
        """Run the target, the peer and the oracle on ``inputs`` under the case's config."""
        prepared = {n: case.config.prepare(t, case.device) for n, t in self.floating_inputs(inputs).items()}
        values = {n: p.value for n, p in prepared.items()}
        ctx = MeasureContext(case, inputs, {n: p.exact for n, p in prepared.items()}, grad_seed)
        ctx.facts = self.rule_facts(ctx)
        refs = self.reference_outputs(ctx.exact, inputs, grad_seed, self.case_grad_inputs(case, inputs))
        rng_state = RngState.capture(case.device)  # what a first-fault re-run replays (dropout draws the same mask)
        launches: list = []
        breaches: list[tuple[str, Declaration]] = []
        try:
            with watch_launches() as launches:
                mine = self.call(case, case.target.fn, values, inputs, grad_seed, breaches=breaches)
        except TargetError as e:
            e.from_target = True
            reason = case.variant.unavailable(e, case)
            if reason:
                skip(reason)
            # an interpreted launch ran a bf16 op the interpreter cannot run as a GPU does (bf16 atomics raise there)
            excuse = interpreter_excuse(launches, error=e.__cause__ or e)
            if excuse:
                xfail(excuse)
            raise
        peer_fn, peer_name = self.peer_for(case.target)
        if self.peer_is_exact(case, inputs):  # nothing to run: output_rule rounds the exact result
            peer = refs
        else:
            peer_where = f"peer ({peer_name}) under config {case.config.id} on regime {case.regime}"
            try:
                peer = self.call(replace(case, variant=NO_VARIANT), peer_fn, values, inputs, grad_seed,
                                 where=peer_where, peer=True)
            except TargetError as e:
                if breaches:  # what the target's own call showed is not hidden behind its peer's error
                    e.args = (f"{e}; and {case.target.name}: " + "; ".join(b for b, _ in breaches),)
                    e.needs = tuple(d for _, d in breaches)
                raise
        out = self.forward_output
        if peer[out].is_floating_point() and peer[out].dtype not in self.output_dtypes(case.config, values):
            peer = {**peer, out: peer[out].to(mine[out].dtype)}  # a more precise peer, rounded once as the target's
        m = Measurement(values, ctx.exact, mine, peer_name=peer_name, launches=launches, rng_state=rng_state)
        m.contract += [("contract", f"{case.target.name}: {b}", d) for b, d in breaches]
        for name, ref in refs.items():
            rule = self.rule(ctx, name, mine[name], peer[name], ref)
            against_peer = rule.peer_oracle(ref)
            golden = TensorOutput(rule.out, ref, rule.comparison_spec(), peer=against_peer)
            m.results[name] = OutputResult(rule.oracle(ref), against_peer, rule.budget(against_peer), golden)
        m.notes += ctx.notes
        case.variant.beside(self, ctx, m)
        return m

    @final
    def rule(self, ctx: MeasureContext, name: str, out: torch.Tensor, peer: torch.Tensor,
             ref: torch.Tensor) -> OutputRule:
        """``output_rule`` for output ``name``, kept in ``ctx.rules`` for the outputs after it."""
        ctx.rules[name] = self.output_rule(ctx, name, out, peer, ref)
        return ctx.rules[name]

    @final
    def call(self, case: Case, fn: Callable, values: dict[str, torch.Tensor], inputs: Any, grad_seed: int = 0, *,
             where: str | None = None, check: bool = True, breaches: list | None = None,
             upstream: torch.Tensor | None = None, forward_only: bool = False,
             peer: bool = False) -> dict[str, torch.Tensor]:
        """``fn`` on copies of ``values`` under the case's config and variant: the forward output and,
        for ``grad_inputs``, the gradients under a seeded upstream gradient (or ``upstream``). Anything
        it raises, and any break of the output contract, is a TargetError naming the target, config
        and regime; with ``breaches`` given, inputs changed in place and an output aliasing an input
        are sentences added to it (``kinds.tensor.contract``); ``peer``: a peer's call, whose output may be
        more precise than the contract's (``measure`` rounds it)."""
        return call_target(self, case, fn, values, inputs, grad_seed, where=where or case.where, check=check,
                           breaches=breaches, upstream=upstream, forward_only=forward_only, peer=peer)

    @final
    def reference_outputs(self, exact: dict[str, torch.Tensor], inputs: Any, grad_seed: int,
                          grads: tuple[str, ...], move_upstream: Callable | None = None) -> dict[str, torch.Tensor]:
        """The oracle: ``reference`` in float64 on the rounded inputs, with the same upstream gradient
        (moved by ``move_upstream``, as a kind's floor may move the inputs too)."""
        leaves = {n: t.detach().clone().requires_grad_(n in grads) for n, t in exact.items()}
        out = self.invoke(self.reference, leaves, inputs, "cpu")
        refs = {self.forward_output: out.detach()}
        if grads:
            upstream = upstream_gradient(out.shape, grad_seed)
            out.backward(upstream if move_upstream is None else move_upstream(upstream))
            refs.update({f"d{n}": leaves[n].grad for n in grads})
        return refs

    @final
    def outcome(self, case: Case, m: Measurement, result: BaselineResult,
                magnitude_input: torch.Tensor | None = None) -> Outcome:
        """The case's outcome: every output's oracle and compiled-vs-eager verdicts, then the golden's."""
        outcome = Outcome(self.suite, self.name, case.target.name, case.config_id, case.regime,
                          TensorEvidence(m, magnitude_input), result)
        several = len(m.results) > 1
        for category, sentence, *declared in m.contract:
            outcome.add("contract", category, sentence, *declared)
        for name, r in m.results.items():
            label = f"{name}: " if several else ""
            for cat, s in violations(r.oracle, r.peer_budget):
                outcome.add("oracle", cat, f"oracle: {label}{s}")
            eager = r.eager
            if eager is not None and r.eager_budget is not None:
                for _, s in violations(r.oracle, r.eager_budget):
                    outcome.add("compiled", "compiled", f"compiled vs eager: {label}{s} (eager: max ULP "
                                                        f"{eager.max_ulp:.4g}, max abs {eager.max_abs:.4g})")
        outcome.problems += baseline_problems(result)
        return outcome

    def _lacking(self, case: Case, inputs: Any, candidates: list[Declaration] | None = None
                 ) -> tuple[tuple[Declaration, ...], tuple[str, ...]]:
        """The declarations of ``candidates`` (default ``feature_declarations``) that would skip
        ``inputs``, and what the inputs have that each names (the kind's skip reason, after its
        "declares ...; " part). A key the target declared is left out: what it declared it supports,
        it is held to."""
        found, features = [], []
        for d in self.feature_declarations(case.target) if candidates is None else candidates:
            if d.key in case.target.declared:
                continue
            reason = self.unsupported(replace(case, target=self.declaring(case.target, [d])), inputs)
            if reason:
                found.append(d)
                features.append(reason.split("; ", 1)[-1])
        return tuple(found), tuple(features)

    def _by_convention(self, case: Case, regime: Regime, m: Measurement, inputs: Any, outcome: Outcome) -> bool:
        """Whether the failing case's oracle problems are a convention the target can declare
        (``conventions``): judged again under each (then under all together), the first under which
        it passes, or is skipped, replaces them with ``convention`` problems naming it. Only for keys the
        target left undeclared: one it declared is its convention, and an output off it a defect."""
        # a convention the target declared is its own: an output off it is a defect, not another convention
        found = [(d, s) for d, s in self.conventions(case, m, inputs) if d.key not in case.target.declared]
        if not found or not any(p.check == "oracle" for p in outcome.problems):
            return False
        trials = [[f] for f in found] + ([found] if len(found) > 1 else [])
        for trial in trials:
            declared = replace(case, target=self.declaring(case.target, [d for d, _ in trial]))
            again = self.for_target(declared, regime.inputs())
            if not self.unsupported(declared, again):
                try:
                    if self.measure(declared, again, grad_seed=regime.seed + 1).failed_outputs():
                        continue
                except TargetError:
                    continue
            rest = [p for p in outcome.problems if p.check != "oracle"]
            outcome.problems = [Problem("oracle", "convention", s, d) for d, s in trial] + rest
            return True
        return False

    @final
    def bench_call(self, case: Case) -> Bench | None:
        """The timed call of a case: the target's forward on the regime's inputs under the config
        and variant, or None where the case has nothing to time (drawn and fresh inputs have no fixed
        size, and a Triton kernel under the interpreter runs at the interpreter's speed)."""
        if interpreted(case.target.fn, case.device) or is_fresh(case):
            return None
        got, values = self._fixed_values(case)
        if values is None:
            return None
        inputs = got.inputs

        @contextlib.contextmanager
        def context():
            with torch.no_grad(), case.config.active(case.device), case.variant.context():
                yield
        fn = case.variant.wrap(case.target.fn)
        return Bench(lambda: self.invoke(fn, values, inputs, case.device), context=context)

    @final
    def trace_call(self, case: Case) -> Callable | None:
        """The call --precision-trace and --precision-audit run traced: forward and the gradients,
        in the config and variant, as the case runs them."""
        got, values = self._fixed_values(case)
        if values is None:
            return None
        return lambda: self.call(case, case.target.fn, values, got.inputs, got.regime.seed + 1)

    def _fixed_values(self, case: Case) -> tuple[CaseInputs, dict[str, torch.Tensor] | None]:
        """The case's seeded inputs and their values as the config feeds them; None for the values
        where there are none to run (a skipped case, the drawn regime)."""
        got = self.case_inputs(case)
        if got.skipped or got.regime is None:
            return got, None
        return got, {n: case.config.prepare(t, case.device).value for n, t in self.floating_inputs(got.inputs).items()}
