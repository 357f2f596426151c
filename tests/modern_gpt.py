"""A GPT built as recent small-LLM repositories build theirs, in small (tests/test_training_float64.py):
a compute dtype fixed at import and rotary tables kept in it, zero-initialised output projections,
per-layer residual scalars in their own parameter groups, a squared-ReLU MLP, soft-capped logits,
AdamW with a tiny eps and learning rates up to 0.5, and its own loop of 2 micro-batches."""
import torch
import torch.nn.functional as F
from torch import nn

from pytest_precision.training import MarkovText

COMPUTE_DTYPE = torch.float32  # fixed at import, as such a repository does on a CPU


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def rotate(x, cos, sin):
    assert cos.dtype == COMPUTE_DTYPE, f"rotary tables in {cos.dtype}"
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.out = nn.Linear(4 * d, d, bias=False)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.out.weight)

    def forward(self, x, cos, sin):
        b, s, d = x.shape
        q, k, v = self.qkv(norm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k = rotate(norm(q), cos, sin), rotate(norm(k), cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.out(F.relu(self.fc(norm(x))).square())


class GPT(nn.Module):
    def __init__(self, vocab=64, d=32, heads=2, layers=2, seq=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.resid = nn.Parameter(torch.ones(layers))
        self.x0 = nn.Parameter(torch.zeros(layers))
        self.head = nn.Linear(d, vocab, bias=False)
        half = d // heads // 2
        freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), freq)
        self.register_buffer("cos", angles.cos().to(COMPUTE_DTYPE), persistent=False)
        self.register_buffer("sin", angles.sin().to(COMPUTE_DTYPE), persistent=False)

    def forward(self, tokens, targets):
        x = x0 = norm(self.wte(tokens))
        for i, block in enumerate(self.blocks):
            x = block(self.resid[i] * x + self.x0[i] * x0, self.cos, self.sin)
        logits = self.head(norm(x)).float()
        logits = 15 * torch.tanh(logits / 15)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def optimizer(model):
    matrices = [p for p in model.blocks.parameters() if p.ndim == 2]
    return torch.optim.AdamW([dict(params=[model.wte.weight], lr=0.2), dict(params=[model.head.weight], lr=0.004),
                              dict(params=[model.resid], lr=0.5), dict(params=[model.x0], lr=0.5),
                              dict(params=matrices, lr=0.02)], betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)


def loop(clip_before_unscale=False):
    def step_fn(model, optimizer, scaler, batch, autocast):
        tokens, targets = batch
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for t, y in zip(tokens.chunk(2), targets.chunk(2)):
            with autocast():
                loss = model(t, y) / 2
            scaler.scale(loss).backward()
            total = total + loss.detach()
        if clip_before_unscale:  # the defect
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        return total
    return step_fn


data = MarkovText(vocab_size=64, batch_size=8, block_size=16)
