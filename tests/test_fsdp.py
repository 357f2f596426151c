"""The FSDP2 cases of the training suite: fully_shard with a MixedPrecisionPolicy on 2 spawned gloo
ranks, each on half of batch_fn(0), judged against single-process fp32 and float64. A correct
model passes every FSDP2 config (its per-group SQNR shown), the plant (float16 gradients reduced in
float16 with no loss scaling, on a loss scaled far down or up) fails naming what it lost while
bfloat16 with a float32 reduce passes on the same model; specs the ranks cannot run and devices
that cannot run them skip with the reason, before any process is spawned. Each session that runs
FSDP2 spawns one process group for all its configs (30 to 40 s a session on this 2-core machine
shared with other work; the DDP cases' group takes as long)."""
import multiprocessing
import time

import pytest
import torch
from training_helpers import HEADER, run_suite

# imported here, outside the pytester sessions: the ranks' entry point and body are pickled by
# reference, so their modules must stay in sys.modules (as tests/test_training_suite.py says)
import pytest_precision.training.distributed  # noqa: F401
import pytest_precision.training.fsdp  # noqa: F401
from pytest_precision.training import TrainSpec
from pytest_precision.training.fsdp import BatchShardError, compare_fsdp, fsdp_skip_reason, shard_batch

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.skipif(fsdp_skip_reason("cpu") is not None, reason=str(fsdp_skip_reason("cpu")))

FSDP = ("fsdp-bf16", "fsdp-bf16-reduce-bf16", "fsdp-fp16-reduce-fp16")

# the small regression model, its loss scaled by SCALE, with two optimizer parameter groups (the
# SQNR is reported per group); module-level functions, which the spawned ranks import
NET = HEADER + """

def model():
    return Net({SCALE})


def optimizer(model):
    return torch.optim.SGD([{{"params": [model.fc1.weight, model.fc2.weight]}},
                            {{"params": [model.fc1.bias, model.fc2.bias], "weight_decay": 0.0}}], lr=0.1)


pytest_precision.register("net", pytest_precision.TrainSpec(model, optimizer, batch, steps=2), kind="train_step")
"""


def test_correct_model_passes_every_fsdp2_config(pytester):
    pytester.makeconftest(NET.format(SCALE="1.0"))
    result = run_suite(pytester, "--precision-configs=fp16,bf16", "-k", "fsdp", "--precision-update-baselines")
    result.assert_outcomes(passed=3)
    for config in FSDP:
        result.stdout.fnmatch_lines([f"| net *| {config} *| *1 |*| pass *|"])


@pytest.mark.parametrize("scale,fp16_failure", [
    # gradients of about 1e-9: below float16's subnormals, the loss itself (1e-8) rounds to 0
    ("1e-8", ["*net-fsdp-fp16-reduce-fp16-trajectory*: FAIL accuracy (gradient SQNR 0 dB in group 0, 0 dB in group 1 < "
              "48.21 dB, what float16 keeps in a correct step; loss deviates from fp32 by 1 (relative) > 0.005 allowed "
              "for fsdp-fp16-reduce-fp16)*",
              "*lost below float16's normal range (no loss scaling; shown): *fc1.bias 32 of 32 elements (100 %)*"]),
    # a loss of about 1e5: past float16's 65504 in the forward
    ("1e5", ["*net-fsdp-fp16-reduce-fp16-trajectory*: FAIL overflow* (non-finite loss inf under FSDP2*"
             "gradient elements not finite under FSDP2, finite in fp32*"]),
], ids=["underflow", "overflow"])
def test_fp16_reduced_in_fp16_without_loss_scaling_fails_where_bf16_passes(pytester, scale, fp16_failure):
    """The plant: FSDP2 in float16 with no loss scaling on a loss scaled far down or up. One session
    with the update flag: what passes is accepted, what fails is not."""
    pytester.makeconftest(NET.format(SCALE=scale))
    result = run_suite(pytester, "--precision-configs=fp16,bf16", "-k", "fsdp", "--precision-update-baselines")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["| net *| fsdp-bf16 *|*| pass *|", "| net *| fsdp-bf16-reduce-bf16 *|*| pass *|",
                                 "| net *| fsdp-fp16-reduce-fp16 *|*| FAIL *|"])
    result.stdout.fnmatch_lines(fp16_failure)


def test_specs_the_ranks_cannot_run_skip_with_the_reason_before_spawning(pytester):
    pytester.makeconftest(HEADER + """

def odd_batch(i):
    return batch(i)[0][:3], batch(i)[1][:3]


def model():
    return Net()


pytest_precision.register("lambdas", pytest_precision.TrainSpec(lambda: Net(), sgd, batch, steps=2), kind="train_step")
pytest_precision.register("odd", pytest_precision.TrainSpec(model, sgd, odd_batch, steps=2), kind="train_step")
""")
    start = time.monotonic()
    result = run_suite(pytester, "--precision-configs=bf16", "-k", "fsdp-bf16-trajectory", "-rs")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*lambdas: *model_fn*cannot be imported by name*module-level*"])
    result.stdout.fnmatch_lines(["*odd: batch_fn(0)'s tensors have [[]3[]] rows along dim 0: the FSDP2 cases give each "
                                 "of 2 ranks an equal share of one batch*divisible by 2*"])
    assert time.monotonic() - start < 30 and not multiprocessing.active_children()


def test_shard_batch_splits_every_tensor_along_dim_0():
    tokens, targets = torch.arange(12).view(6, 2), torch.arange(6)
    shares = shard_batch({"x": tokens, "y": targets, "note": "kept"}, 2)
    assert [s["x"].tolist() for s in shares] == [tokens[:3].tolist(), tokens[3:].tolist()]
    assert [s["y"].tolist() for s in shares] == [[0, 1, 2], [3, 4, 5]] and shares[1]["note"] == "kept"
    with pytest.raises(BatchShardError, match=r"\[4, 6\] rows along dim 0"):
        shard_batch((torch.zeros(6), torch.zeros(4)), 2)
    with pytest.raises(BatchShardError, match="holds no tensor"):
        shard_batch(("text",), 2)


def _net():
    return torch.nn.Linear(4, 2)


def test_an_unavailable_backend_or_fsdp2_is_refused_with_the_reason(monkeypatch):
    spec = TrainSpec(_net, lambda p: torch.optim.SGD(p, lr=0.1), lambda i: (torch.zeros(2, 4),), steps=1)
    policies = {"fsdp-bf16": (torch.bfloat16, torch.float32)}
    if not torch.cuda.is_available():  # the cuda path: skipped, as the DDP cases are
        from types import SimpleNamespace

        from pytest_precision.suites.training import TRAIN_STEP
        from pytest_precision.training import TRAIN_CONFIGS

        assert fsdp_skip_reason("cuda") == "device 'cuda' requested but CUDA is not available"
        with pytest.raises(ValueError, match="compare_fsdp: device 'cuda' requested but CUDA is not available"):
            compare_fsdp(spec, policies, device="cuda")
        # the case's skip reason (a session cannot ask for cuda here: --precision-device refuses it)
        case = SimpleNamespace(config=TRAIN_CONFIGS["fsdp-bf16-reduce-bf16"], device="cuda", regime="trajectory")
        assert TRAIN_STEP.skip_reason(case) == ("fsdp-bf16-reduce-bf16: device 'cuda' requested but CUDA is not "
                                                "available")
    assert fsdp_skip_reason("cpu", world_size=1) == "an FSDP2 comparison needs world_size >= 2, got 1"
    monkeypatch.setattr(torch.distributed, "is_gloo_available", lambda: False)
    assert fsdp_skip_reason("cpu") == "the gloo backend is not available in this torch build"
    monkeypatch.undo()
    import torch.distributed.fsdp as fsdp_module

    monkeypatch.delattr(fsdp_module, "fully_shard")  # a torch before FSDP2
    assert fsdp_skip_reason("cpu") == f"torch.distributed.fsdp.fully_shard (FSDP2) is not in torch {torch.__version__}"


# a model whose head asserts what keep_fp32 promises it: float32 inputs (module level: the ranks import it)
class _Float32Head(torch.nn.Linear):
    def forward(self, x):
        if x.dtype != torch.float32:
            raise TypeError(f"the head declared float32 got {x.dtype} inputs")
        return super().forward(x)


class _KeptHeadNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = torch.nn.Linear(8, 16), _Float32Head(16, 4)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.head(torch.relu(self.body(x))).float(), y)


def kept_head_model():
    return _KeptHeadNet()


def kept_head_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def kept_head_batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)


def test_a_module_declared_float32_is_its_own_float32_unit_under_fsdp2():
    """keep_fp32 under FSDP2: the declared module sharded on its own with a float32 policy, its
    inputs cast to float32; without the declaration it gets the bf16 policy's inputs."""
    import dataclasses

    from pytest_precision.training.distributed import RankRunError

    spec = TrainSpec(kept_head_model, kept_head_optimizer, kept_head_batch, steps=1, keep_fp32=("head",))
    policy = {"fsdp-bf16": (torch.bfloat16, torch.float32)}
    result = compare_fsdp(spec, policy)["fsdp-bf16"]
    assert result.gradients.overflow == 0 and result.loss_deviation < 0.05
    with pytest.raises(RankRunError, match="the head declared float32 got torch.bfloat16 inputs"):
        compare_fsdp(dataclasses.replace(spec, keep_fp32=()), policy)


def test_a_declared_module_tied_to_another_stays_in_the_models_unit():
    """FSDP2 shards a parameter in one unit only: a head sharing the embedding's weight cannot be a
    float32 unit of its own (fully_shard refuses it), so it stays in the model's."""
    from pytest_precision.training.fsdp import own_units

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.body, self.head = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 8)
            self.head.weight = self.emb.weight

    model = Tied()
    assert own_units(model, ("head",)) == []
    assert [name for name, _ in own_units(model, ("head", "body"))] == ["body"]
    assert [name for name, _ in own_units(_KeptHeadNet(), ("head",))] == ["head"]
