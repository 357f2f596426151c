"""torch's own transformer layers as a user wires them (tests/test_training_float64.py): an
embedding, one nn.TransformerEncoderLayer, nn.TransformerDecoderLayer or nn.MultiheadAttention under
a causal mask, a Linear head, a float32 cross-entropy, AdamW, the harness's standard step."""
import torch
import torch.nn.functional as F
from torch import nn
from pytest_precision.training import MarkovText

DATA = MarkovText(vocab_size=64, batch_size=8, block_size=16)


class LM(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(64, 32)
        if kind == "encoder":
            self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        elif kind == "decoder":
            self.layer = nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        else:
            self.layer = nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, 64)

    def forward(self, tokens, targets):
        x = self.emb(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        if self.kind == "encoder":
            h = self.layer(x, src_mask=mask, is_causal=True)
        elif self.kind == "decoder":
            h = self.layer(x, x, tgt_mask=mask, tgt_is_causal=True)
        else:
            h = x + self.layer(x, x, x, attn_mask=mask, need_weights=False)[0]
        logits = self.head(h).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def encoder():
    return LM("encoder")


def decoder():
    return LM("decoder")


def mha():
    return LM("mha")


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)
