"""The attention suite: attention targets x configs x SDPA backends x input regimes.

Target contract (kind ``attention``)::

    fn(q, k, v, causal: bool) -> out
    fn(q, k, v, causal: bool, key_padding_mask=mask) -> out     # for the padded regime

``q`` is (B, H, S_q, D); ``k`` and ``v`` are (B, H_kv, S_k, D) with H_kv dividing H (grouped-query
attention: query head h uses key/value head h // (H / H_kv)); ``out`` is (B, H, S_q, D) in q's
dtype. ``causal`` masks key j for query i when j > i (top-left aligned, as torch's ``is_causal``).
``key_padding_mask`` is (B, S_k) bool, True where a key is padding; a target whose signature has
no ``key_padding_mask`` is skipped on the padded regime with that reason. Scores are scaled by
1/sqrt(D).

Each case has three outputs, as FlashAttention's tests: the target, the float64 oracle on the
rounded inputs, and a peer (eager math attention in the same config). The forward error must be
at most 2 x the peer's plus a floor, the gradients of q, k and v (autograd with a fixed random
grad_out) at most 3 x the peer's plus a floor (``error_floor``), all as max abs error; overflow, underflow and NaN
are counted on the output and every gradient. The SDPA backend (``+math``, ``+flash`` and, on
CUDA, ``+efficient``, ``+cudnn``) is forced around the target's call.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pytest_precision.budgets import PEER_FACTOR, ULP_FLOOR, peer_budget
from pytest_precision.checking import CaseOutcome, judge
from pytest_precision.configs import CONFIGS, Config, fp8_roundtrip
from pytest_precision.faults import first_fault
from pytest_precision.formats import format_of
from pytest_precision.golden import Golden, Output
from pytest_precision.metrics import compare
from pytest_precision.strategies import AttentionInputs, build_attention_inputs
from pytest_precision.targets import Target, TargetError
from pytest_precision.timing import Bench

NAME = "attention"
KINDS = ("attention",)
BASE_SEED = 20261123
GRAD_PEER_FACTOR = 3.0  # FlashAttention's rule for gradients

_BACKENDS = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


def variants(device: str) -> list[str]:
    """The SDPA backends of ``device``, as config-id suffixes."""
    names = ["math", "flash"] if device == "cpu" else list(_BACKENDS)
    return [f"+{n}" for n in names]


@dataclass(frozen=True)
class Regime:
    name: str
    description: str
    shape: dict  # build_attention_inputs keyword arguments besides the seed

    @property
    def seed(self) -> int:
        return BASE_SEED + zlib.crc32(self.name.encode()) % 100_000

    def inputs(self) -> AttentionInputs:
        return build_attention_inputs(seed=self.seed, **self.shape)

    def spec(self) -> dict:
        return {"regime": self.name, "seed": self.seed, **self.shape}


# small: goldens (output and three gradients per case) are committed
_BASE = dict(batch=1, heads=2, kv_heads=2, q_len=16, k_len=16, head_dim=16)
REGIMES: dict[str, Regime] = {r.name: r for r in (
    Regime("unit", "N(0, 1) q, k, v", _BASE),
    Regime("sharp10", "q scaled by 10: sharp attention", {**_BASE, "q_scale": 10.0}),
    Regime("sharp40", "q scaled by 40: near one-hot attention, scores past fp16's exp range", {**_BASE, "q_scale": 40.0}),
    Regime("long", "8 queries over 512 keys", dict(batch=1, heads=1, kv_heads=1, q_len=8, k_len=512, head_dim=16)),
    Regime("causal", "causal mask", {**_BASE, "causal": True}),
    Regime("padded", "key padding, batch 2, grouped-query heads (4 q heads, 2 kv heads)",
           dict(batch=2, heads=4, kv_heads=2, q_len=8, k_len=24, head_dim=16, padding=True)),
    Regime("hd59", "head dim 59, irregular lengths 17 x 29", dict(batch=1, heads=1, kv_heads=1, q_len=17, k_len=29, head_dim=59)),
)}


def _expand_kv(q, t):
    """Grouped-query attention: repeat each key/value head for the query heads that share it."""
    return t if t.shape[1] == q.shape[1] else t.repeat_interleave(q.shape[1] // t.shape[1], dim=1)


def attention_scores(q, k, causal: bool = False, key_padding_mask=None):
    """q k^T / sqrt(D), -inf where a key is masked for a query."""
    s = (q @ _expand_kv(q, k).transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    sq, sk = s.shape[-2:]
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed.tril()
    allowed = allowed[None, None]
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :].to(q.device)
    return s.masked_fill(~allowed, float("-inf"))


def reference_attention(q, k, v, causal: bool = False, key_padding_mask=None):
    """Eager math attention: the oracle in float64, the peer in the config's dtype."""
    return torch.softmax(attention_scores(q, k, causal, key_padding_mask), dim=-1) @ _expand_kv(q, v)


def error_floor(top: float, dtype: torch.dtype, logit_top: float) -> float:
    """The max-abs error no implementation is held below: ULP_FLOOR ULPs of the dtype at the
    largest magnitude, plus the conditioning of exp. Every kernel holds scores in fp32 at best,
    so a score of magnitude |s| is off by up to |s| 2^-24 and exp(s) by that much relative;
    softmax, output and gradients inherit it. Measured on CPU with torch 2.13: SDPA's flash
    backend in fp32 at q scale 40 (|s| up to about 120) has dv 9e-6 off at magnitude 4, ten times
    eager math's error yet within this term; in 16-bit dtypes the first term dominates."""
    return ULP_FLOOR * top * (2.0 ** -format_of(dtype).mantissa_bits + max(1.0, logit_top) * 2.0 ** -24)


def sdpa(q, k, v, causal: bool = False, key_padding_mask=None):
    """torch's scaled_dot_product_attention in this suite's contract (the built-in target)."""
    mask = None if key_padding_mask is None else ~key_padding_mask[:, None, None, :].to(q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          enable_gqa=k.shape[1] != q.shape[1])


def default_targets() -> list[Target]:
    """SDPA, and the project's Triton flash attention where it can run (kernels/targets.py)."""
    from pytest_precision.kernels.targets import builtin_targets

    return [Target("torch.sdpa", sdpa, "attention", origin="built-in")] + builtin_targets(KINDS)


def _accepts_padding(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return "key_padding_mask" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


@dataclass
class _Run:
    out: torch.Tensor
    grads: dict[str, torch.Tensor]


def _run(fn, config: Config, device: str, a: AttentionInputs, values: tuple, grad_seed: int,
         backend: str | None, where: str) -> _Run:
    leaves = [t.detach().clone().requires_grad_(True) for t in values]
    kwargs = {"causal": a.causal}
    if a.key_padding_mask is not None:
        kwargs["key_padding_mask"] = a.key_padding_mask.to(device)
    try:
        with config.active(device):
            if backend is not None:
                with sdpa_kernel(_BACKENDS[backend]):
                    out = fn(*leaves, **kwargs)
            else:
                out = fn(*leaves, **kwargs)
            if not isinstance(out, torch.Tensor):
                raise TargetError(f"{where} returned {type(out).__name__}, expected a tensor")
            expect = tuple(a.q.shape)
            if tuple(out.shape) != expect:
                raise TargetError(f"{where}: shape mismatch, output {tuple(out.shape)}, expected {expect}")
            g = torch.Generator().manual_seed(grad_seed)
            # copied into place rather than cast with .to(): the audit flags Python-level 16-bit casts
            # as the user's, and this one is the harness's
            grad_out = torch.empty_like(out).copy_(torch.randn(out.shape, generator=g, dtype=torch.float64))
            out.backward(grad_out)
    except TargetError:
        raise
    except torch.OutOfMemoryError as e:
        raise TargetError(f"{where}: out of memory ({e}); q {tuple(a.q.shape)}, k {tuple(a.k.shape)}") from e
    except Exception as e:
        raise TargetError(f"{where} raised {type(e).__name__}: {e}") from e
    grads = {}
    for name, leaf in zip(("dq", "dk", "dv"), leaves):
        if leaf.grad is None:
            raise TargetError(f"{where}: no gradient reached {name[1:]} (is the output detached?)")
        grads[name] = leaf.grad.detach()
    return _Run(out.detach(), grads)


def bench_call(target: Target, config: Config, regime_name: str, device: str, variant: str = ""):
    """The timed call of a case: the target's forward on the regime's inputs under the config and
    backend (no autograd), or None where the case has nothing to time."""
    from pytest_precision.kernels.targets import interpreted

    if regime_name not in REGIMES or (regime_name == "padded" and not _accepts_padding(target.fn)) \
            or interpreted(target.fn, device):
        return None
    a = REGIMES[regime_name].inputs()
    q, k, v = (config.prepare(t, device).value for t in (a.q, a.k, a.v))
    kwargs = {"causal": a.causal}
    if a.key_padding_mask is not None:
        kwargs["key_padding_mask"] = a.key_padding_mask.to(device)
    backend = variant.lstrip("+") or None

    @contextlib.contextmanager
    def context():
        with torch.no_grad(), config.active(device):
            if backend is None:
                yield
            else:
                with sdpa_kernel(_BACKENDS[backend]):
                    yield
    return Bench(lambda: target.fn(q, k, v, **kwargs), context=context)


AUDIT_REGIME = "unit"  # --precision-audit looks at one regime per target and config


def trace_call(target: Target, config: Config, regime_name: str, device: str, variant: str = ""):
    """The call --precision-trace and --precision-audit run traced: forward and backward, in the
    config and backend, as the case runs them."""
    if regime_name not in REGIMES or (regime_name == "padded" and not _accepts_padding(target.fn)):
        return None
    regime = REGIMES[regime_name]
    a = regime.inputs()
    values = tuple(config.prepare(t, device).value for t in (a.q, a.k, a.v))
    where = f"target {target.name!r} (attention) under config {config.id}{variant} on regime {regime_name}"
    return lambda: _run(target.fn, config, device, a, values, regime.seed + 1, variant.lstrip("+") or None, where)


def _grad_dtype(config: Config, grad: torch.Tensor) -> torch.dtype:
    """Gradients of fp32 leaves under autocast are computed in the autocast dtype: count their
    ULPs and range there (a 1e-8 gradient is below fp16's normal range, not an fp32 underflow)."""
    if config.autocast_dtype is not None:
        return config.autocast_dtype
    return grad.dtype if grad.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) else torch.float32


def run_case(target: Target, config: Config, regime_name: str, device: str, golden: Golden,
             variant: str = "") -> CaseOutcome:
    import pytest

    from pytest_precision.kernels.targets import skip_reason

    reason = skip_reason(target.fn, device)
    if reason:
        pytest.skip(f"{target.name}: {reason}")
    regime = REGIMES[regime_name]
    backend = variant.lstrip("+") or None
    where = f"target {target.name!r} (attention) under config {config.id}{variant} on regime {regime_name}"
    if regime_name == "padded" and not _accepts_padding(target.fn):
        pytest.skip(f"{target.name}: the padded regime needs a key_padding_mask keyword (see the attention contract)")
    if variant not in ("", "+math") and getattr(target.fn, "needs_triton", False):
        pytest.skip(f"{target.name}: SDPA backends do not apply to a Triton kernel; its cases run once, under +math")
    a = regime.inputs()
    preps = [config.prepare(t, device) for t in (a.q, a.k, a.v)]
    values = tuple(p.value for p in preps)
    exact = tuple(p.exact.detach().clone().requires_grad_(True) for p in preps)
    grad_seed = regime.seed + 1

    # oracle: float64 on the rounded inputs, with the same grad_out
    ref_out = reference_attention(*exact, causal=a.causal, key_padding_mask=a.key_padding_mask)
    g = torch.Generator().manual_seed(grad_seed)
    ref_out.backward(torch.randn(ref_out.shape, generator=g, dtype=torch.float64))
    refs = {"out": ref_out.detach(), "dq": exact[0].grad, "dk": exact[1].grad, "dv": exact[2].grad}
    with torch.no_grad():
        scores = attention_scores(exact[0], exact[1], a.causal, a.key_padding_mask)
        logit_top = float(scores[torch.isfinite(scores)].abs().max())

    try:
        mine = _run(target.fn, config, device, a, values, grad_seed, backend, where)
    except TargetError as e:
        if backend is not None and "No available kernel" in str(e) or "No viable backend" in str(e):
            pytest.skip(f"{config.id}{variant}: SDPA backend {backend} cannot run this case on {device}")
        raise
    peer = _run(reference_attention, config, device, a, values, grad_seed, None,
                f"peer (eager math attention) under config {config.id} on regime {regime_name}")

    outputs_mine = {"out": mine.out, **mine.grads}
    outputs_peer = {"out": peer.out, **peer.grads}
    oracle, peers, budgets, golden_outputs = {}, {}, {}, {}
    for name, ref in refs.items():
        o, p = outputs_mine[name], outputs_peer[name]
        scale = peer_scale = 1.0
        if name == "out":
            dtype = config.ulp_dtype(o)
            o, scale = config.finish(o)
            p, peer_scale = config.finish(p)
        elif config.fp8 is not None:  # fp8 recipes carry gradients in e5m2
            dtype = torch.float8_e5m2
            o, scale = fp8_roundtrip(o, dtype)
            p, peer_scale = fp8_roundtrip(p, dtype)
        else:
            dtype = _grad_dtype(config, o)
        finite = ref[torch.isfinite(ref)]
        top = float(finite.abs().max()) if finite.numel() else 0.0
        noise = top * 2.0 ** -format_of(dtype).mantissa_bits  # zeros below this are cancellation
        oracle[name] = compare(o, ref, dtype, scale=scale, underflow_floor=noise)
        peers[name] = compare(p, ref, dtype, scale=peer_scale, underflow_floor=noise)
        factor = PEER_FACTOR if name == "out" else GRAD_PEER_FACTOR
        floor = error_floor(top, dtype, logit_top)
        budgets[name] = peer_budget(peers[name], factor, abs_floor_value=floor)
        # the same floor under the regression budget: the interpreted Triton kernel in fp32 at q scale
        # 40 is 1.6e-6 or 4.9e-6 off depending on OpenBLAS's kernel (its tl.dot), and 1.5 x one of them
        # is below the other
        golden_outputs[name] = Output(o, ref, dtype, scale, abs_budget=True, underflow_floor=noise, error_floor=floor)
    gold = golden.check_outputs(golden_outputs, inputs=torch.cat([t.flatten() for t in (a.q, a.k, a.v)]),
                                seed=regime.seed, input_spec=regime.spec())
    outcome = judge(suite=NAME, target=target.name, config=config.id + variant, regime=regime_name,
                    oracle=oracle, peer=peers, peer_budget=budgets, golden=gold,
                    peer_name="eager math attention")
    lost = not all(bool(torch.isfinite(t).all()) for t in outputs_mine.values()) or "underflow" in outcome.categories
    if not outcome.passed and lost:
        # forward and backward re-run traced, beside the same on the float64 inputs without autocast
        exact_values = tuple(p.exact.to(device) for p in preps)
        outcome.fault = first_fault(
            lambda: _run(target.fn, config, device, a, values, grad_seed, backend, where),
            lambda: _run(target.fn, CONFIGS["fp32"], device, a, exact_values, grad_seed, None, where))
    return outcome
