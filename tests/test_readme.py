"""The README's examples run as they are written (pytester): its nanoGPT conftest on a
nanoGPT-style model (the same constructor, ``configure_optimizers`` and ``(logits, loss)``
forward), its attention declarations and its Triton target."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from machine import ON_CPU

pytest_plugins = ["pytester"]

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def _block(marker: str) -> str:
    (block,) = [b for b in BLOCKS if marker in b]
    return block


# nanoGPT's interface (model.py: GPTConfig, GPT(config), forward(idx, targets) -> (logits, loss),
# configure_optimizers(weight_decay, learning_rate, betas, device_type)), written small
NANOGPT_STYLE_MODEL = """
import math
from dataclasses import dataclass
import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n_head = c.n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(c.n_embd, bias=c.bias), nn.LayerNorm(c.n_embd, bias=c.bias)
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.mlp = nn.Sequential(nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias), nn.GELU(),
                                 nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias))

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(w, dim=2)
        q, k, v = (z.view(b, t, self.n_head, w // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, w))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)
"""


def _run(pytester, *args):
    return pytester.runpytest("--precision-suite", "--precision-no-speed", "-p", "no:cacheprovider", *ON_CPU, *args)


def test_the_readme_nanogpt_conftest_runs_as_written(pytester):
    pytester.makepyfile(model=NANOGPT_STYLE_MODEL)
    pytester.makeconftest(_block("from model import GPT, GPTConfig"))
    args = ("--precision-configs=amp-bf16", "-k", "nanogpt")
    _run(pytester, "--precision-update-baselines", *args).assert_outcomes(passed=1)
    result = _run(pytester, *args)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*precision training summary*", "*| nanogpt *| amp-bf16 *| *8 |*pass*"])


def test_the_readme_declarations_run_as_written(pytester):
    declared = _block('register("fused_attention"')
    pytester.makeconftest("import torch, torch.nn.functional as F\nimport pytest_precision\n\n"
                          "def fused_attention(q, k, v, causal=False):\n"
                          "    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(),"
                          " is_causal=causal).to(q.dtype)\n\n" + declared)
    args = ("--precision-configs=fp32,fp16", "-rs")
    _run(pytester, "--precision-update-baselines", *args)
    result = _run(pytester, *args)
    result.assert_outcomes(passed=2 * 9, skipped=2 * (9 + 18))  # it calls SDPA: +math and +flash; fresh in both
    result.stdout.fnmatch_lines(["*fused_attention: declares dtypes float16; fp32 feeds it float32*"])


@pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"), reason="triton is not installed")
def test_the_readme_triton_target_runs_under_the_interpreter(pytester):
    pytester.makeconftest("import torch\nimport pytest_precision\n" + _block("@triton.jit"))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "--precision-suite", "--precision-no-speed", "-p",
                           "no:cacheprovider", "--precision-configs=fp32,fp16", "-k", "unit"],
                          cwd=pytester.path, env=env, capture_output=True, text=True, timeout=300)
    # no golden yet: the oracle and the peer pass, the golden is missing
    assert "FAIL baseline" in proc.stdout and "oracle" not in proc.stdout.split("FAIL baseline")[1][:200], \
        proc.stdout[-3000:]
    proc = subprocess.run([sys.executable, "-m", "pytest", "--precision-suite", "--precision-no-speed", "-p",
                           "no:cacheprovider", "--precision-configs=fp32,fp16", "-k", "unit",
                           "--precision-update-baselines"], cwd=pytester.path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert re.search(r"\b2 passed\b", proc.stdout), proc.stdout[-3000:]


# --- the quickstart: the first 150 lines take a newcomer from install to a failing and then an accepted golden

def _quickstart() -> str:
    return README[README.index("## Quickstart"):README.index("## Contents")]


def _as_pattern(line: str) -> str:
    """An excerpt line of the README as an fnmatch pattern: its numbers and paths may differ by machine."""
    line = re.sub(r"/repo/\S*?\.npz", "*", line)
    line = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "*", line)
    return line.replace("[", "[[]")


def test_the_quickstart_is_in_the_first_150_lines():
    head = "\n".join(README.splitlines()[:150])
    assert "## Contents" in head, "the contents list follows the quickstart within the first 150 lines"
    quickstart = _quickstart()
    for step in ("# conftest.py", "@pytest_precision.register(", "pytest --precision-suite", "FAIL accuracy,baseline",
                 "--precision-update-baselines", "precision baselines written", "FAIL accuracy,regression", "runs-on:"):
        assert step in quickstart, step


def test_the_quickstart_fails_then_accepts_as_written(pytester):
    """The quickstart's 16-bit softmax fails as its excerpt shows, its fix is accepted as a golden, and
    the 16-bit softmax put back then fails against that golden, as the README says."""
    quickstart = _quickstart()
    naive = _block("in x's dtype: fp16 and bf16 round every exp")
    fixed = naive[:naive.index("def my_softmax")] + _block("def my_softmax(x):\n    xf = x.float()")
    excerpts = [line for line in quickstart.splitlines() if line.startswith("precision-suite::softmax[my_softmax-")]
    first, regression = excerpts
    args = ("--precision-configs=bf16", "-k", "bf16-unit")
    pytester.makeconftest(naive)
    result = _run(pytester, *args)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([_as_pattern(first)])
    pytester.makeconftest(fixed)
    _run(pytester, *args).assert_outcomes(failed=1)  # no golden yet: only the baseline is missing
    result = _run(pytester, "--precision-update-baselines", *args)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*precision baselines written: 1 *", "softmax/my_softmax/unit [[]bf16] on * new: *"])
    _run(pytester, *args).assert_outcomes(passed=1)
    pytester.makeconftest(naive)
    result = _run(pytester, *args)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([_as_pattern(regression)])


def test_the_readme_links_lead_to_its_headings():
    body = re.sub(r"```.*?```", "", README, flags=re.S)
    slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
             for h in re.findall(r"^#+ (.*)$", body, flags=re.M)}
    assert not {link for link in re.findall(r"\]\(#([^)]+)\)", body) if link not in slugs}


@pytest.mark.skipif(not hasattr(__import__("pytest_precision"), "TensorKind")
                    or not __import__("importlib").util.find_spec("pytest_precision.testing"),
                    reason="pytest_precision.TensorKind and pytest_precision.testing.check_kind are not in this tree yet")
def test_the_readme_own_kind_runs_as_written(pytester):
    pytester.makepyfile(logsumexp_kind=_block("class LogSumExp(pytest_precision.TensorKind)"),
                        test_logsumexp_kind=_block("check_kind(KIND)"))
    pytester.makeconftest("import torch\nimport pytest_precision\n"
                          "pytest_precision.register_kind('logsumexp_kind:KIND')\n"
                          "pytest_precision.register('mine', lambda x: torch.logsumexp(x, -1), kind='logsumexp')\n")
    pytester.runpytest("-p", "no:cacheprovider", "test_logsumexp_kind.py").assert_outcomes(passed=1)
    args = ("--precision-configs=fp32,bf16", "-k", "mine")
    _run(pytester, "--precision-update-baselines", *args).assert_outcomes(passed=6)
    _run(pytester, *args).assert_outcomes(passed=6)
