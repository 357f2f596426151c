"""The op kind: any tensor operation (GELU, rotary embeddings, a fused MLP, a custom matmul), declared
as data at registration, as a torch ``OpInfo`` entry is, rather than written as a kind::

    pytest_precision.register("gelu", my_gelu, kind="op",
                              inputs={"unit": lambda g: torch.randn(64, 256, generator=g),
                                      "wide": lambda g: 8 * torch.randn(64, 256, generator=g)})

What a target declares (``OpKind.declarations``), and the decisions behind it:

- ``inputs`` (required): regime name -> generator. A generator gets a CPU ``torch.Generator``
  seeded from the regime's name and runs with its normal draws made portable (``torch.randn`` in
  float32 draws in float64 and rounds once: the same bits on every CPU, which torch's own float32
  draw is not), and returns one tensor (the one
  positional argument, named ``arg0``), a tuple (positional arguments ``arg0``, ``arg1``, ...) or
  a dict (keyword arguments, named by their keys). Floating tensors are the inputs a config rounds
  (and whose gradients are judged); anything else (integer positions, bool masks, ints, flags)
  passes through as it is. One regime may be a Hypothesis strategy drawing the same structure
  instead: the drawn regime, searched for a failing input (``examples=`` of them, default 30).
  A generator must give the same inputs on every call (checked once per regime).
- ``reference``: the exact result, run in float64 on the config's rounded inputs. Default: the
  target itself on float64 inputs; its explicit casts (``.float()``) are then part of what it
  computes, arithmetic that follows the input dtype is what the configs vary. It must return
  float64.
- ``peer``: a trusted implementation in the same convention, run in the same config. Default: the
  declared ``reference`` run in the config (in its dtypes, under its autocast and TF32 flags: the
  same math written plainly, a careful implementation's arithmetic), or, with none declared, the
  exact result rounded to the dtype the target returned. Never the target's own arithmetic (its
  float32 run was the peer of 16-bit configs once): a defect present at every precision would be
  its own budget, invisible until a golden from correct code judged it, which a repository that
  adopts the harness with the defect in never has. Measured on this CPU: composite ops that round
  each step to 16 bits (a GELU MLP with its backward, SwiGLU, rotary embeddings, a LLaMA RMSNorm)
  stay at or below 0.78 of that budget, while a matmul summing 256 products in 16 bits is 2.7 x
  over it, and a weight gradient summed over a batch of 128 in 16 bits 1.5 x.
- one output tensor, shaped as the reference's; ``grads`` names the floating inputs whose
  gradients are judged too (default: every floating input, under a seeded upstream gradient;
  ``forward_only=True``: none). Factor 2 on the output, 3 on gradients (FlashAttention's rule).
- ``error``: ``"abs"`` (default) judges absolute error with floors scaled by the output's
  magnitude, as attention does: GELU, matmuls, rotations and MLPs give values that cross zero,
  where an output's ULP count near zero measures cancellation, not the op. ``"ulp"`` judges ULPs
  (ops whose outputs keep their relative precision: exp, norms of positive values).

Budgets on absolute error: the peer factor x the peer's max error plus ``ULP_FLOOR`` ULPs of the
dtype at the output's largest magnitude, and the peer factor x its RMS error plus
``RMS_FLOOR_ULPS`` ULPs at the output's RMS magnitude (a sum kept in 16 bits shows there first).
Both grow by the peer factor x how far the exact result moves when the floating inputs (and, for
gradients, the upstream gradient the backward sums: a bias's gradient is its sum over the batch)
move as the config's arithmetic may move them (``moved_inputs``): rounded to the autocast dtype (a float32 peer never
sees that rounding, and no implementation under autocast escapes it) or to TF32, elsewhere by a
few float32 ULPs (the backward error of float32 arithmetic, which the exact-result peer of fp32
lacks). The golden's typical-error floor is ``ULP_FLOOR`` float32 ULPs at the RMS magnitude plus
the same move. A 0 where the exact value is nonzero is underflow only beyond the max-abs budget:
a smaller one is cancellation of larger terms (``1 + tanh(u)`` of GELU far below 0 in float32),
judged as error; an ``error="ulp"`` op counts any representable value lost to 0.

Floors of a gated op's gradients: no budget sits below 2 ULPs of the dtype's smallest subnormal
(every fp16 gradient of ``numerics.gates``' fp16-flush regime is subnormal), nor below what a float32
intermediate under float32's normal range loses (torch's CPU sigmoid is 0 below -88.7, where SiLU is
still normal) times the inputs' and the upstream gradient's largest magnitudes.

More measured (CPU, torch 2.13, against the float64 reference):

- inputs: before the generators' normal draws were made portable, goldens recorded on an AVX512
  machine failed 19 cases under ``ATEN_CPU_CAPABILITY=default`` ("the inputs changed since the golden
  was accepted");
- the peer: a GELU approximated as ``x * sigmoid(1.6 x)``, 0.03 off, declared against
  ``reference=F.gelu``, fails fp32, fp16 and bf16 with no golden; the tanh approximation of GELU
  against ``F.gelu`` fails fp32 (92 x over the budget) and passes fp16 and bf16, whose rounding is
  larger than the approximation;
- absolute error: a correct rotary embedding is 98 ULPs off in bf16 at an output of -0.0003 that
  ``x1 * sin + x2 * cos`` cancelled from terms near 1, where its largest absolute error is 0.015. One
  computing its angles and their sin and cos in the input dtype fails fp16 at positions 4000 to 4015
  (365 x over the budget; fp16's spacing at 4000 is 2 radians) and fp32 there too (74 x: float32
  angles at 4000 are off by 2^-12 radians), and passes near position 0;
- the move of the exact result: ``torch.matmul`` over 4096 terms and an MLP of width 1024 stay under
  40 % of the budget in fp32 with +-4 float32 ULPs of move; an MLP of width 512 failed with +-1. A
  naive matmul summing 256 products in fp16 is 2.6 x over the RMS budget, one accumulating in
  float32 0.25 x;
- underflow: for x below about -5 GELU's ``1 + tanh(u)`` is 0 in float32 where float64 keeps 5e-7,
  and so is its gradient (6 to 54 zeros per case on ``8 * randn(64, 256)``): Hugging Face's
  ``NewGELUActivation`` and ``F.gelu(approximate="tanh")`` failed ``fp32`` with ``underflow 54 > 0
  allowed`` before underflow was judged beyond the max-abs budget only; they pass every config now,
  as ``F.softplus`` and ``log(1 + exp(x))`` do (the latter fails fp16, where exp overflows past
  11.09). A SiLU whose sigmoid is cut to 0 below -4 still counts 554 underflows.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch

from pytest_precision.kinds import (ABS_ERROR_TABLE, GRAD_PEER_FACTOR, PEER_FACTOR, ULP_FLOOR, Case, Declaration,
                                    DrawnRegime, MeasureContext, Memo, OutputRule, Regime, Target, TargetError,
                                    TensorKind, abs_floor, compare, declared_dtypes, float32_as_float64, format_of)

from .op_call import OpCall, batch_dims, dtypes_of, lost_where_finite, one_tensor_rule
from .op_inputs import (BASE_SEED, FLOAT32_GRAD_MOVE_ULPS, OpInputs, declared_callable, declared_inputs, moved_inputs,
                        round_to_tf32)

__all__ = ["OP", "OpKind", "OpInputs", "round_to_tf32", "BASE_SEED", "DEFAULT_EXAMPLES"]

DEFAULT_EXAMPLES = 30
REPEATABLE: Memo[tuple, bool] = Memo("(target, regime) -> seen to give the same inputs twice")
# the RMS floor of the peer budget, in ULPs of the dtype at the output's RMS magnitude: rounding
# the output alone costs about 0.2 (measured: fp16 matmuls accumulated in fp32), a few more
# roundings inside (a composite GELU) about twice that; a sum kept in fp16 over 64 terms 1.2
RMS_FLOOR_ULPS = 0.5
def _range_floor(ctx: MeasureContext, name: str) -> float:
    """What a float32 intermediate below float32's normal range may lose (its value: torch's CPU
    sigmoid is 1 / (1 + exp(-x)), 0 once exp overflows below x = -88.7, where SiLU is still a
    normal number; GPUs flush float32 subnormals), times what multiplies it at most: every floating
    input's largest magnitude (at least 1), and the upstream gradient's for a gradient."""
    factor = math.prod(max(1.0, float(t.abs().max())) for t in ctx.exact.values() if t.numel())
    if name != OpKind.forward_output:
        factor *= max(1.0, float(ctx.upstream(ctx.facts[OpKind.forward_output].shape).abs().max()))
    return factor * torch.finfo(torch.float32).tiny


class OpKind(TensorKind):
    name = "op"
    contract = ("fn(*inputs) or fn(**inputs) -> one tensor; inputs=, and optionally reference=, peer=, grads=, "
                "error=, declared at registration")
    peer_name = "the declared peer, else the declared reference run in the config, else the exact result rounded"
    table = ABS_ERROR_TABLE
    forward_output = "out"
    declarations = {
        **TensorKind.declarations,
        "inputs": "regime name -> generator(torch.Generator) returning a tensor, a tuple (positional) or a dict "
                  "(keyword) of inputs, or a Hypothesis strategy drawing them (the drawn regime); required",
        "reference": "the exact result in the same convention, run in float64; default: the target on float64 inputs",
        "peer": "a trusted implementation, run in the same config; default: the declared reference run in the config, "
                "else the exact result rounded",
        "grads": "names of the floating inputs whose gradients are judged (arg0, ... or keywords); default: all",
        "error": "'abs' (default: absolute error, floors scaled by the output's magnitude) or 'ulp'",
        "out_dtype": "the dtype of its output in every config (a float32 loss from 16-bit logits), judged in it; "
                     "default: the inputs' dtype (or autocast's)",
        "examples": f"how many examples the drawn regime tries (default {DEFAULT_EXAMPLES})",
        "batch_dim": "the dimension along which rows are independent: an int (of the output and every tensor input) "
                     "or {input name or 'out': dim}; enables the batch-invariance probes",
    }

    # ---- what a target declares ----------------------------------------------------------------

    def declare(self, name: str, declared: dict) -> dict:
        if "inputs" not in declared:
            raise TypeError(f"target {name!r} (op): inputs= is required: register(name, fn, kind='op', "
                            "inputs={'unit': lambda g: torch.randn(..., generator=g)}) (an ini line cannot declare it)")
        return super().declare(name, declared)

    def normalise_declaration(self, name: str, key: str, value: Any) -> Any:
        if key == "inputs":
            return declared_inputs(name, value)
        if key in ("reference", "peer"):
            return declared_callable(name, key, value)
        if key == "out_dtype":
            dtypes = declared_dtypes(name, value, key)
            if len(dtypes) != 1:
                raise ValueError(f"target {name!r} (op): out_dtype={value!r}: expected one dtype")
            return dtypes[0]
        if key == "grads":
            names = (value,) if isinstance(value, str) else value
            if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
                raise TypeError(f"target {name!r} (op): grads={value!r}: expected input names")
            return tuple(names)
        if key == "error":
            if value not in ("abs", "ulp"):
                raise ValueError(f"target {name!r} (op): error={value!r}: expected 'abs' or 'ulp'")
            return value
        if key == "batch_dim":
            ok = isinstance(value, int) and not isinstance(value, bool) or isinstance(value, dict) and all(
                isinstance(k, str) and isinstance(v, int) for k, v in value.items()) and "out" in value
            if not ok:
                raise ValueError(f"target {name!r} (op): batch_dim={value!r}: expected an int or "
                                 "{input name: dim, ..., 'out': dim}")
            return value
        if key == "examples":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"target {name!r} (op): examples={value!r}: expected a positive int")
            return value
        return super().normalise_declaration(name, key, value)

    @staticmethod
    def _spec(target: Target) -> OpInputs:
        spec = target.declared.get("inputs")
        if spec is None:
            raise ValueError(f"target {target.name!r} (op) declares no inputs=: an op target registers with "
                             "pytest_precision.register(name, fn, kind='op', inputs=...) in a conftest.py")
        return spec

    def regimes_for(self, target: Target) -> dict[str, Regime]:
        return self._spec(target).regimes

    def drawn_for(self, target: Target) -> DrawnRegime | None:
        spec = self._spec(target)
        return None if spec.drawn is None else DrawnRegime(spec.drawn, target.declared.get("examples",
                                                                                           DEFAULT_EXAMPLES))

    def for_target(self, case: Case, raw: Any) -> OpCall:
        where = f"target {case.target.name!r} (op), inputs regime {case.regime!r}"
        call = OpCall(case.target, raw, where)
        spec = self._spec(case.target)
        regime = spec.regimes.get(case.regime)
        repeatable = case.state.memo(REPEATABLE)
        if regime is not None and (case.target.name, case.regime) not in repeatable:
            if not call.same_as(OpCall(case.target, regime.inputs(), where)):
                raise TargetError(f"{where}: the generator gave different inputs on two calls; draw from the "
                                  "torch.Generator it is given (the same bits on every machine and run)")
            repeatable[case.target.name, case.regime] = True
        if case.target.declared.get("batch_dim") is not None:  # its names and dimensions, in every case
            call.batch(batch_dims(call, case.target.declared["batch_dim"]), where)
        return call

    def case_grad_inputs(self, case: Case, call: OpCall | None = None) -> tuple[str, ...]:
        if case.target.declared.get("forward_only") or call is None:
            return ()
        chosen = case.target.declared.get("grads")
        if chosen is None:
            return tuple(call.floating)
        unknown = [n for n in chosen if n not in call.floating]
        if unknown:
            raise TargetError(f"target {case.target.name!r} (op): grads names {', '.join(map(repr, unknown))}; the "
                              f"floating inputs of regime {case.regime!r} are {', '.join(call.floating)}")
        return chosen

    # ---- calling convention ----------------------------------------------------------------------

    def floating_inputs(self, call: OpCall) -> dict[str, torch.Tensor]:
        return call.floating

    def invoke(self, fn, values, call: OpCall, device):
        if fn == self.reference:
            return self._reference(call, values, device)
        args, kwargs = call.arguments(values, device)
        if fn == self.peer:  # the declared reference in the config (without one, no peer runs: peer_is_exact)
            fn = call.target.declared.get("reference")
        return fn(*args, **kwargs)

    def reference(self, *args, **kwargs):
        """Stands for the case's target's reference (``invoke`` runs that one)."""
        raise NotImplementedError("the op kind's reference is each target's own")

    def _reference(self, call: OpCall, values: dict[str, torch.Tensor], device: str) -> torch.Tensor:
        declared = call.target.declared.get("reference")
        which = f"reference {getattr(declared, '__name__', repr(declared))}" if declared is not None else \
            "the target on float64 inputs"
        where = f"target {call.target.name!r} (op): its float64 reference ({which})"
        args, kwargs = call.arguments(values, device)
        # a target declaring a float32 output upcasts on purpose: run as its oracle, its float32 is float64
        exact = float32_as_float64() if declared is None and call.target.declared.get("out_dtype") == torch.float32 \
            else contextlib.nullcontext()
        try:
            with exact:
                out = (declared or call.target.fn)(*args, **kwargs)
        except Exception as e:
            raise TargetError(f"{where} raised {type(e).__name__}: {e}") from e
        if not isinstance(out, torch.Tensor):
            raise TargetError(f"{where} returned {one_tensor_rule(out)}")
        if out.dtype != torch.float64:
            error = TargetError(f"{where} returned {out.dtype} from float64 inputs: a cast inside it makes it no "
                                "oracle; declare reference= computing in float64")
            if declared is None and out.dtype == torch.float32 and "out_dtype" not in call.target.declared:
                # it computes in float32 on purpose (a loss from 16-bit logits): a contract it declares, and
                # its oracle then reads its float32 as float64
                error.declarations = (Declaration("out_dtype", torch.float32),)
                error.features, error.by_design = ("it returns a float32 result (from float64 inputs too)",), True
            raise error
        if any(v.requires_grad for v in values.values()) and not out.requires_grad:
            error = TargetError(f"{where}: its output has no gradient (detached, or computed outside torch); declare "
                                "forward_only=True or the grads= it has")
            if declared is None:  # the target's own: what its call in the config shows too
                error.declarations, error.by_design = (Declaration("forward_only", True),), True
                error.features = ("it returns an output without gradients",)
            raise error
        call.shape = tuple(out.shape)
        return out

    def expected_shape(self, values, call: OpCall):
        """The reference's output shape (run once on float64 copies when it has not run yet)."""
        if call.shape is None:
            with torch.no_grad():
                self._reference(call, {n: v.detach().to("cpu", torch.float64) for n, v in values.items()}, "cpu")
        return call.shape

    def other_tensors(self, call: OpCall) -> dict[str, torch.Tensor]:
        return call.others()

    def batch_size(self, case, call: OpCall, values):
        declared = case.target.declared.get("batch_dim")
        return None if declared is None else call.batch(batch_dims(call, declared), case.where)

    def rows_of(self, case, call: OpCall, values, rows):
        dims = batch_dims(call, case.target.declared["batch_dim"])
        sub = call.with_rows(dims, rows)
        return sub, {n: v.index_select(dims[n], rows.to(v.device)) if n in dims else v for n, v in values.items()}

    def output_rows(self, case, call: OpCall, out, rows):
        return out.index_select(batch_dims(call, case.target.declared["batch_dim"])["out"], rows.to(out.device))

    def validate(self, case, out, values, call, where, wider: bool = False):
        if isinstance(out, (tuple, list)):
            raise TargetError(f"{where} returned {one_tensor_rule(out)}")
        declared = case.target.declared.get("out_dtype")
        if declared is not None and isinstance(out, torch.Tensor) and not wider:
            if out.dtype != declared:
                raise TargetError(f"{where}: output dtype {out.dtype}, where it declares out_dtype={declared}")
            wider = True  # the shape is checked below; its dtype is the declared one
        if (isinstance(out, torch.Tensor) and out.dtype == torch.float32 and not wider and tuple(out.shape) == tuple(
                self.expected_shape(values, call)) and torch.float32 not in self.output_dtypes(case.config, values)):
            # a float32 result from 16-bit inputs (a loss kept in float32): a contract it can declare
            error = TargetError(f"{where}: output dtype {out.dtype}, the kind gives "
                                f"{' or '.join(map(str, self.output_dtypes(case.config, values)))} under {case.config.id}")
            error.declarations, error.by_design = (Declaration("out_dtype", torch.float32),), True
            error.features = (f"it returned {out.dtype} from {', '.join(dtypes_of(values))} inputs",)
            raise error
        super().validate(case, out, values, call, where, wider=wider)

    def peer_for(self, target: Target) -> tuple[Callable, str]:
        """The declared peer, else the declared reference run in the config (an independent
        implementation, in the config's dtypes and under its autocast), else none: the exact result
        rounded as the target's output is (``peer_is_exact``, ``output_rule``). Never the target's
        own arithmetic, which would share a defect present at every precision."""
        peer = target.declared.get("peer")
        if peer is not None:
            return peer, f"peer {getattr(peer, '__name__', repr(peer))}"
        if target.declared.get("reference") is not None:
            return self.peer, "the declared reference"
        return self.peer, "the exact result rounded as its output (no peer= or reference= declared)"

    def peer(self, *args, **kwargs):
        """Stands for the default peer (``invoke`` runs the target's declared reference in the config)."""
        raise NotImplementedError("the op kind's default peer is each case's own")

    # ---- numerics ----------------------------------------------------------------------------

    def rule_facts(self, ctx: MeasureContext) -> dict[str, torch.Tensor]:
        """The oracle on the inputs moved as the config's arithmetic may move them (``moved_inputs``): how
        far that takes the exact result is a floor of the budgets (``output_rule``)."""
        config, grads = ctx.case.config, self.case_grad_inputs(ctx.case, ctx.inputs)
        move = moved_inputs(config, ctx.grad_seed + 7)
        # the upstream gradient moves as the inputs do: it is data the backward's arithmetic sums (a
        # bias's gradient is its sum over the batch, which moving the inputs leaves where it was)
        upstream = moved_inputs(config, ctx.grad_seed + 11)
        facts = self.reference_outputs({n: move(e) for n, e in ctx.exact.items()}, ctx.inputs, ctx.grad_seed, grads,
                                       upstream)
        plain = getattr(config, "autocast_dtype", None) is None and not getattr(config, "tf32", False)
        if grads and plain and self.peer_is_exact(ctx.case, ctx.inputs):  # FLOAT32_GRAD_MOVE_ULPS
            move = moved_inputs(config, ctx.grad_seed + 7, FLOAT32_GRAD_MOVE_ULPS)
            wider = self.reference_outputs({n: move(e) for n, e in ctx.exact.items()}, ctx.inputs, ctx.grad_seed, grads,
                                           upstream)
            facts.update({n: t for n, t in wider.items() if n != self.forward_output})
        return facts

    def peer_is_exact(self, case: Case, call: OpCall) -> bool:
        return case.target.declared.get("peer") is None and case.target.declared.get("reference") is None

    def output_rule(self, ctx: MeasureContext, name, out, peer, ref) -> OutputRule:
        declared = ctx.case.target.declared
        if declared.get("peer") is None:
            if declared.get("reference") is None:
                peer = ref  # no independent implementation: the exact result, rounded below as the output is
            elif (lost := lost_where_finite(peer, ref)) is not None:
                # the declared reference run in the config overflowed or lost values (x.pow(2) at 300 in fp16):
                # no careful implementation does; its error would set a budget that judges nothing
                ctx.notes.append(f"{name}: the declared reference, run in {ctx.case.config.id} as the peer, "
                                 f"{lost}; judged against the exact result rounded to {out.dtype} instead")
                peer = ref
        if peer.dtype != out.dtype and (declared.get("peer") is None or peer.dtype.itemsize > out.dtype.itemsize):
            peer = peer.to(out.dtype)  # a float64 (or float32) result rounded once: the exact result rounded
        rule = super().output_rule(ctx, name, out, peer, ref)
        rule.peer_factor = PEER_FACTOR if name == self.forward_output else GRAD_PEER_FACTOR
        # the moved inputs' exact result: an error a correct implementation has, scaled as the peer's
        moved = ctx.facts[name]
        if declared.get("error", "abs") == "ulp":
            shift = compare(moved, ref, rule.dtype, scale=rule.scale).max_ulp
            rule.ulp_floor += rule.peer_factor * shift if math.isfinite(shift) else 0.0
            return rule
        finite = torch.isfinite(ref)
        values = ref[finite].abs()
        top = float(values.max()) if values.numel() else 0.0
        rms = float(values.pow(2).mean().sqrt()) if values.numel() else 0.0
        diff = (moved - ref)[finite & torch.isfinite(moved)].abs()
        moved_max, moved_rms = (float(diff.max()), float(diff.pow(2).mean().sqrt())) if diff.numel() else (0.0, 0.0)
        eps = format_of(rule.dtype).eps
        lost = _range_floor(ctx, name)
        rule.abs_floor = abs_floor(top, rule.dtype) + rule.peer_factor * moved_max + lost
        # a zero within the max-abs budget is cancellation of larger terms (1 + tanh(u) of GELU far
        # below 0 in float32), judged as error; only a larger value lost to zero is underflow
        peer_off = (rule.peer.detach().to(ref.device, torch.float64) - ref)[finite & torch.isfinite(rule.peer).to(ref.device)]
        peer_max = float(peer_off.abs().max()) if peer_off.numel() else 0.0
        rule.underflow_floor = rule.abs_floor + rule.peer_factor * peer_max
        rule.peer_rms_floor = RMS_FLOOR_ULPS * rms * eps + rule.peer_factor * moved_rms + lost
        rule.rms_floor = ULP_FLOOR * rms * 2.0 ** -24 + rule.peer_factor * moved_rms + lost
        return rule

    # ---- goldens and drawn inputs ------------------------------------------------------------

    def input_spec(self, regime: Regime, call: OpCall) -> dict:
        # [name, dtype, shape] of each tensor, [name, repr] of the rest (the golden keeps plain values)
        inputs = [[n, str(v.dtype).removeprefix("torch."), list(v.shape)] if isinstance(v, torch.Tensor) else [n, repr(v)]
                  for n, v in call.slots]
        return {"regime": regime.name, "seed": regime.seed, "inputs": inputs}

    def checksum_input(self, call: OpCall) -> torch.Tensor:
        """Every tensor input (integer positions and masks too), as float64."""
        return torch.cat([v.flatten().to(torch.float64) for _, v in call.slots if isinstance(v, torch.Tensor)])

    def draw(self, case: Case):
        return self._spec(case.target).strategy

    def describe_drawn(self, example: Any, case: Case) -> list[str]:
        call = OpCall(case.target, example, f"target {case.target.name!r} (op)")
        return ["Hypothesis found (after shrinking) the inputs:", *("  " + line for line in call.describe())]


OP = OpKind()
