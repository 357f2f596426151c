"""The attention kind's inputs: its seeded regimes (the same bits on every machine, small: their
goldens are committed) and its fresh regime, drawn anew every run within what a target declared."""
from __future__ import annotations

from pytest_precision.kinds import Plan, Regime, Target
from pytest_precision.strategies import build_attention_inputs

__all__ = ["BASE_SEED", "REGIMES", "fresh_attention_regime"]

BASE_SEED = 20261123


def _regime(name: str, description: str, shape: dict, irregular: bool = False) -> Regime:
    return Regime.from_generator(name, description, lambda g: build_attention_inputs(seed=g, **shape), BASE_SEED, shape,
                                 irregular)


# small: goldens (output and three gradients per case) are committed
_BASE = dict(batch=1, heads=2, kv_heads=2, q_len=16, k_len=16, head_dim=16)
_MHA = dict(batch=2, heads=2, kv_heads=2, q_len=16, k_len=16, head_dim=16)
_SQUARE = dict(batch=1, heads=1, kv_heads=1, head_dim=16)
REGIMES: dict[str, Regime] = {r.name: r for r in (
    _regime("unit", "N(0, 1) q, k, v", _BASE),
    _regime("sharp10", "q scaled by 10: sharp attention", {**_BASE, "q_scale": 10.0}),
    _regime("sharp40", "q scaled by 40: near one-hot attention, scores past fp16's exp range", {**_BASE, "q_scale": 40.0}),
    _regime("long", "8 queries over 512 keys", dict(batch=1, heads=1, kv_heads=1, q_len=8, k_len=512, head_dim=16)),
    _regime("causal", "causal mask", {**_BASE, "causal": True}),
    # S_q < S_k with a causal mask: where the alignment shows (top-left: query i sees keys up to i;
    # bottom-right, declared by decoding kernels: up to i + S_k - S_q)
    _regime("causal-cross", "causal, 8 queries over 24 keys", {**_BASE, "q_len": 8, "k_len": 24, "causal": True}),
    _regime("padded", "key padding, batch 2, grouped-query heads (4 q heads, 2 kv heads)",
            dict(batch=2, heads=4, kv_heads=2, q_len=8, k_len=24, head_dim=16, padding=True)),
    # padding without grouped-query heads and with S_q == S_k, so that targets declaring
    # grouped_query=False or cross_lengths=False (GPT-2, BERT) keep padding cases: key padding at
    # the end of each sequence (an encoder's batch), and causal with padding at the start (a
    # decoder-only model's padded batch), whose padded query positions have every key masked
    _regime("padded-mha", "key padding at the end, batch 2, 16 x 16, 2 heads", _MHA | dict(padding=True)),
    _regime("causal-leftpad", "causal, padding at the start (batch 3, 16 x 16, 2 heads): fully masked query rows",
            _MHA | dict(batch=3, causal=True, padding="left")),
    _regime("hd59", "head dim 59, irregular lengths 17 x 29", dict(batch=1, heads=1, kv_heads=1, q_len=17, k_len=29, head_dim=59),
            irregular=True),
    # each feature the fresh regime can draw, met on its own by a seeded regime first, so that a target
    # lacking it fails on its first run and every run, with the declaration that says so: grouped-query
    # heads, a head dim that is no power of two (hd59 has S_q != S_k too), more queries than keys, a batch
    _regime("gqa", "grouped-query heads: 4 query heads over 2 key/value heads, 16 x 16",
            {**_BASE, "heads": 4, "kv_heads": 2}),
    _regime("hd40", "head dim 40 (no power of two), 16 x 16", {**_BASE, "head_dim": 40}, irregular=True),
    _regime("short-keys", "24 queries over 8 keys", {**_BASE, "q_len": 24, "k_len": 8}),
    _regime("batch2", "batch 2, 16 x 16, 2 heads", _MHA),
    # lengths past the block sizes kernels use (16 to 128), so a blocked kernel runs its multi-block
    # path: the online softmax's rescale of earlier blocks, a partial last block (136 = 128 + 8), the
    # causal diagonal blocks
    _regime("square128", "128 queries over 128 keys", _SQUARE | dict(q_len=128, k_len=128)),
    _regime("square136", "136 x 136: a partial last block", _SQUARE | dict(q_len=136, k_len=136)),
    _regime("causal136", "136 x 136, causal", _SQUARE | dict(q_len=136, k_len=136, causal=True)),
)}


# The fresh regime (kinds.fresh): sizes drawn anew every run within what the target declared, small
# (the Triton kernel runs under the interpreter on a CPU: 4 batch and head pairs at most), lengths and
# head dims other than the fixed regimes' where the target allows them. Lengths from 9, q scale 1, and
# causal masks without key padding: beyond these, correct targets went past the budgets on random
# shapes (CPU, torch 2.13):
# 1 to 3 queries or q scale 40 under amp (the RMS limit, up to 3.9 x, 4 of 100 shapes), SDPA's flash
# backend in fp32 at q scale 10 (dv and dk max abs, up to 1.42 x, 5 of 300) and with causal masks
# over left-padded keys at q scale 1 (dk RMS, 1.8 x, 1 of 200); the fixed regimes hold those
_FIXED_LENGTHS = (8, 16, 17, 24, 29)
_FIXED_HEAD_DIMS = (16, 40, 59)
# from 24: no seeded regime has a head dim below 16 (a kernel whose tl.dot needs K >= 16 would fail at random)
_FRESH_HEAD_DIMS = (24, 32, 48, 64, 80, 96, 128, 256, 8)


def fresh_attention_regime(target: Target, seed: int) -> Regime | None:
    """The fresh regime of ``target`` drawn from ``seed`` within what it declared (the comment above),
    or None where no head dim it takes is left."""
    declared = target.declared
    allowed = declared.get("head_dims") or (lambda d: True)
    dims = [d for d in _FRESH_HEAD_DIMS[:5] if allowed(d)] or [d for d in (*_FIXED_HEAD_DIMS, *_FRESH_HEAD_DIMS) if
                                                                allowed(d)]
    if not dims:  # none of these head dims: no fresh case
        return None
    plan = Plan(seed)
    kv_heads = plan.integer(1, 2)
    group = plan.integer(1, 2) if declared.get("grouped_query", True) else 1
    q_len = plan.integer(9, 40, avoid=_FIXED_LENGTHS)
    k_len = plan.integer(9, 40, avoid=_FIXED_LENGTHS) if declared.get("cross_lengths", True) else q_len
    causal = declared.get("causal", "top-left") is not None and (plan.flag() or bool(declared.get("causal_only")))
    if causal:  # no query before every key (a bottom-right mask would leave it none)
        q_len, k_len = min(q_len, k_len), max(q_len, k_len)
    pads = not causal and declared.get("padding", target.accepts("key_padding_mask"))
    # at the start only for a target that meets causal-leftpad (padding at the start) first
    sides = (False, "right", "left") if declared.get("causal", "top-left") is not None else (False, "right")
    padding = plan.choice(sides) if pads else False
    batch = plan.integer(1, 2) if kv_heads * group < 4 else 1
    shape = dict(batch=batch, heads=kv_heads * group, kv_heads=kv_heads, q_len=q_len, k_len=k_len,
                 head_dim=plan.choice(dims), causal=causal, padding=padding)
    described = ", ".join(f"{k} {v}" for k, v in shape.items())
    # 4 keys kept at least: over one key dk is exactly 0, the difference of two equal sums, and SDPA's flash
    # backend in fp32 left 1.9 x its budget there (1 of 400 shapes)
    return plan.regime(described, lambda g: build_attention_inputs(seed=g, **shape, min_keys=4), **shape)
