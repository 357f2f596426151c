"""What the training suite's pytester tests share (tests/test_training_suite.py,
tests/test_training_loop_checks.py, tests/test_training.py): a small regression model and its
data as conftest text, a session of the training suite, nanoGPT's attention in small."""

# A small regression model: fast, and its loss can be made as small as a defect needs.
HEADER = """
import torch
import torch.nn.functional as F
from torch import nn
import pytest_precision
from pytest_precision.numerics.inputs import seeded_normal


class Net(nn.Module):
    def __init__(self, loss_scale=1.0):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)
        self.loss_scale = loss_scale

    def forward(self, x, y):
        return self.loss_scale * F.mse_loss(self.fc2(torch.relu(self.fc1(x))), y)


def batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return seeded_normal(g, 64, 16), seeded_normal(g, 64, 8)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)
"""


def run_suite(pytester, *args):
    """A session of the training suite (the other suites deselected)."""
    args = list(args)
    if "-k" in args:
        i = args.index("-k") + 1
        args[i] = f"train_step and ({args[i]})"
    else:
        args += ["-k", "train_step"]
    return pytester.runpytest("--precision-suite", "-p", "no:cacheprovider", *args)


def accept_then_run(pytester, *args):
    run_suite(pytester, "--precision-update-baselines", *args)
    return run_suite(pytester, *args)


# nanoGPT's shape in small: a causal self-attention layer with a q/k/v bias (the key part of its
# gradient is exactly 0: softmax ignores a constant added to a query's scores), forward returning
# (logits, loss); the suite's tests and tests/test_training.py build it
ATTENTION_MODEL = """class TinyAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(32, 16)
        self.qkv = nn.Linear(16, 48)
        self.head = nn.Linear(16, 32)

    def forward(self, tokens, targets):
        x = self.tok(tokens)
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, w // 2).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True{SCALE})
        logits = self.head(x + a.transpose(1, 2).reshape(b, s, w))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())
"""
