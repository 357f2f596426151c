"""The training suite's built-in target: a small GPT-style language model (2 layers, width 64,
4 heads, vocabulary 256, context 64) trained with AdamW on deterministic synthetic text, so
``--precision-suite`` runs a training suite with no user code.

The data is a fixed random order-2 Markov chain over the 256 tokens (a CPU generator seeded per
batch), which a model can learn: the loss falls from about ln 256 = 5.5 within a few steps, so a
step that stalls or diverges shows in the trajectory.
"""
from __future__ import annotations

import math

import torch
from torch import nn
import torch.nn.functional as F

from pytest_precision.inputs import seeded_normal
from pytest_precision.training import TrainSpec

VOCAB, WIDTH, HEADS, LAYERS, CONTEXT = 256, 64, 4, 2, 64
BATCH = 8
STEPS = 8
DATA_SEED = 20261123
INIT_SEED = 1


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        # no bias on q, k, v (as Llama): the key bias's gradient is exactly 0 in exact arithmetic
        # (softmax ignores a constant added to a query's scores), so fp32 holds only rounding noise
        # there, about 1e-10, which every 16-bit path zeroes; a third of the bias would count as
        # gradient underflow (measured: 33 % under DDP's fp16 hook) for no loss of training signal
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, HEADS, w // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, w))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyGPT(nn.Module):
    """Token and position embeddings, pre-norm blocks, a final norm and an untied output head;
    ``forward(tokens, targets)`` returns the mean next-token cross-entropy."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        # GPT-2's init, N(0, 0.02) with the residual projections scaled down, drawn in float64 from
        # a CPU generator: nn.init.normal_ fills float32 in a vectorised order that differs by CPU
        # ISA, and the golden's fp32 trajectory should be the same run on every machine
        g = torch.Generator().manual_seed(INIT_SEED)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    std = 0.02 / math.sqrt(2 * LAYERS) if name.endswith(("proj.weight", "down.weight")) else 0.02
                    p.copy_(seeded_normal(g, *p.shape, scale=std))
                elif name.endswith("bias"):
                    p.zero_()

    def forward(self, tokens, targets):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _transitions() -> torch.Tensor:
    """Next-token distribution given the previous two tokens (folded to 256 states), peaked so
    there is something to learn."""
    g = torch.Generator().manual_seed(DATA_SEED)
    return torch.softmax(seeded_normal(g, VOCAB, VOCAB, scale=3.0), dim=-1)


_TRANSITIONS: torch.Tensor | None = None


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``i``: (tokens, next tokens), each (BATCH, CONTEXT) int64, the same on every machine."""
    global _TRANSITIONS
    if _TRANSITIONS is None:
        _TRANSITIONS = _transitions()
    g = torch.Generator().manual_seed(DATA_SEED + 1 + i)
    seq = torch.empty(BATCH, CONTEXT + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
    seq[:, 1] = torch.randint(0, VOCAB, (BATCH,), generator=g)
    for t in range(2, CONTEXT + 1):
        state = (seq[:, t - 1] * 31 + seq[:, t - 2]) % VOCAB
        seq[:, t] = torch.multinomial(_TRANSITIONS[state], 1, generator=g).squeeze(1)
    return seq[:, :-1], seq[:, 1:]


def model() -> TinyGPT:
    return TinyGPT()


def optimizer(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01, foreach=False)


SPEC = TrainSpec(model, optimizer, batch, steps=STEPS)
