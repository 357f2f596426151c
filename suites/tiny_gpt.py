"""The training suite's built-in target: a small GPT-style language model (2 layers, width 64,
4 heads, vocabulary 256, context 64) trained with AdamW on deterministic synthetic text, so
``--precision-suite`` runs a training suite with no user code.

The data is ``training.MarkovText``: a fixed random order-2 Markov chain over the 256 tokens (a CPU
generator seeded per batch), which a model learns only through attention, so a change of the
attention shows in the fp32 reference, and a step that stalls or diverges in the trajectory.

What it shows on a CPU (``pytest --precision-suite -k train_step``, torch 2.13): every config passes,
with its q/k/v bias (as GPT-2). Without a scaler 16 of a q/k/v weight's 12288 fp16 gradients
underflow (0.13 %); pure bf16 loses 33 of a LayerNorm weight's 64 updates (52 %: weights at 1.0,
AdamW steps of 3e-3 below half a ULP), and stochastic rounding brings that to 12 (19 %); fp8 keeps
23.5 dB of gradient SQNR emulated (power-of-two scales) and 24.5 dB through ``torch._scaled_mm``
(scales max / amax), delayed scaling saturating 0.39 % of one Linear's input where it grew. The
worst-step SQNR is lower than the first step's (29 dB under amp-bf16) because AdamW's first step
moves every weight by about the learning rate whatever its gradient's size, so rounding that flips a
small gradient's sign moves the trajectory. On a CPU autocast steps are not faster than fp32.
"""
from __future__ import annotations

import math

import torch
from torch import nn
import torch.nn.functional as F

from pytest_precision.kinds import seeded_normal
from pytest_precision.training import MarkovText, TrainSpec

VOCAB, WIDTH, HEADS, LAYERS, CONTEXT = 256, 64, 4, 2, 64
BATCH = 8
STEPS = 8
DATA_SEED = 20261123
INIT_SEED = 1


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        # with a q/k/v bias, as GPT-2: the key part's gradient is exactly 0 (softmax ignores a
        # constant added to a query's scores), rounding noise in fp32 and 0 in 16 bits; the rates
        # are judged against the float64 step, where it is noise too, so it is not counted
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
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
        # ISA, and the golden's fp32 trajectory should be the same run on every machine. Offset by the
        # seed the harness gave torch (TrainSpec.seed, 0 by default: the goldens' init), so each seed of
        # a success-rate case (TrainSpec.seeds) starts from another initialisation
        g = torch.Generator().manual_seed(INIT_SEED + torch.initial_seed())
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


# batch i: (tokens, next tokens), each (BATCH, CONTEXT) int64, the same on every machine
batch = MarkovText(vocab_size=VOCAB, batch_size=BATCH, block_size=CONTEXT, seed=DATA_SEED)


def model() -> TinyGPT:
    return TinyGPT()


def optimizer(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01, foreach=False)


SPEC = TrainSpec(model, optimizer, batch, steps=STEPS)
