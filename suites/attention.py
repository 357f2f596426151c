"""The attention kind: attention targets x configs x SDPA backends x input regimes.

Target contract (kind ``attention``)::

    fn(q, k, v, causal: bool) -> out
    fn(q, k, v, causal: bool, key_padding_mask=mask) -> out     # for the padded regime

``q`` is (B, H, S_q, D); ``k`` and ``v`` are (B, H_kv, S_k, D) with H_kv dividing H (grouped-query
attention: query head h uses key/value head h // (H / H_kv)); ``out`` is (B, H, S_q, D) in q's
dtype. ``causal`` masks key j for query i when j > i (top-left aligned, as torch's ``is_causal``),
or when j > i + S_k - S_q for a target that declares ``causal="bottom-right"`` (torch's
``causal_lower_right``; decoding). ``key_padding_mask`` is (B, S_k) bool, True where a key is
padding; a target whose signature has no ``key_padding_mask`` is skipped on the padded regime with
that reason. Scores are scaled by 1/sqrt(D). What else a target supports it declares at
registration (``AttentionKind.declarations``); the cases outside are skipped with the reason.

Each case has three outputs, as FlashAttention's tests: the target, the float64 oracle on the
rounded inputs, and a peer (eager math attention in the same config). The forward error must be
at most 2 x the peer's plus a floor, the gradients of q, k and v (autograd with a fixed random
grad_out) at most 3 x the peer's plus a floor (``attention_floors``: the dtype's ULPs, exp's
conditioning and, for dq and dk, the size of the terms that cancel), all as max abs error; overflow,
underflow and NaN are counted on the output and every gradient. For a target that reaches SDPA, the backend
(``+math``, ``+flash`` and, on CUDA, ``+efficient``, ``+cudnn``) is forced around its call; a
target that does not (a first call watched, or ``sdpa=False`` declared) runs once, unsuffixed.

Measured on CPU (torch 2.13) over every regime in fp16, bf16, amp-fp16 and amp-bf16, as RMS error
over the peer's: correct targets (SDPA's math and flash backends, the interpreted Triton kernel,
Hugging Face's and nanoGPT's eager attention) at most 1.00 x on the output and 1.54 x on gradients
(SDPA flash's dk, amp-fp16 causal-cross); a softmax whose exp, sum and divide stay in 16 bits up to
1.55 x on the output and 3.2 x on gradients. Hugging Face's eager attention with that softmax fails
with no golden in fp16 (unit, long, causal, causal-cross, padded, causal-leftpad, causal136) and bf16
(long, causal, causal-cross, padded, causal136), at 1.006 to 1.33 x its budget; under autocast it
stays inside (the goldens see it there). A peer whose probabilities stay in float32 for ``p @ v`` was
measured too: 0.73 to 1.14 x this one's RMS error, which would put Hugging Face's eager attention at
up to 1.32 x on the output, over the budget. The regression budget's RMS is never below half the
peer's: where the 16-bit softmax is within the peer's RMS budget (sharp attention, whose error is
the scores' rounding), the goldens' RMS budgets still hold most 16-bit cases. An online softmax in
16-wide blocks without the rescale is bit-identical to the correct one on 16 keys and fails
square128. An additive mask built as ``torch.finfo(torch.float32).min`` and cast to fp16 or bf16 is
``-inf``: NaN on a fully masked row, where ``torch.finfo(q.dtype).min`` gives the mean of v. The
fresh regime leaves q unscaled, and sharper attention to the fixed regimes: on random shapes there,
correct targets went past the budgets (SDPA's flash backend in fp32 on 2 % of shapes at q scale 10).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from torch.overrides import TorchFunctionMode

from pytest_precision.kinds import (ABS_ERROR_TABLE, GRAD_PEER_FACTOR, NO_VARIANT, PEER_FACTOR, ULP_FLOOR, Case,
                                    Declaration, OutputRule, Regime, Target, TargetError, TensorKind, Variant,
                                    declared_flag, format_of, triton_error, uses_triton)
from pytest_precision.strategies import AttentionInputs

from .attention_floors import CancelledTerms, cancelled_terms, error_floor
from .attention_regimes import BASE_SEED, REGIMES, fresh_attention_regime
from .attention_masks import (FULLY_MASKED, allowed_keys, attention_scores, fully_masked_hint, fully_masked_returned,
                              fully_masked_sentence, reference_attention)

__all__ = ["ATTENTION", "AttentionKind", "SdpaBackend", "REGIMES", "attention_scores", "reference_attention",
           "error_floor", "sdpa", "BASE_SEED"]


_BACKENDS = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


class SdpaBackend(Variant):
    """One SDPA backend forced around the target's call (``+math``, ``+flash``, ...)."""

    def __init__(self, backend: str):
        self.backend = backend
        self.suffix = f"+{backend}"

    def context(self):
        return sdpa_kernel(_BACKENDS[self.backend])

    def unavailable(self, error: TargetError, case: Case) -> str | None:
        if "No available kernel" in str(error) or "No viable backend" in str(error):
            return f"{case.config_id}: SDPA backend {self.backend} cannot run this case on {case.device}"
        return None


def _distance(out: torch.Tensor, exact: dict, causal: bool, a: AttentionInputs, lower_right: bool) -> float | None:
    """The largest absolute difference of ``out`` from exact attention with the given mask (None
    where their finite elements disagree, or none is finite)."""
    with torch.no_grad():
        ref = reference_attention(exact["q"], exact["k"], exact["v"], causal, a.key_padding_mask, lower_right,
                                  a.fully_masked)
    out = out.detach().to("cpu", torch.float64)
    both = torch.isfinite(ref) & torch.isfinite(out)
    if bool((torch.isfinite(ref) != torch.isfinite(out)).any()) or not bool(both.any()):
        return None
    return float((out[both] - ref[both]).abs().max())


def sdpa(q, k, v, causal: bool = False, key_padding_mask=None):
    """torch's scaled_dot_product_attention in this kind's contract (the built-in target)."""
    if key_padding_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
    # SDPA takes no mask beside is_causal: both in one boolean mask, True where attended
    mask = allowed_keys(q.shape[-2], k.shape[-2], causal, key_padding_mask, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


class _SdpaWatch(TorchFunctionMode):
    """Notes whether a call reaches F.scaled_dot_product_attention (at torch's Python API, where a
    target's choice of SDPA shows, before any backend is picked)."""

    def __init__(self):
        super().__init__()
        self.reached = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.reached = True
        return func(*args, **(kwargs or {}))


def _probe_inputs(target: Target, device: str, dtype: torch.dtype):
    """q, k, v of the unit regime's shape (a head dim the target declared, if it declared some), in ``dtype``."""
    a = REGIMES["unit"].inputs()
    head_dims = target.declared.get("head_dims")
    d = a.q.shape[-1] if head_dims is None or head_dims(a.q.shape[-1]) else \
        next((n for n in (16, 32, 64, 128, 8, 256) if head_dims(n)), a.q.shape[-1])
    return tuple(torch.randn(*t.shape[:-1], d, generator=torch.Generator().manual_seed(0)).to(device, dtype)
                 for t in (a.q, a.k, a.v))


def reaches_sdpa(target: Target, device: str) -> bool:
    """Whether the SDPA backend variants apply to ``target``: what it declared (``sdpa=``), else
    what one call on the unit regime's inputs dispatched. A Triton kernel does not. The call is
    tried in each dtype the target declared (else float32, float16, bfloat16), without and then with
    the causal mask, until one runs: a target that declines a dtype or a mask from inside the callable
    (``pytest.skip``; nanoGPT's flash path is causal only), or raises for it (flash-attn refuses
    float32), is asked the next. A target that runs in none raises TargetError saying what each call
    did: the runner, which contains this call (``runner.variants``), then keeps every backend and
    the cases say why."""
    declared = target.declared.get("sdpa")
    if declared is not None:
        return declared
    if uses_triton(target.fn):
        return False
    import pytest

    declined = []
    masks = (False,) if target.declared.get("causal", "top-left") is None else (False, True)
    for dtype in target.declared.get("dtypes") or (torch.float32, torch.float16, torch.bfloat16):
        for causal in masks:
            watch = _SdpaWatch()
            try:
                q, k, v = _probe_inputs(target, device, dtype)
                with torch.no_grad(), watch:
                    target.fn(q, k, v, causal=causal)
                return watch.reached
            except pytest.skip.Exception as e:  # declined this dtype or mask: ask the next
                declined.append(f"{asked(dtype, causal)}: skipped ({e.msg})")
            except pytest.exit.Exception:  # an exit is no refusal of a dtype (contained by the runner)
                raise
            except Exception as e:
                if watch.reached:
                    return True
                if triton_error(e) is not None:  # a Triton kernel that cannot launch here is not SDPA
                    return False
                # flash-attn refuses float32 by raising: ask the next as for a skip
                declined.append(f"{asked(dtype, causal)}: raised {type(e).__name__}: {e}".splitlines()[0])
    raise TargetError(f"the probe call ran in no dtype ({'; '.join(declined)})")


def asked(dtype: torch.dtype, causal: bool) -> str:
    return str(dtype).removeprefix("torch.") + (", causal" if causal else "")


def _head_dims(name: str, value) -> "Callable[[int], bool]":
    if callable(value):
        return value
    try:
        allowed = frozenset(int(n) for n in ((value,) if isinstance(value, (int, str)) else value))
    except (TypeError, ValueError):
        raise ValueError(f"target {name!r}: head_dims={value!r}: expected head dims (ints) or a function of the "
                         "head dim returning True where supported") from None

    def supported(d: int) -> bool:
        return d in allowed

    supported.description = ", ".join(map(str, sorted(allowed)))
    return supported


# The peer budget's limits on the RMS error: a softmax whose exp, sum and divide are kept in 16 bits
# keeps its largest errors inside the max-abs floor (2 ULPs at the largest output), but its typical
# error grows. Measured on CPU, torch 2.13, against the peer (scores in the dtype, softmax in float32,
# p rounded to the dtype), over every regime x fp16, bf16, amp-fp16, amp-bf16: correct targets' RMS
# error (SDPA's math and flash backends, the interpreted Triton kernel, Hugging Face's and nanoGPT's
# eager attention) at most 1.00 x the peer's on the output and 1.54 x on gradients (SDPA flash, dk,
# amp-fp16 causal-cross); the 16-bit softmax up to 1.55 x on the output (fp16 unit) and 3.2 x on
# gradients (bf16 long). Below the max-abs factors, since an RMS over a tensor moves little between
# correct implementations; the floor is exp's conditioning and, for dq and dk, the cancelled terms'
# RMS size (``rms_floor``), which set fp32's budget.
PEER_RMS_FACTOR = 1.25
GRAD_PEER_RMS_FACTOR = 2.0


class AttentionKind(TensorKind):
    name = "attention"
    contract = "fn(q, k, v, causal[, key_padding_mask=]) -> (B, H, S_q, D) in q's dtype"
    regimes = REGIMES
    peer_name = "eager attention, softmax in float32"
    table = ABS_ERROR_TABLE  # judged on absolute error: attention outputs cross zero
    forward_output = "out"
    grad_inputs = ("q", "k", "v")
    declarations = {
        **TensorKind.declarations,
        "sdpa": "True/False: whether it calls scaled_dot_product_attention (the SDPA backend variants apply); "
                "default: watched on a first call",
        "head_dims": "the head dims it supports (ints, or a function of the head dim); default: every",
        "grouped_query": "False: k and v must have q's number of heads; default True",
        "padding": "False: no key_padding_mask; default: whether its signature has the keyword",
        "cross_lengths": "False: only S_q == S_k; default True",
        "causal": "'top-left' (default, torch's is_causal), 'bottom-right' (torch's causal_lower_right, decoding) "
                  "or None (no causal masking)",
        "causal_only": "True: it always masks causally, whatever its causal argument (a decoder's attention): the "
                       "regimes without a causal mask are skipped; default False",
        "fully_masked": "what it returns for a query whose keys are all masked: 'zero' (default, torch's SDPA), 'nan' "
                        "or 'mean' (the mean of v: an additive mask at the dtype's minimum, Hugging Face's eager)",
    }

    def normalise_declaration(self, name, key, value):
        if key in ("sdpa", "grouped_query", "padding", "cross_lengths", "causal_only"):
            return declared_flag(name, key, value)
        if key == "head_dims":
            return _head_dims(name, value)
        if key == "fully_masked":
            if value not in FULLY_MASKED:
                raise ValueError(f"target {name!r}: fully_masked={value!r}: expected one of "
                                 f"{', '.join(map(repr, FULLY_MASKED))}")
            return value
        if key == "causal":
            if value in (None, False, "none", "None", "false"):
                return None
            if value not in ("top-left", "bottom-right"):
                raise ValueError(f"target {name!r}: causal={value!r}: expected 'top-left', 'bottom-right' or None")
            return value
        return super().normalise_declaration(name, key, value)

    def unsupported(self, case: Case, a: AttentionInputs | None = None) -> str | None:
        reason = super().unsupported(case, a)
        if reason or a is None:
            return reason
        declared = case.target.declared
        head_dims, d = declared.get("head_dims"), a.q.shape[-1]
        if head_dims is not None and not head_dims(d):
            listed = getattr(head_dims, "description", None)
            return f"declares head dims {listed}; this regime has head dim {d}" if listed else \
                f"its head_dims declaration excludes head dim {d}; this regime has head dim {d}"
        if a.gqa and not declared.get("grouped_query", True):
            return f"declares grouped_query=False; this regime has {a.q.shape[1]} query heads over {a.k.shape[1]} key heads"
        if a.q.shape[-2] != a.k.shape[-2] and not declared.get("cross_lengths", True):
            return f"declares cross_lengths=False; this regime has S_q {a.q.shape[-2]} != S_k {a.k.shape[-2]}"
        if a.causal and declared.get("causal", "top-left") is None:
            return "declares causal=None; this regime has a causal mask"
        if not a.causal and declared.get("causal_only"):
            return "declares causal_only=True; this regime has no causal mask"
        if a.key_padding_mask is not None and not declared.get("padding", case.target.accepts("key_padding_mask")):
            if "padding" in declared:
                return "declares padding=False; this regime has key padding"
            return f"the {case.regime} regime needs a key_padding_mask keyword (see the attention contract)"
        return None

    # what a target may lack, each declaration skipping the inputs with that feature (TensorKind.run:
    # a target raising on a regime of one of them fails ``unsupported`` naming it); head dims: the
    # powers of two kernels commonly require (a power-of-two tl.arange, tl.dot's K >= 16)
    LACKING = (Declaration("grouped_query", False), Declaration("cross_lengths", False),
               Declaration("head_dims", (16, 32, 64, 128, 256)), Declaration("causal", None),
               Declaration("padding", False))

    def feature_declarations(self, target: Target) -> list[Declaration]:
        return list(self.LACKING)

    def skipping_declarations(self, target: Target) -> list[Declaration]:
        return [*self.LACKING, Declaration("causal_only", True)]

    def conventions(self, case: Case, m, a: AttentionInputs) -> list[tuple[Declaration, str]]:
        """A fully masked row's output in another convention (``fully_masked``), a causal mask of the
        other alignment (``causal``), a causal mask where none was asked (``causal_only``)."""
        found = []
        out, budget = m.outputs["out"], m.results["out"].peer_budget.max_abs or 0.0
        lower_right = a.causal_alignment == "bottom-right"
        rows, returned = fully_masked_returned(out, m.exact, a.causal, a.key_padding_mask, lower_right, budget)
        if returned in FULLY_MASKED and returned != a.fully_masked:
            found.append((Declaration("fully_masked", returned),
                          f"{fully_masked_sentence(rows, returned, a.fully_masked)}: declare fully_masked={returned!r}"))
        sq, sk = a.q.shape[-2], a.k.shape[-2]
        if a.causal and sq != sk:
            other = "top-left" if lower_right else "bottom-right"
            error = _distance(out, m.exact, True, a, other == "bottom-right")
            if error is not None and error <= budget:
                found.append((Declaration("causal", other),
                              f"the output matches a {other} causal mask (max abs {error:.3g} within the budget "
                              f"{budget:.3g}): declare causal={other!r}"))
        if not a.causal and not case.target.declared.get("causal_only") and case.target.declared.get(
                "causal", "top-left") is not None:
            alignment = case.target.declared.get("causal") or "top-left"
            error = _distance(out, m.exact, True, a, alignment == "bottom-right")
            if error is not None and error <= budget:
                found.append((Declaration("causal_only", True),
                              f"asked for no causal mask, the target applied one (its output matches causal attention "
                              f"within the budget, max abs {error:.3g}): if it is causal only, declare causal_only=True"))
        return found

    def fresh_regime(self, target: Target, seed: int) -> Regime | None:
        return fresh_attention_regime(target, seed)

    def for_target(self, case: Case, a: AttentionInputs) -> AttentionInputs:
        alignment = case.target.declared.get("causal") or "top-left"
        convention = case.target.declared.get("fully_masked", "zero")
        if (alignment, convention) == (a.causal_alignment, a.fully_masked):
            return a
        return dataclasses.replace(a, causal_alignment=alignment, fully_masked=convention)

    def hint(self, case: Case, m, a: AttentionInputs) -> str | None:
        """A failing case not explained by a convention (``conventions``: one it declared otherwise, or
        one under which it still fails): what it returned on fully masked query rows, or that its output
        matches the other causal alignment."""
        lower_right = a.causal_alignment == "bottom-right"
        out, budget = m.outputs["out"], m.results["out"].peer_budget.max_abs or 0.0
        masked_rows = fully_masked_hint(out, m.exact, a.causal, a.key_padding_mask, lower_right, a.fully_masked, budget)
        if masked_rows or not a.causal or a.q.shape[-2] == a.k.shape[-2]:
            return masked_rows
        other = "top-left" if lower_right else "bottom-right"
        error = _distance(out, m.exact, True, a, other == "bottom-right")
        if error is None or error > budget:
            return None
        return (f"the output matches a {other} causal mask (max abs {error:.3g} within the budget {budget:.3g}): if "
                f"that is the target's alignment, declare it at registration (causal=\"{other}\")")

    def target_variants(self, target: Target, device: str) -> list[Variant]:
        return self.variants(device) if reaches_sdpa(target, device) else [NO_VARIANT]

    def default_targets(self) -> list[Target]:
        """SDPA, and the project's Triton flash attention where it can run (kernels/builtin.py)."""
        from pytest_precision.kernels.builtin import builtin_targets

        return [Target("torch.sdpa", sdpa, "attention", origin="built-in")] + builtin_targets((self.name,))

    def variants(self, device: str) -> list[Variant]:
        """The SDPA backends of ``device``."""
        names = ["math", "flash"] if device == "cpu" else list(_BACKENDS)
        return [SdpaBackend(n) for n in names]

    def floating_inputs(self, a: AttentionInputs) -> dict[str, torch.Tensor]:
        return {"q": a.q, "k": a.k, "v": a.v}

    def invoke(self, fn, values, a: AttentionInputs, device):
        kwargs = {"causal": a.causal}
        if a.key_padding_mask is not None:
            kwargs["key_padding_mask"] = a.key_padding_mask.to(device)
        if getattr(fn, "__self__", None) is self:  # the oracle and the peer, in the target's conventions
            kwargs["lower_right"] = a.causal_alignment == "bottom-right"
            kwargs["fully_masked"] = a.fully_masked
        return fn(values["q"], values["k"], values["v"], **kwargs)

    def expected_shape(self, values, a: AttentionInputs):
        return tuple(a.q.shape)

    def batch_size(self, case, a: AttentionInputs, values):
        return a.q.shape[0]  # each batch element attends on its own

    def rows_of(self, case, a: AttentionInputs, values, rows):
        mask = None if a.key_padding_mask is None else a.key_padding_mask[rows]
        sub = dataclasses.replace(a, q=a.q[rows], k=a.k[rows], v=a.v[rows], key_padding_mask=mask)
        return sub, {n: v[rows.to(v.device)] for n, v in values.items()}

    def reference(self, q, k, v, causal=False, key_padding_mask=None, lower_right=False, fully_masked="zero"):
        return reference_attention(q, k, v, causal, key_padding_mask, lower_right, fully_masked)

    def peer(self, q, k, v, causal=False, key_padding_mask=None, lower_right=False, fully_masked="zero"):
        return reference_attention(q, k, v, causal, key_padding_mask, lower_right, fully_masked)

    def rule_facts(self, ctx) -> tuple[float, CancelledTerms]:
        """The largest finite score's magnitude (exp's conditioning) and the size of the terms that
        cancel in dq and dk (``attention_floors``), from the float64 inputs."""
        exact, a = ctx.exact, ctx.inputs
        lower_right = a.causal_alignment == "bottom-right"
        with torch.no_grad():
            scores = attention_scores(exact["q"], exact["k"], a.causal, a.key_padding_mask, lower_right)
        logit_top = float(scores[torch.isfinite(scores)].abs().max())
        upstream = ctx.upstream(exact["q"].shape)
        return logit_top, cancelled_terms(scores, exact["q"], exact["k"], exact["v"], upstream, a.fully_masked)

    def output_rule(self, ctx, name, out, peer, ref) -> OutputRule:
        rule = super().output_rule(ctx, name, out, peer, ref)
        logit_top, cancelled = ctx.facts
        finite = ref[torch.isfinite(ref)]
        top = float(finite.abs().max()) if finite.numel() else 0.0
        rule.underflow_floor = top * format_of(rule.dtype).eps  # zeros below this are cancellation
        rule.peer_factor = PEER_FACTOR if name == "out" else GRAD_PEER_FACTOR
        # the same floor under the regression budget: the interpreted Triton kernel in fp32 at q scale
        # 40 is 1.6e-6 or 4.9e-6 off depending on OpenBLAS's kernel (its tl.dot), and 1.5 x one of them
        # is below the other
        rule.abs_floor = error_floor(top, rule.dtype, logit_top) + cancelled.max_floor(name)
        rms = float(finite.pow(2).mean().sqrt()) if finite.numel() else 0.0
        # exp's conditioning at the RMS magnitude, and the cancelled terms' RMS size
        rule.rms_floor = ULP_FLOOR * rms * max(1.0, logit_top) * 2.0 ** -24 + cancelled.rms_floor(name)
        rule.peer_rms_floor = rule.rms_floor  # the RMS error limited too: PEER_RMS_FACTOR x the peer's plus this
        rule.peer_rms_factor = PEER_RMS_FACTOR if name == "out" else GRAD_PEER_RMS_FACTOR
        return rule


ATTENTION = AttentionKind()
