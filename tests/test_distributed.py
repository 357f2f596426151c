"""compare_ddp_hooks: DDP gradients under torch's fp16/bf16 compression hooks against uncompressed
DDP, on gloo with 2 spawned CPU processes, the underflow rates against the exact all-reduced
gradient. Each call spawns a process group (a few seconds), so the tiny GPT run is shared and the
failure tests fail before any DDP work."""
import json
import math
import multiprocessing
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pytest_precision.training.distributed import HOOKS, RankRunError, compare_ddp_hooks, ddp_skip_reason
from pytest_precision.suites import tiny_gpt
from pytest_precision.training import TrainSpec

pytestmark = pytest.mark.skipif(ddp_skip_reason("cpu") is not None, reason=str(ddp_skip_reason("cpu")))


# module-level, so the spawned ranks can import them


class TinyGradLinear(nn.Module):
    """A Linear whose loss is scaled by 1e-10: positive inputs give gradients of about 1e-10, all
    of one sign (so no cancellation between ranks), far below fp16's subnormal 6e-8."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x):
        return self.lin(x).sum() * 1e-10


def tiny_grad_model():
    return TinyGradLinear()


def tiny_grad_batch(i):
    return (torch.rand(8, 16, generator=torch.Generator().manual_seed(i)),)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def model_failing_on_rank1():
    if dist.get_rank() == 1:  # rank 0 goes on and blocks in DDP's broadcast: the parent must kill it
        raise ValueError("planted failure in model_fn")
    return TinyGradLinear()


def model_that_hangs():
    if dist.is_initialized():  # in the ranks; the parent builds the model for the exact gradient
        time.sleep(120)
    return TinyGradLinear()


class ReturnsLogitsAndLoss(nn.Module):
    """As nanoGPT: forward returns (logits, loss)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x):
        logits = self.lin(x)
        return logits, logits.pow(2).mean()


def logits_and_loss_model():
    return ReturnsLogitsAndLoss()


@pytest.fixture(scope="module")
def tiny_gpt_hooks():
    return compare_ddp_hooks(tiny_gpt.SPEC)


def test_tiny_gpt_hooks_cost_their_mantissa_bits(tiny_gpt_hooks):
    fp16, bf16 = tiny_gpt_hooks["fp16"], tiny_gpt_hooks["bf16"]
    assert set(tiny_gpt_hooks) == set(HOOKS)
    for c in (fp16, bf16):
        assert c.overflow == 0
        assert math.isfinite(c.grad_norm) and c.grad_norm > 0
        assert c.grad_norm == pytest.approx(c.ref_grad_norm, rel=1e-3)
        assert math.isfinite(c.max_rel) and c.max_rel > 0
        assert all(0.0 <= r < 0.05 for r in c.underflow_rate.values()), c.underflow_rate
        # the key part of each q/k/v bias has an exactly-zero gradient: not counted
        assert all(c.underflow_elements[f"blocks.{i}.qkv.bias"] <= 128 for i in range(2)), c.underflow_elements
        json.dumps(c.as_dict())  # plain values: crosses to the xdist controller
    # rounding to p significant bits costs about 20 log10(2^p) dB, a few dB over it measured
    # (fp16 p=11: 66 dB, measured 70.5; bf16 p=8: 48 dB, measured 52.4): equal grads (the hook
    # not applied) give inf, the wrong dtype gives the other band
    assert 60 < fp16.grad_sqnr_db < 80, fp16
    assert 44 < bf16.grad_sqnr_db < 60, bf16
    assert 12 < fp16.grad_sqnr_db - bf16.grad_sqnr_db < 24  # 3 mantissa bits = 18 dB


def test_tiny_gradients_underflow_in_fp16_not_bf16():
    spec = TrainSpec(tiny_grad_model, sgd, tiny_grad_batch, steps=1)
    result = compare_ddp_hooks(spec)
    fp16, bf16 = result["fp16"], result["bf16"]
    # below fp16's normal range: the format cannot hold them (the hook has no loss scaling), so they
    # are shown apart, and the SQNR (0 dB) is what fails the case
    assert fp16.below_range_underflow == {"lin.weight": 1.0, "lin.bias": 1.0} and fp16.underflow_rate == {}
    assert fp16.grad_norm == 0.0 and fp16.grad_sqnr_db == 0.0  # everything lost: the error is the signal
    assert 0 < fp16.ref_grad_norm < 1e-8
    assert bf16.underflow_rate == {"lin.weight": 0.0, "lin.bias": 0.0}
    assert bf16.underflow_elements == {"lin.weight": 64, "lin.bias": 4}
    assert bf16.grad_sqnr_db > 40 and bf16.max_rel < 2 ** -7
    assert fp16.max_rel == 0.0  # no reference element reaches fp16's smallest normal


def test_unpicklable_spec_is_refused_before_spawning():
    spec = TrainSpec(lambda: TinyGradLinear(), sgd, tiny_grad_batch, steps=1)
    start = time.monotonic()
    with pytest.raises(TypeError, match=r"TrainSpec\.model_fn .*cannot be imported by name.*must be module-level"):
        compare_ddp_hooks(spec)
    spec = TrainSpec(tiny_grad_model, sgd, tiny_grad_batch, steps=1, loss_fn=lambda model, batch: model(*batch))
    with pytest.raises(TypeError, match=r"TrainSpec\.loss_fn .*cannot be imported by name"):
        compare_ddp_hooks(spec)
    assert time.monotonic() - start < 1
    assert not multiprocessing.active_children()


def test_a_forward_that_is_not_a_loss_is_refused_before_spawning():
    """(With a loss_fn the ranks run it: tests/test_training_suite.py's DDP cases on the attention model.)"""
    from pytest_precision.training import LossContractError

    spec = TrainSpec(logits_and_loss_model, sgd, tiny_grad_batch, steps=1)
    start = time.monotonic()
    with pytest.raises(LossContractError, match=r"returned tuple of 2 \(Tensor, Tensor\).*loss_fn\(model, batch\)"):
        compare_ddp_hooks(spec)
    assert time.monotonic() - start < 1 and not multiprocessing.active_children()


def test_a_failing_rank_is_named_and_the_others_killed():
    spec = TrainSpec(model_failing_on_rank1, sgd, tiny_grad_batch, steps=1)
    start = time.monotonic()
    with pytest.raises(RankRunError, match=r"rank 1: model_fn\(\) raised ValueError: planted failure in model_fn"):
        compare_ddp_hooks(spec, timeout_s=60)
    assert time.monotonic() - start < 30
    assert not multiprocessing.active_children()


def test_ranks_past_the_timeout_are_killed():
    spec = TrainSpec(model_that_hangs, sgd, tiny_grad_batch, steps=1)
    start = time.monotonic()
    with pytest.raises(RankRunError, match=r"timed out after 5 s; ranks \[0, 1\] still running"):
        compare_ddp_hooks(spec, timeout_s=5)
    assert time.monotonic() - start < 15
    assert not multiprocessing.active_children()


def test_unknown_hook_and_unavailable_device_are_refused():
    with pytest.raises(ValueError, match="unknown DDP compression hooks"):
        compare_ddp_hooks(tiny_gpt.SPEC, hooks=("fp8",))
    if not torch.cuda.is_available():
        assert "CUDA is not available" in ddp_skip_reason("cuda")
        with pytest.raises(ValueError, match="CUDA is not available"):
            compare_ddp_hooks(tiny_gpt.SPEC, device="cuda")


@pytest.mark.parametrize("device,expected", [("cuda", ["set_device(cuda:1)", "init_process_group(nccl, rank 3)"]),
                                             ("cpu", ["init_process_group(nccl, rank 3)"])])
def test_a_rank_sets_its_device_before_the_process_group(monkeypatch, device, expected):
    """The order NCCL needs (a rank's device current before the group starts), checked by calling
    the rank's set-up with torch's calls recorded: no GPU or process group needed."""
    from pytest_precision.training import distributed

    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(f"set_device({d})"))
    monkeypatch.setattr(distributed.dist, "init_process_group",
                        lambda backend, rank, world_size, timeout: calls.append(f"init_process_group({backend}, rank {rank})"))
    dev = distributed._join_process_group(3, 4, 12345, device, "nccl", 5.0)
    assert calls == expected
    assert dev == (torch.device("cuda", 1) if device == "cuda" else torch.device("cpu"))


def test_a_rank_that_cannot_start_raises_its_own_error_not_the_cleanups():
    """A body the spawn cannot pickle fails at the first start(); the cleanup once joined the ranks
    never started too, and torch's 'can only join a started process' hid the cause."""
    from pytest_precision.training.distributed import run_ranks

    with pytest.raises(Exception) as raised:
        run_ranks(tiny_gpt.SPEC, [tiny_gpt.SPEC.batch_fn(0)] * 2, "cpu", 2, None, 30, body=lambda *a: None)
    assert "can only join a started process" not in str(raised.value)
    assert "pickle" in f"{type(raised.value).__name__} {raised.value}".lower()
