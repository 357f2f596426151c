"""Flash attention forward and backward in Triton, in the attention kind's contract.

``flash_attention(q, k, v, causal=False, key_padding_mask=None)``: q (B, H, S_q, D), k and v
(B, H_kv, S_k, D) with H_kv dividing H (grouped-query heads), scores scaled by 1/sqrt(D), causal
top-left (key j masked for query i when j > i), ``key_padding_mask`` (B, S_k) bool, True where a
key is padding. fp16, bf16 and fp32 inputs; any head dim (padded to a power of two >= 16 inside:
64 and 128 run unpadded). Under autocast the inputs are cast to the autocast dtype first, as
SDPA does.

Forward (FlashAttention-2's loop): one program per block of queries and head, keys and values in
blocks, the softmax online in fp32 (running max, running sum and output accumulator rescaled
when the max grows), p rounded to the inputs' dtype for the second dot, as every tensor-core
kernel does; it keeps the log-sum-exp of each query's scores (fp32) for the backward. A query
whose keys are all masked gets 0, as torch's SDPA returns there, and passes no gradient (its
log-sum-exp is -inf, so its p is 0 in the backward, and delta = rowsum(dO * 0) = 0).

Backward: delta = rowsum(dO * O) in torch, then one kernel for dK and dV (one program per key
block, looping over queries) and one for dQ (per query block, looping over keys), recomputing p
from the log-sum-exp; fp32 accumulators, p and ds rounded to the inputs' dtype before their dots.
Grouped-query heads: dK and dV are computed per query head and summed over each group.

fp32 inputs take IEEE fp32 dots unless torch allows TF32 matmuls (``tf32`` config on CUDA).
Under the interpreter the dots take fp32 operands (bf16 dot trap, runtime.py), and p and ds are
rounded to bf16 on the bits when the inputs are bf16.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pytest_precision.kernels.accurate import _exp, accurate_math, exp  # noqa: F401 (_exp: called in kernels)
from pytest_precision.kernels.runtime import LazyKernel, boundary_dtype, interpreting, upcast_dot
from pytest_precision.platform.triton import needs_triton
from pytest_precision.numerics.configs import tf32_matmul_allowed

__all__ = ["flash_attention", "flash_attention_with_lse"]

SUPPORTED = (torch.float16, torch.bfloat16, torch.float32)


def _operand(x, DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr):
    """fp32 ``x`` rounded to the inputs' dtype for a dot: a cast, or under the interpreter with
    bf16 inputs, round to nearest even on the bits, the value kept in fp32 (runtime.py)."""
    if ROUND_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = bits.to(tl.float32, bitcast=True)
    else:
        y = x.to(DTYPE)
    return y


def _dot(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """a @ b with an fp32 accumulator; fp32 operands first under the interpreter (runtime.py)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


def _block_and_head(n_blocks):
    """(block index along the sequence, batch x head index) of this program. The grid is one
    dimension, blocks of one head consecutive (they share its keys and values in L2): a grid's
    y and z dimensions stop at 65535, fewer than batch x heads of a large run."""
    pid = tl.program_id(0)
    return pid % n_blocks, pid // n_blocks


def _attention_forward_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, pad_ptr,
        sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, so_m,
        H, GROUP, S_Q, S_K, D, scale,
        CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, ROUND_BF16: tl.constexpr,
        ACCURATE: tl.constexpr):
    pid_m, bh = _block_and_head(tl.cdiv(S_Q, BLOCK_M))
    b = bh // H
    h = bh % H
    kvh = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    in_d = offs_d < D
    q_base = q_ptr + b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h
    k_base = k_ptr + b.to(tl.int64) * sk_b + kvh.to(tl.int64) * sk_h
    v_base = v_ptr + b.to(tl.int64) * sv_b + kvh.to(tl.int64) * sv_h
    q = tl.load(q_base + offs_m[:, None] * sq_m + offs_d[None, :],
                mask=(offs_m[:, None] < S_Q) & in_d[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = S_K
    if CAUSAL:  # blocks wholly right of the diagonal contribute nothing
        hi = tl.minimum(S_K, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        n = start_n + offs_n
        in_n = n < S_K
        kt = tl.load(k_base + n[None, :] * sk_n + offs_d[:, None], mask=in_n[None, :] & in_d[:, None], other=0.0)
        s = _dot(q, kt, UPCAST, IEEE) * scale
        valid = in_n[None, :] & (offs_m[:, None] >= 0)
        if CAUSAL:
            valid = valid & (n[None, :] <= offs_m[:, None])
        if HAS_PAD:
            pad = tl.load(pad_ptr + b.to(tl.int64) * S_K + n, mask=in_n, other=1)
            valid = valid & (pad == 0)[None, :]
        s = tl.where(valid, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # no key yet: keep sums 0, not NaN
        alpha = _exp(m_i - m_safe, ACCURATE)
        p = _exp(s - m_safe[:, None], ACCURATE)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + n[:, None] * sv_n + offs_d[None, :], mask=in_n[:, None] & in_d[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(_operand(p, v.dtype, ROUND_BF16), v, UPCAST, IEEE)
        m_i = m_new
    # a query whose keys are all masked has l_i = 0 and acc = 0: its output is 0 (torch's SDPA convention)
    out = tl.div_rn(acc, tl.where(l_i == 0.0, 1.0, l_i)[:, None])
    o_base = o_ptr + b.to(tl.int64) * so_b + h.to(tl.int64) * so_h
    tl.store(o_base + offs_m[:, None] * so_m + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < S_Q) & in_d[None, :])
    tl.store(lse_ptr + bh.to(tl.int64) * S_Q + offs_m, m_i + tl.log(l_i), mask=offs_m < S_Q)


def _probabilities(q, kt, lse, offs_m, n, in_n, b, pad_ptr, S_Q, S_K, scale,
                   CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                   ACCURATE: tl.constexpr):
    """The softmax block p of queries offs_m and keys n, recomputed from the log-sum-exp."""
    s = _dot(q, kt, UPCAST, IEEE) * scale
    valid = in_n[None, :] & (offs_m[:, None] < S_Q)
    if CAUSAL:
        valid = valid & (n[None, :] <= offs_m[:, None])
    if HAS_PAD:
        pad = tl.load(pad_ptr + b.to(tl.int64) * S_K + n, mask=in_n, other=1)
        valid = valid & (pad == 0)[None, :]
    return tl.where(valid, _exp(s - lse[:, None], ACCURATE), 0.0)


def _attention_backward_dkdv_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, pad_ptr,
        sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sdo_b, sdo_h, sdo_m,
        H, GROUP, S_Q, S_K, D, scale,
        CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, ROUND_BF16: tl.constexpr,
        ACCURATE: tl.constexpr):
    pid_n, bh = _block_and_head(tl.cdiv(S_K, BLOCK_N))
    b = bh // H
    h = bh % H
    kvh = h // GROUP
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = n < S_K
    offs_d = tl.arange(0, BLOCK_D)
    in_d = offs_d < D
    k_base = k_ptr + b.to(tl.int64) * sk_b + kvh.to(tl.int64) * sk_h
    v_base = v_ptr + b.to(tl.int64) * sv_b + kvh.to(tl.int64) * sv_h
    kt = tl.load(k_base + n[None, :] * sk_n + offs_d[:, None], mask=in_n[None, :] & in_d[:, None], other=0.0)
    vt = tl.load(v_base + n[None, :] * sv_n + offs_d[:, None], mask=in_n[None, :] & in_d[:, None], other=0.0)
    q_base = q_ptr + b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h
    do_base = do_ptr + b.to(tl.int64) * sdo_b + h.to(tl.int64) * sdo_h
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = 0
    if CAUSAL:  # queries above the block's first key see none of it
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for start_m in range(lo, S_Q, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        in_m = offs_m < S_Q
        q = tl.load(q_base + offs_m[:, None] * sq_m + offs_d[None, :], mask=in_m[:, None] & in_d[None, :], other=0.0)
        do = tl.load(do_base + offs_m[:, None] * sdo_m + offs_d[None, :], mask=in_m[:, None] & in_d[None, :], other=0.0)
        lse = tl.load(lse_ptr + bh.to(tl.int64) * S_Q + offs_m, mask=in_m, other=0.0)
        delta = tl.load(delta_ptr + bh.to(tl.int64) * S_Q + offs_m, mask=in_m, other=0.0)
        p = _probabilities(q, kt, lse, offs_m, n, in_n, b, pad_ptr, S_Q, S_K, scale, CAUSAL, HAS_PAD, UPCAST, IEEE,
                           ACCURATE)
        dv += _dot(tl.trans(_operand(p, do.dtype, ROUND_BF16)), do, UPCAST, IEEE)
        dp = _dot(do, vt, UPCAST, IEEE)
        ds = p * (dp - delta[:, None])
        dk += _dot(tl.trans(_operand(ds, q.dtype, ROUND_BF16)), q, UPCAST, IEEE)
    dk = dk * scale
    out = bh.to(tl.int64) * S_K * BLOCK_D + n[:, None] * BLOCK_D + offs_d[None, :]  # fp32 (B, H, S_k, BLOCK_D)
    tl.store(dk_ptr + out, dk, mask=in_n[:, None])
    tl.store(dv_ptr + out, dv, mask=in_n[:, None])


def _attention_backward_dq_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, pad_ptr,
        sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sdo_b, sdo_h, sdo_m,
        H, GROUP, S_Q, S_K, D, scale,
        CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, ROUND_BF16: tl.constexpr,
        ACCURATE: tl.constexpr):
    pid_m, bh = _block_and_head(tl.cdiv(S_Q, BLOCK_M))
    b = bh // H
    h = bh % H
    kvh = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    in_m = offs_m < S_Q
    offs_d = tl.arange(0, BLOCK_D)
    in_d = offs_d < D
    q_base = q_ptr + b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h
    do_base = do_ptr + b.to(tl.int64) * sdo_b + h.to(tl.int64) * sdo_h
    k_base = k_ptr + b.to(tl.int64) * sk_b + kvh.to(tl.int64) * sk_h
    v_base = v_ptr + b.to(tl.int64) * sv_b + kvh.to(tl.int64) * sv_h
    q = tl.load(q_base + offs_m[:, None] * sq_m + offs_d[None, :], mask=in_m[:, None] & in_d[None, :], other=0.0)
    do = tl.load(do_base + offs_m[:, None] * sdo_m + offs_d[None, :], mask=in_m[:, None] & in_d[None, :], other=0.0)
    lse = tl.load(lse_ptr + bh.to(tl.int64) * S_Q + offs_m, mask=in_m, other=0.0)
    delta = tl.load(delta_ptr + bh.to(tl.int64) * S_Q + offs_m, mask=in_m, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = S_K
    if CAUSAL:
        hi = tl.minimum(S_K, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        n = start_n + tl.arange(0, BLOCK_N)
        in_n = n < S_K
        kt = tl.load(k_base + n[None, :] * sk_n + offs_d[:, None], mask=in_n[None, :] & in_d[:, None], other=0.0)
        vt = tl.load(v_base + n[None, :] * sv_n + offs_d[:, None], mask=in_n[None, :] & in_d[:, None], other=0.0)
        p = _probabilities(q, kt, lse, offs_m, n, in_n, b, pad_ptr, S_Q, S_K, scale, CAUSAL, HAS_PAD, UPCAST, IEEE,
                           ACCURATE)
        dp = _dot(do, vt, UPCAST, IEEE)
        ds = p * (dp - delta[:, None])
        dq += _dot(_operand(ds, q.dtype, ROUND_BF16), tl.trans(kt), UPCAST, IEEE)
    dq = dq * scale
    tl.store(dq_ptr + bh.to(tl.int64) * S_Q * BLOCK_D + offs_m[:, None] * BLOCK_D + offs_d[None, :], dq,
             mask=in_m[:, None])


operand = LazyKernel(_operand)
dot = LazyKernel(_dot)
block_and_head = LazyKernel(_block_and_head)
probabilities = LazyKernel(_probabilities, helpers=[dot, exp])
attention_forward_kernel = LazyKernel(_attention_forward_kernel, helpers=[operand, dot, block_and_head, exp])
attention_backward_dkdv_kernel = LazyKernel(_attention_backward_dkdv_kernel,
                                            helpers=[operand, dot, block_and_head, probabilities])
attention_backward_dq_kernel = LazyKernel(_attention_backward_dq_kernel,
                                          helpers=[operand, dot, block_and_head, probabilities])


@dataclass(frozen=True)
class Tiles:
    """One kernel's launch shape: BLOCK_M queries by BLOCK_N keys per step, warps, pipeline stages."""

    block_m: int
    block_n: int
    warps: int
    stages: int


# (kernel, dot operands, BLOCK_D) -> Tiles on a GPU. Operands: "16-bit" (fp16, bf16: tensor cores),
# "tf32", "fp32" (IEEE fp32 dots: no tensor cores, every product on the FMA units). Each one compiles
# for sm_80 and sm_90 within the card's per-block shared memory and without spilling registers
# (python -m pytest_precision.kernels.compile_check prints the figures; it was chosen there among
# candidates, the largest tile that does, preferring ones ptxas fits in fewer than 255 registers).
# "forward": BLOCK_M queries per program over keys in steps of BLOCK_N; "dkdv": BLOCK_N keys per
# program over queries in steps of BLOCK_M; "dq": BLOCK_M queries per program over keys.
TILES: dict[tuple[str, str, int], Tiles] = {
    (kernel, operands, d): Tiles(*t) for (kernel, operands), by_dim in {
        ("forward", "16-bit"): {16: (128, 64, 4, 2), 32: (128, 64, 4, 3), 64: (64, 64, 4, 3), 128: (128, 32, 8, 2),
                                256: (64, 64, 8, 2)},
        ("dkdv", "16-bit"): {16: (64, 64, 4, 2), 32: (64, 64, 4, 2), 64: (16, 64, 4, 1), 128: (16, 64, 4, 1),
                             256: (32, 64, 8, 1)},
        ("dq", "16-bit"): {16: (128, 32, 4, 3), 32: (128, 32, 4, 3), 64: (64, 32, 4, 2), 128: (64, 32, 4, 2),
                           256: (16, 32, 8, 1)},
        ("forward", "tf32"): {16: (128, 64, 4, 3), 32: (64, 64, 4, 3), 64: (64, 64, 4, 3), 128: (128, 32, 8, 2),
                              256: (32, 32, 4, 1)},
        ("dkdv", "tf32"): {16: (64, 64, 4, 2), 32: (64, 64, 4, 2), 64: (64, 64, 4, 2), 128: (16, 64, 4, 1),
                           256: (16, 32, 8, 1)},
        ("dq", "tf32"): {16: (128, 32, 4, 3), 32: (64, 64, 4, 2), 64: (32, 32, 4, 2), 128: (32, 32, 4, 2),
                         256: (16, 32, 8, 1)},
        ("forward", "fp32"): {16: (64, 32, 8, 2), 32: (64, 32, 4, 2), 64: (32, 32, 8, 2), 128: (16, 32, 4, 1),
                              256: (16, 16, 4, 1)},
        ("dkdv", "fp32"): {16: (64, 32, 4, 2), 32: (32, 32, 4, 1), 64: (16, 32, 4, 1), 128: (16, 16, 8, 1),
                           256: (16, 16, 8, 1)},
        ("dq", "fp32"): {16: (64, 32, 4, 2), 32: (64, 32, 4, 2), 64: (32, 32, 4, 2), 128: (32, 32, 8, 2),
                         256: (16, 16, 8, 1)},
    }.items() for d, t in by_dim.items()
}
MAX_HEAD_DIM = 256
# the interpreter runs every program in Python: small blocks for small shapes
INTERPRETED = Tiles(16, 16, 4, 1)


def _operands(dtype, ieee: bool) -> str:
    return "fp32" if ieee else ("tf32" if dtype == torch.float32 else "16-bit")


def tiles(kernel: str, dtype, ieee: bool, block_d: int) -> Tiles:
    """The launch shape of ``kernel`` ("forward", "dkdv", "dq") here."""
    if interpreting():
        return INTERPRETED
    return TILES[(kernel, _operands(dtype, ieee), block_d)]


def _check(q, k, v, key_padding_mask):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"flash_attention: q, k, v must be (B, H, S, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED:
        raise TypeError(f"flash_attention: q, k, v must share one of fp16, bf16, fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    B, H, _, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or H % k.shape[1]:
        raise ValueError(f"flash_attention: k, v must be (B, H_kv, S_k, D) with H_kv dividing H; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (B, k.shape[2]):
        raise ValueError(f"flash_attention: key_padding_mask must be (B, S_k) = {(B, k.shape[2])}, "
                         f"got {tuple(key_padding_mask.shape)}")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"flash_attention: head dim {D} over the largest this kernel has tiles for, {MAX_HEAD_DIM}")
    if q.device.type == "cpu" and not interpreting():
        raise RuntimeError("flash_attention: CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)")


def _launch_args(q, k, v, causal, pad):
    """(constexprs every kernel takes, the tiles of each kernel, the shape arguments)."""
    B, H, S_Q, D = q.shape
    block_d = max(16, triton.next_power_of_2(D))
    ieee = q.dtype == torch.float32 and not tf32_matmul_allowed()
    round_bf16 = interpreting() and q.dtype == torch.bfloat16
    # fp32 keeps the probabilities in fp32, so exp's error shows; fp16 and bf16 round them to 11 or 8 bits
    accurate = ieee and accurate_math()
    consts = dict(CAUSAL=bool(causal), HAS_PAD=pad is not None, BLOCK_D=block_d, UPCAST=upcast_dot(), IEEE=ieee,
                  ROUND_BF16=round_bf16, ACCURATE=accurate)
    per_kernel = {}
    for kernel in ("forward", "dkdv", "dq"):
        t = tiles(kernel, q.dtype, ieee, block_d)
        per_kernel[kernel] = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.warps, num_stages=t.stages)
    shape = (H, H // k.shape[1], S_Q, k.shape[2], D, 1.0 / math.sqrt(D))
    return consts, per_kernel, shape


def _forward(q, k, v, causal, pad):
    B, H, S_Q, D = q.shape
    consts, per_kernel, shape = _launch_args(q, k, v, causal, pad)
    qb, kb, vb = (t.to(boundary_dtype(t.dtype)).contiguous() for t in (q, k, v))
    o = torch.empty_like(qb)
    lse = torch.empty(B, H, S_Q, dtype=torch.float32, device=q.device)
    pad_arg = pad if pad is not None else lse  # unused when HAS_PAD is off
    fwd = per_kernel["forward"]
    grid = (triton.cdiv(S_Q, fwd["BLOCK_M"]) * B * H,)  # one dimension: _block_and_head
    attention_forward_kernel[grid](qb, kb, vb, o, lse, pad_arg, *qb.stride()[:3], *kb.stride()[:3], *vb.stride()[:3],
                                   *o.stride()[:3], *shape, **consts, **fwd)
    return o.to(q.dtype), lse


def _backward(q, k, v, o, lse, do, causal, pad):
    B, H, S_Q, D = q.shape
    H_kv, S_K = k.shape[1], k.shape[2]
    consts, per_kernel, shape = _launch_args(q, k, v, causal, pad)
    qb, kb, vb, dob = (t.to(boundary_dtype(q.dtype)).contiguous() for t in (q, k, v, do.to(q.dtype)))
    delta = (do.float() * o.float()).sum(-1).contiguous()  # rowsum(dO * O), fp32
    block_d = consts["BLOCK_D"]
    dk = torch.empty(B, H, S_K, block_d, dtype=torch.float32, device=q.device)
    dv = torch.empty_like(dk)
    dq = torch.empty(B, H, S_Q, block_d, dtype=torch.float32, device=q.device)
    pad_arg = pad if pad is not None else lse
    strides = (*qb.stride()[:3], *kb.stride()[:3], *vb.stride()[:3], *dob.stride()[:3])
    dkdv, dq_tiles = per_kernel["dkdv"], per_kernel["dq"]
    attention_backward_dkdv_kernel[(triton.cdiv(S_K, dkdv["BLOCK_N"]) * B * H,)](
        qb, kb, vb, dob, lse, delta, dk, dv, pad_arg, *strides, *shape, **consts, **dkdv)
    attention_backward_dq_kernel[(triton.cdiv(S_Q, dq_tiles["BLOCK_M"]) * B * H,)](
        qb, kb, vb, dob, lse, delta, dq, pad_arg, *strides, *shape, **consts, **dq_tiles)
    group = H // H_kv
    dk = dk[..., :D].reshape(B, H_kv, group, S_K, D).sum(2)  # grouped heads: sum over each group
    dv = dv[..., :D].reshape(B, H_kv, group, S_K, D).sum(2)
    return dq[..., :D].to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, pad):
        o, lse = _forward(q, k, v, causal, pad)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.pad = causal, pad
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, o, lse, do, ctx.causal, ctx.pad)
        return dq, dk, dv, None, None


def flash_attention_with_lse(q, k, v, causal: bool = False, key_padding_mask=None):
    """(attention output in q's dtype, fp32 log-sum-exp of each query's scores (B, H, S_q)),
    differentiable in q, k and v."""
    device_type = q.device.type
    # autocast knows real devices only; "meta" tensors (compile_check) have none to consult
    autocast = device_type != "meta" and torch.is_autocast_enabled(device_type)
    if autocast:  # as SDPA: the autocast dtype for all three
        dtype = torch.get_autocast_dtype(device_type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    _check(q, k, v, key_padding_mask)
    pad = None if key_padding_mask is None else key_padding_mask.to(device=q.device, dtype=torch.int8).contiguous()
    with torch.autocast(device_type, enabled=False) if autocast else contextlib.nullcontext():
        return _FlashAttention.apply(q, k, v, bool(causal), pad)


@needs_triton
def flash_attention(q, k, v, causal: bool = False, key_padding_mask=None):
    """Attention of the suite's contract (the ``triton.flash_attention`` built-in target)."""
    return flash_attention_with_lse(q, k, v, causal, key_padding_mask)[0]
