"""The floors under the attention kind's budgets: what no implementation is held below, however
careful, because every kernel holds scores and their gradients in fp32 at best.

- ``error_floor``: ULP_FLOOR ULPs of the dtype at the output's largest magnitude, plus the
  conditioning of exp.
- ``cancelled_terms``: the gradients of q and k are sums of ``P_ij (dP_ij - D_i)`` (the softmax's
  backward), a difference of two dot products that cancel exactly where a query sees one key (row 0
  of a causal mask) and nearly where its attention is sharp. Each is rounded in fp32 at best, so dq
  and dk carry an error of the size of the terms that cancel, not of the result. Measured on CPU
  (torch 2.13, fp32, 2,000 fresh shapes): SDPA's flash backend computes ``D_i`` as ``dO_i . O_i``
  where the peer's autograd subtracts ``sum_j P_ij dP_ij``; its dq and dk were up to 1.12 x the
  terms' size x 2^-24 (query row 0 of a causal mask over one key, where the exact dq is 0), and past
  3 x the peer's error plus ``error_floor`` on 6 of 2,000 shapes (up to 1.62 x).
"""
from __future__ import annotations

import math

import torch

from pytest_precision.kinds import ULP_FLOOR, format_of

from .attention_masks import expand_kv

__all__ = ["error_floor", "cancelled_terms", "CancelledTerms"]

FP32_UNIT = 2.0 ** -24  # the unit roundoff of fp32: the most precise arithmetic a kernel keeps scores in


def error_floor(top: float, dtype: torch.dtype, logit_top: float) -> float:
    """The max-abs error no implementation is held below: ULP_FLOOR ULPs of the dtype at the
    largest magnitude, plus the conditioning of exp. Every kernel holds scores in fp32 at best,
    so a score of magnitude |s| is off by up to |s| 2^-24 and exp(s) by that much relative;
    softmax, output and gradients inherit it. Measured on CPU with torch 2.13: SDPA's flash
    backend in fp32 at q scale 40 (|s| up to about 120) has dv 9e-6 off at magnitude 4, ten times
    eager math's error yet within this term; in 16-bit dtypes the first term dominates."""
    return ULP_FLOOR * top * (format_of(dtype).eps + max(1.0, logit_top) * FP32_UNIT)


class CancelledTerms:
    """The size of the terms that cancel in each element of dq and dk (module docstring), from the
    float64 inputs and upstream gradient: ``scale sum_j P_ij (|dO_i|.|v_j| + |dO_i|.|O_i|) |k_j|``
    (``|a|.|b|``: the dot product's terms, each rounded, summed by size)
    for dq, the same summed over queries (and the query heads sharing a key/value head) with |q_i|
    for dk. ``max_floor`` and ``rms_floor`` are ULP_FLOOR x fp32's unit roundoff x their largest
    and RMS element."""

    def __init__(self, dq: torch.Tensor, dk: torch.Tensor):
        self.sizes = {"dq": dq, "dk": dk}

    def max_floor(self, name: str) -> float:
        t = self.sizes.get(name)
        return 0.0 if t is None or not t.numel() else ULP_FLOOR * FP32_UNIT * float(t.max())

    def rms_floor(self, name: str) -> float:
        t = self.sizes.get(name)
        return 0.0 if t is None or not t.numel() else ULP_FLOOR * FP32_UNIT * float(t.pow(2).mean().sqrt())


def cancelled_terms(scores, q, k, v, upstream, fully_masked: str = "zero") -> CancelledTerms:
    """``CancelledTerms`` of attention on float64 ``q``, ``k``, ``v`` and their ``scores``
    (``attention_scores``: -inf where masked) under the upstream gradient ``upstream`` (a fully masked
    row's probabilities as its convention gives them: none for ``zero``, uniform for ``mean``; NaN rows
    count nothing)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    ke, ve = expand_kv(q, k), expand_kv(q, v)
    with torch.no_grad():
        if fully_masked == "mean":  # every score of the row equal (reference_attention): uniform
            scores = scores.masked_fill(torch.isneginf(scores).all(-1, keepdim=True), 0.0)
        p = torch.softmax(scores, -1).nan_to_num(0.0)
        out = p @ ve
        dot_v = upstream.abs() @ ve.abs().transpose(-1, -2)  # |dO_i| . |v_j|: the terms of dP_ij
        dot_out = (upstream * out).abs().sum(-1, keepdim=True)  # |dO_i|.|O_i|: the terms of D_i
        weight = p * (dot_v + dot_out) * scale
        dq = weight @ ke.abs()
        dk = weight.transpose(-1, -2) @ q.abs()
        dk = dk.unflatten(1, (k.shape[1], q.shape[1] // k.shape[1])).sum(2)  # query heads sharing a kv head
    return CancelledTerms(dq, dk)
