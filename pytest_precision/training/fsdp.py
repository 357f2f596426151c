"""FSDP2 mixed precision, measured on the real engine.

Sharded data-parallel training (``torch.distributed.fsdp.fully_shard``, "FSDP2") keeps fp32
master weights sharded across ranks and runs each forward and backward in the
``MixedPrecisionPolicy``'s ``param_dtype``: the parameters are all-gathered and cast to it, the
model's floating inputs are cast to it, every op runs in it (not only matmuls, as under autocast:
norms, softmax and the loss too), and the gradients it gives are reduce-scattered in
``reduce_dtype`` (fp32, or the same 16 bits to halve the traffic, the choice large runs make) and
stored in fp32 on each rank's shard. ``output_dtype`` is left at torch's default (outputs in
``param_dtype``), as torchtitan does.

``compare_fsdp`` runs one forward/backward of a :class:`~pytest_precision.training.TrainSpec`
under ``fully_shard(model, mp_policy=...)`` for each policy, on spawned ranks in one process group
(gloo on the CPU, nccl with a GPU per rank: ``distributed.run_ranks``), each rank on its share of
``batch_fn(0)`` (its tensors split along dim 0), and compares the gathered gradients with the same
data in one process in fp32 (each share's gradient, averaged: what data-parallel computes; for a
loss that is a mean over equal shares, the gradient of the whole batch, 306 dB apart in float64 on
the built-in GPT) and in float64 (the truth the rates are judged against). One step, no optimizer:
FSDP's precision is in the gradients it gives; what an optimizer makes of them over steps is what
the single-process configs judge. Metrics: those of the DDP comparison (``distributed``:
``grad_sqnr_db``, ``max_rel``, ``underflow_rate`` within ``param_dtype``'s normal range and
``below_range_underflow`` below it, ``overflow``), the SQNR per optimizer parameter group, the
SQNR against float64, and the loss (the ranks' mean) against the fp32 loss.

What nccl changes on GPUs: FSDP2 reduces the same way on both backends (torch 2.13: fp32 and bf16
with ``ReduceOp.AVG``, fp16 divided by about sqrt(world size) before the sum and by the rest after,
to stay in range); on nccl the average runs inside NCCL's kernels, the partial sums follow its
ring or tree order, rounded to the 16-bit dtype at each hop, and the matmuls run on tensor cores
(fp32 accumulation, as the CPU's 16-bit matmuls): the figures move by summation order, not by
format. CUDA with fewer GPUs than ranks runs gloo; without CUDA the cuda path is skipped with the
reason (``fsdp_skip_reason``).

Measured (CPU, gloo, torch 2.13): one process group for every FSDP2 config of a target takes about as
long as the DDP cases' (23.6 against 21.7 s for the built-in GPT on a 2-core machine under a load of
7, most of it the ranks importing torch). The built-in GPT keeps 44.7 dB with a fp32 reduce and 44.3
dB with a bf16 one (pure bf16's first step has 44.7 too), 61.6 dB in fp16; float16 params with a
float32 reduce (one line in ``training.configs`` away, not run by default) measured 61.9 dB, within
0.3 dB of fp16 reduced in fp16: the float16 backward, not the reduce, sets it. A model whose loss is
scaled by 1e-8 passes both bf16 configs and fails fp16 reduced in fp16 without loss scaling (0 dB:
every gradient lost); scaled by 1e5, its fp16 loss overflows (``tests/test_fsdp.py``).
"""
from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .batches import batch_sizes, map_tensors, split_batch
from ..numerics.formats import format_of
from .compare import group_floors, group_labels, tensors_sqnr_db
from .distributed import (HookComparison, RankStage, averaged_gradients, compare_gradients, ddp_skip_reason,
                          rank_imports, run_ranks)
from .module_dtypes import cast_then_as_built, declared_modules
from .run import GlobalStateError, judged_state
from .spec import LossContractError, TrainSpec

__all__ = ["FSDPComparison", "fsdp_skip_reason", "compare_fsdp", "shard_batch", "BatchShardError"]


class BatchShardError(ValueError):
    """``batch_fn(0)`` cannot be split evenly between the ranks."""


@dataclass
class FSDPComparison:
    """One policy's gathered gradients against single-process fp32 (plain values; the module docstring)."""

    config: str
    param_dtype: str
    reduce_dtype: str
    gradients: HookComparison  # against fp32: SQNR of all gradients, max rel, rates (against float64), overflow
    group_grad_sqnr_db: dict[str, float]  # per optimizer parameter group, against fp32
    exact_grad_sqnr_db: float  # all gradients against float64 (NaN where the model cannot run in float64)
    loss: float  # the ranks' losses, averaged
    ref_loss: float  # the fp32 losses of the same shares, averaged
    loss_deviation: float  # |loss - ref_loss| / |ref_loss|
    groups: dict[str, list[str]] = field(default_factory=dict)
    # per group, the floor from what param_dtype can keep of it, where below the format's, and the
    # groups it cannot resolve at all, left out of group_grad_sqnr_db (compare.resolvable_db)
    group_floor_db: dict[str, float] = field(default_factory=dict)
    unresolved: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        out = dict(self.__dict__, gradients=self.gradients.as_dict(), group_grad_sqnr_db=dict(self.group_grad_sqnr_db),
                   groups={g: list(names) for g, names in self.groups.items()})
        out.pop("group_floor_db")
        out.pop("unresolved")
        return out


def fsdp_skip_reason(device: str = "cpu", world_size: int = 2) -> str | None:
    """Why ``compare_fsdp`` cannot run here, or None."""
    reason = ddp_skip_reason(device, world_size)
    if reason:
        return reason.replace("a DDP comparison", "an FSDP2 comparison")
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: F401
    except ImportError:
        return f"torch.distributed.fsdp.fully_shard (FSDP2) is not in torch {torch.__version__}"
    return None


def shard_batch(batch, world_size: int) -> list:
    """``batch`` split into ``world_size`` equal shares along dim 0 of each tensor, as accumulation
    splits micro-batches (``batches.split_batch``; a 0-dim tensor or another value goes to every
    rank as it is), each share's tensors copied (a rank receives its share, not a view of the whole
    batch); BatchShardError when it holds no tensor with a dim 0 or its tensors do not split evenly."""
    sizes = batch_sizes(batch)
    if not sizes:
        raise BatchShardError("batch_fn(0) holds no tensor with a dim 0 to split between the ranks")
    if len(sizes) > 1 or next(iter(sizes)) % world_size:
        raise BatchShardError(f"batch_fn(0)'s tensors have {sorted(sizes)} rows along dim 0: the FSDP2 cases "
                              f"give each of {world_size} ranks an equal share of one batch, so every tensor needs a "
                              f"number of rows divisible by {world_size}")
    return [map_tensors(torch.Tensor.clone, share) for share in split_batch(batch, world_size)]


def own_units(model: torch.nn.Module, patterns: tuple[str, ...]) -> list[tuple[str, torch.nn.Module]]:
    """The modules declared float32 that FSDP2 can shard as units of their own: those sharing no
    parameter with the rest of the model (a head tied to the embedding stays in the model's unit,
    in ``param_dtype``, as FSDP2 shards it)."""
    units = []
    for name, module in declared_modules(model, patterns):
        inside = {id(p) for p in module.parameters()}
        outside = {id(p) for n, p in model.named_parameters(remove_duplicate=False)
                   if not (n.startswith(name + "."))}
        if not inside & outside:
            units.append((name, module))
    return units


def _full(grad: torch.Tensor) -> torch.Tensor:
    """A gradient gathered from the ranks' shards (a collective: every rank calls it in the same order)."""
    full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return full.detach().cpu()


def _fsdp_body(rank: int, dev: torch.device, backend: str, spec: TrainSpec, batch, policies, at: RankStage) -> dict:
    """One rank's work: per policy, a seeded model under ``fully_shard``, one forward/backward on
    this rank's share, the gradients gathered and every rank's loss."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    out = {}
    for config_id, (param_dtype, reduce_dtype) in policies:
        at.text = "model_fn()"
        torch.manual_seed(spec.seed)  # every rank builds the same weights; fully_shard keeps its shard
        model = spec.model_fn().to(dev, torch.float32)
        # a module declared float32 (keep_fp32) is its own FSDP2 unit with a float32 policy, as a
        # repository keeping its head in float32 shards it: float32 parameters and reduction, its
        # forward inputs cast to float32 (the policy's cast_forward_inputs); not one whose parameters
        # are tied to another module's (FSDP2 shards a parameter in one unit only)
        for name, module in own_units(model, spec.keep_fp32):
            at.text = f"fully_shard({name}, mp_policy=MixedPrecisionPolicy(float32, float32)) (keep_fp32; {config_id})"
            fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32))
        at.text = f"fully_shard(model, mp_policy=MixedPrecisionPolicy({param_dtype}, {reduce_dtype})) ({config_id})"
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
        at.text = f"forward/backward under FSDP2 ({config_id})"
        # a model running interpreted Triton kernels computes bf16 as a GPU does, as in the parent
        emulated = contextlib.nullcontext()
        if "triton.language.standard" in sys.modules:
            from ..platform.triton import bf16_as_on_gpu
            emulated = bf16_as_on_gpu()
        with emulated:
            loss = spec.loss(model, batch)
            loss.backward()
        at.text = f"gathering the gradients and losses ({config_id})"
        grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        losses = [torch.zeros(1, dtype=torch.float64, device=dev) for _ in range(dist.get_world_size())]
        dist.all_gather(losses, loss.detach().to(torch.float64).reshape(1))
        out[config_id] = {"grads": grads, "losses": torch.cat(losses).cpu()}
    return out


def _groups(spec: TrainSpec) -> dict[str, list[str]]:
    """The optimizer's parameter groups, by parameter name (``compare.group_labels``)."""
    torch.manual_seed(spec.seed)
    with judged_state("model_fn()"):
        model = spec.model_fn()
    with judged_state("optimizer_fn"):
        opt = spec.make_optimizer(model)
    names = {p: n for n, p in model.named_parameters()}
    return group_labels([[names[p] for p in g["params"] if p in names] for g in opt.param_groups])


def compare_fsdp(spec: TrainSpec, policies: dict[str, tuple[torch.dtype, torch.dtype]], *, device: str = "cpu",
                 world_size: int = 2, timeout_s: float = 120) -> dict[str, FSDPComparison]:
    """One FSDP2 forward/backward of ``spec`` per policy (config id -> (param_dtype, reduce_dtype)),
    each rank on its share of ``batch_fn(0)``, against the same shares in one process in fp32 (the
    rates against float64). Raises ValueError where ``fsdp_skip_reason`` gives a reason,
    BatchShardError (a ValueError) for a batch that does not split evenly, TypeError for callables
    the spawned ranks cannot import, LossContractError for a forward that is not a loss,
    RankRunError when a rank fails or time runs out, GlobalStateError when the spec's code,
    called here, leaves torch's process-wide state changed. A model that cannot run in float64 has
    its rates judged against fp32."""
    reason = fsdp_skip_reason(device, world_size)
    if reason:
        raise ValueError(f"compare_fsdp: {reason}")
    rank_imports(spec)  # before any work: a spec the ranks cannot import is refused at once
    with judged_state("batch_fn(0)"):
        shares = shard_batch(spec.batch_fn(0), world_size)
    ref, ref_loss = averaged_gradients(spec, shares, dtype=torch.float32)  # a forward that is not a loss fails here
    try:  # as the float64 step: with its buffers cast, then as built (run.run_casting_buffers)
        exact = cast_then_as_built(lambda as_built: averaged_gradients(spec, shares, buffers_as_built=as_built)[0],
                                   passes=(LossContractError, GlobalStateError))
    except (LossContractError, GlobalStateError):
        raise
    except Exception:  # a model that cannot run in float64: the rates are judged against fp32
        exact = None
    groups = _groups(spec)
    ranks = run_ranks(spec, shares, device, world_size, tuple(policies.items()), timeout_s, body=_fsdp_body,
                      what="FSDP2 comparison")
    out = {}
    for config_id, (param_dtype, reduce_dtype) in policies.items():
        grads, losses = ranks[config_id]["grads"], ranks[config_id]["losses"]
        loss = float(losses.mean())
        floors, unresolved = group_floors(groups, ref, exact, format_of(param_dtype).mantissa_bits)
        out[config_id] = FSDPComparison(
            config=config_id, param_dtype=_name(param_dtype), reduce_dtype=_name(reduce_dtype),
            gradients=compare_gradients(config_id, param_dtype, grads, ref, ref if exact is None else exact),
            group_grad_sqnr_db={g: tensors_sqnr_db(grads, ref, names) for g, names in groups.items()
                                if g not in unresolved},
            exact_grad_sqnr_db=math.nan if exact is None else tensors_sqnr_db(grads, exact),
            loss=loss, ref_loss=ref_loss,
            loss_deviation=abs(loss - ref_loss) / abs(ref_loss) if ref_loss and math.isfinite(loss) else
            (0.0 if loss == ref_loss else math.inf),
            groups=groups, group_floor_db=floors, unresolved=unresolved)
    return out


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
