"""Synthetic training data a model can learn, the same bits on every machine: a ``batch_fn`` for
a ``TrainSpec`` without a dataset.

Uniform random tokens give a language model nothing to learn: its loss sits at ln(vocabulary)
whatever the model computes, so a change of the model (an attention scale, a missing residual)
barely moves the fp32 trajectory. The text of :class:`MarkovText` is an order-2 Markov chain with
peaked transitions: the next token depends on the previous two, so the loss falls as a model
learns, and it learns only through attention (the token two back is not in its own position).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..numerics.inputs import seeded_normal

__all__ = ["MarkovText"]


@dataclass(frozen=True)
class MarkovText:
    """``batch_fn`` of a language model: ``MarkovText(...)(i)`` is batch ``i``, a pair (tokens,
    next tokens), each ``(batch_size, block_size)`` int64 and contiguous, the same on every call
    and every machine (CPU generators seeded from ``seed`` and ``i``).

    The chain: the next token is drawn from a distribution chosen by the previous two tokens
    (folded to ``vocab_size`` states); each distribution is the softmax of N(0, ``peak``^2) logits,
    peaked enough that a model which sees the two previous tokens predicts well."""

    vocab_size: int = 256
    batch_size: int = 8
    block_size: int = 64
    seed: int = 0
    peak: float = 3.0

    def __post_init__(self):
        for name in ("vocab_size", "batch_size", "block_size"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"MarkovText.{name} must be a positive int, got {value!r}")

    @functools.cached_property
    def transitions(self) -> torch.Tensor:
        """(vocab_size, vocab_size): row s is the next-token distribution in state s."""
        g = torch.Generator().manual_seed(self.seed)
        return torch.softmax(seeded_normal(g, self.vocab_size, self.vocab_size, scale=self.peak), dim=-1)

    def __call__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        v = self.vocab_size
        g = torch.Generator().manual_seed(self.seed + 1 + i)
        seq = torch.empty(self.batch_size, self.block_size + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, v, (self.batch_size,), generator=g)
        seq[:, 1] = torch.randint(0, v, (self.batch_size,), generator=g)
        for t in range(2, self.block_size + 1):
            state = (seq[:, t - 1] * 31 + seq[:, t - 2]) % v
            seq[:, t] = torch.multinomial(self.transitions[state], 1, generator=g).squeeze(1)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
