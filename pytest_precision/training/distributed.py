"""Gradient compression in data-parallel training, measured on the real engine.

When one machine is not enough, users train data-parallel (``DistributedDataParallel``) across
GPUs and nodes, and the gradient all-reduce becomes the bottleneck. DDP's communication hooks
``fp16_compress_hook`` and ``bf16_compress_hook`` halve that traffic by casting each gradient
bucket to 16 bits, dividing by the world size and all-reducing in 16 bits. That is a precision
change the single-process training suite never sees: in fp16, gradients below the subnormal range
(6e-8, and the division by the world size pushes them further down) become 0 and sums above 65504
become inf; bf16 keeps fp32's range but has 8 significant bits. ``compare_ddp_hooks`` runs one
forward/backward of a :class:`~pytest_precision.training.TrainSpec` under DDP (gloo on CPU, nccl
on CUDA) without a hook and with each hook, in one group of spawned processes, and compares the
all-reduced gradients rank 0 holds. The forward and loss are the spec's own (``TrainSpec.loss``:
its ``loss_fn``, or the model's output); the spawned ranks import ``model_fn`` and ``loss_fn`` by
name and receive their batches as tensors (``batch_fn`` runs here, once per rank). DDP refuses
``bf16_compress_hook`` by name without CUDA and NCCL >= 2.10, so the same function runs under
another name (gloo all-reduces bf16 on CPU).

Metrics (hook run against the uncompressed run, both fp32 models, no autocast):

- ``grad_sqnr_db``: 20 log10(||ref|| / ||out - ref||) over all gradients together; inf when equal,
  -inf when a hooked gradient is not finite;
- ``max_rel``: max |out - ref| / |ref| over elements with |ref| >= the hook dtype's smallest normal
  (below it the format cannot hold the value to relative precision, which ``underflow_rate`` shows)
  whose exact value is significant (``compare.significant``: not the rounding noise of a sum that
  cancels, such as the key part of an attention bias, 1.6e6 relative in bf16 otherwise);
- ``underflow_rate``: per parameter, the fraction of its significant elements within the hook
  dtype's normal range that are 0 with the hook, judged against the exact all-reduced gradient
  (the ranks' float64 gradients averaged, computed here): an element whose exact gradient is 0
  (the key part of an attention bias) holds rounding noise uncompressed and 0 with the hook, and
  is not counted (``compare.significant``). Besides range underflow this counts ranks' gradients
  that cancel exactly once rounded, which is why bf16 shows a small rate too;
- ``below_range_underflow``: the same fraction over significant elements below the normal range
  (shown: the format cannot hold them, and the hook has no loss scaling);
- ``overflow``: elements not finite with the hook where the uncompressed gradient is finite;
- ``grad_norm`` / ``ref_grad_norm``: L2 norms of all gradients together.

Measured (CPU, gloo): the two spawned processes take about 5 s, most of it importing torch; the
built-in GPT keeps 70.3 dB through the fp16 hook and 52.5 dB through the bf16 one, against floors of
6.02 dB per mantissa bit less 6 dB (54.2 and 36.1 dB).
"""
from __future__ import annotations

import contextlib
import math
import os
import importlib
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .batches import MicroBatches, map_tensors
from .compare import significant, tensors_sqnr_db, underflow_rates
from ..numerics.promote import read_as_float64
from .module_dtypes import parameters_to
from .run import GlobalStateError, judged_state
from .spec import LossContractError, TrainSpec

__all__ = ["HOOKS", "HookComparison", "RankRunError", "ddp_skip_reason", "compare_ddp_hooks", "exact_gradients",
           "rank_imports", "run_ranks", "RankStage", "averaged_gradients", "compare_gradients"]

HOOKS = ("fp16", "bf16")
_HOOK_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class RankRunError(RuntimeError):
    """A multi-process run (``run_ranks``: the DDP and the FSDP2 comparisons) failed: a rank raised
    or exited, or the ranks did not finish in time."""


@dataclass
class HookComparison:
    """One hook's all-reduced gradients against uncompressed DDP (plain values, see the module docstring)."""

    hook: str
    grad_sqnr_db: float
    max_rel: float
    underflow_rate: dict[str, float]
    overflow: int
    grad_norm: float
    ref_grad_norm: float
    below_range_underflow: dict[str, float] = field(default_factory=dict)
    underflow_elements: dict[str, int] = field(default_factory=dict)  # the significant elements a rate counts over
    below_range_elements: dict[str, int] = field(default_factory=dict)  # those ``below_range_underflow`` counts over

    def as_dict(self) -> dict:
        return dict(self.__dict__, underflow_rate=dict(self.underflow_rate),
                    below_range_underflow=dict(self.below_range_underflow),
                    underflow_elements=dict(self.underflow_elements),
                    below_range_elements=dict(self.below_range_elements))


def _bf16_hook(process_group, bucket):
    """torch's bf16_compress_hook under another name (DDP's check by name is about the build, not the numerics)."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


_HOOK_FNS = {"fp16": default_hooks.fp16_compress_hook, "bf16": _bf16_hook}


def _backend(device: str, world_size: int) -> str:
    # nccl needs one GPU per rank; with fewer GPUs the ranks share them over gloo
    return "nccl" if device == "cuda" and torch.cuda.device_count() >= world_size and dist.is_nccl_available() else "gloo"


def ddp_skip_reason(device: str = "cpu", world_size: int = 2) -> str | None:
    """Why ``compare_ddp_hooks`` cannot run here, or None."""
    if world_size < 2:
        return f"a DDP comparison needs world_size >= 2, got {world_size}"
    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if device == "cuda" and not torch.cuda.is_available():
        return "device 'cuda' requested but CUDA is not available"
    if device not in ("cpu", "cuda"):
        return f"the DDP comparison runs on 'cpu' or 'cuda', not {device!r}"
    if _backend(device, world_size) == "gloo" and not dist.is_gloo_available():
        return "the gloo backend is not available in this torch build"
    return None


def _to_device(batch, device, dtype=torch.float32):
    """Tensors in ``batch`` to ``device``, floating ones in ``dtype`` (the comparison runs in fp32)."""
    return map_tensors(lambda t: t.to(device, dtype) if t.is_floating_point() else t.to(device), batch)


def _import_path(fn) -> str:
    """``module:qualname``, by which a spawned rank imports ``fn``: the ranks get names, not
    pickled objects. ValueError when ``fn`` has no such name (a lambda, a nested function)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        raise ValueError("it has no importable name (a lambda or a function defined inside another)")
    path = f"{module}:{qualname}"
    if _resolve(path) is not fn:
        raise ValueError(f"{module}.{qualname} names another object")
    return path


def _resolve(path: str):
    module, _, qualname = path.partition(":")
    if module == "__main__":  # a spawned process re-imports the parent's script as __mp_main__
        module = "__mp_main__" if "__mp_main__" in sys.modules else module
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _join_process_group(rank: int, world_size: int, port: int, device: str, backend: str, timeout_s: float) -> torch.device:
    """This rank's device, made current before the process group starts: torch's NCCL group takes
    the current device as the rank's device for what it sets up before a tensor says otherwise
    (barriers, communicators), so a rank that set its device only afterwards could set those up on
    cuda:0, beside rank 0."""
    dev = torch.device(device, rank % torch.cuda.device_count()) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    return dev


class RankStage:
    """What a rank is doing, for the error it reports if that raises."""

    def __init__(self, text: str):
        self.text = text


def _ddp_body(rank: int, dev: torch.device, backend: str, spec: TrainSpec, batch, hooks, at: RankStage) -> dict:
    """One DDP rank's work: the uncompressed run, then one run per hook; the gradients it holds."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    grads = {}
    for name in ("none", *hooks):
        at.text = "model_fn()"
        torch.manual_seed(spec.seed)
        model = spec.model_fn().to(dev, torch.float32)
        at.text = f"forward/backward under DDP (hook {name})"
        ddp = DDP(model, device_ids=[dev.index] if backend == "nccl" else None)
        if name != "none":
            ddp.register_comm_hook(None, _HOOK_FNS[name])
        spec.loss(ddp, batch).backward()
        grads[name] = {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return grads


def _rank_main(rank, world_size, port, device, backend, fns, fields, payload, workdir, timeout_s, body=_ddp_body):
    """One rank: joins the group, loads its batch, runs ``body`` (a module-level function, or its
    ``module:qualname``); rank 0 saves what ``body`` returns. A failure is written where the parent
    reads it."""
    torch.set_num_threads(1)  # N ranks on a few cores: OpenMP threads per rank would oversubscribe
    at = RankStage("importing model_fn/loss_fn")
    try:
        body = _resolve(body) if isinstance(body, str) else body
        model_fn, loss_fn = (_resolve(path) if path else None for path in fns)
        # the parent's spec minus what the ranks do not run: the loss is computed as the spec computes
        # it; ``fields``: its seed and the modules it declares float32
        spec = TrainSpec(model_fn, lambda p: None, lambda i: None, steps=1, loss_fn=loss_fn, **fields)
        at.text = f"init_process_group({backend})"
        dev = _join_process_group(rank, world_size, port, device, backend, timeout_s)
        at.text = f"loading rank {rank}'s batch"
        batch = _to_device(torch.load(os.path.join(workdir, f"batch{rank}.pt"), weights_only=True), dev)
        result = body(rank, dev, backend, spec, batch, payload, at)
        if rank == 0:
            torch.save(result, os.path.join(workdir, "result.pt"))
        dist.destroy_process_group()
        code = 0
    except BaseException as e:
        with open(os.path.join(workdir, f"error{rank}.txt"), "w") as f:
            f.write(f"{at.text} raised {''.join(traceback.format_exception_only(type(e), e)).strip()}")
        traceback.print_exc()
        code = 1
    # DDP and FSDP import torch._dynamo and sympy: tearing that interpreter down takes seconds, for nothing
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_error(workdir: str, procs) -> str:
    """The error of the rank that failed first (the others then fail on the closed connection)."""
    reports = []
    for rank in range(len(procs)):
        path = os.path.join(workdir, f"error{rank}.txt")
        if os.path.exists(path):
            with open(path) as f:
                reports.append((os.stat(path).st_mtime_ns, rank, f.read()))
    if reports:
        _, rank, text = min(reports)
        return f"rank {rank}: {text}"
    rank, code = next((r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0))
    return f"rank {rank} exited with code {code} before reporting an error (its stderr has the details)"


def rank_imports(spec: TrainSpec) -> tuple[str, str | None]:
    """``module:qualname`` of ``model_fn`` and ``loss_fn`` (None without one), by which the ranks
    import them; TypeError naming the one that has no importable name."""
    paths = []
    for name in ("model_fn", "loss_fn"):  # the ranks need only these (batches are sent as tensors)
        fn = getattr(spec, name)
        if fn is None:
            paths.append(None)
            continue
        try:
            paths.append(_import_path(fn))
        except Exception as e:
            raise TypeError(f"TrainSpec.{name} ({fn!r}) cannot be imported by name ({e}): the DDP and FSDP "
                            "comparisons' spawned processes import model_fn and loss_fn, so they must be module-level "
                            "functions (a conftest's are)") from None
    return paths[0], paths[1]


def run_ranks(spec: TrainSpec, batches: list, device: str, world_size: int, payload, timeout_s: float,
              body=_ddp_body, what: str = "DDP comparison"):
    """``body(rank, device, backend, spec, batch, payload, stage)`` on ``world_size`` spawned ranks
    (rank r on ``batches[r]``), in one process group; what rank 0's returned. ``what`` names the
    work in errors: RankRunError when a rank fails (the first to fail, named) or time runs out
    (the ranks still running are killed)."""
    fns = rank_imports(spec)
    backend, port = _backend(device, world_size), _free_port()
    ctx = torch.multiprocessing.get_context("spawn")  # not fork: torch's OpenMP threads are not fork-safe
    with tempfile.TemporaryDirectory(prefix="precision-ranks-") as workdir:
        for rank, batch in enumerate(batches):  # a step's MicroBatches as the plain list the ranks can load
            torch.save(list(batch) if isinstance(batch, MicroBatches) else batch, os.path.join(workdir, f"batch{rank}.pt"))
        # the rank's entry and body go by name: a function object pickles only while its module is the
        # one in sys.modules, and a module imported again since (pytester's sessions drop the modules
        # they imported) leaves this one's functions stale
        by_name = "<" not in body.__qualname__  # a nested function has no name to go by: pickled as it is
        body_path = f"{body.__module__}:{body.__qualname__}" if by_name else body
        procs = [ctx.Process(target=_resolve(f"{__name__}:_rank_main"), daemon=True, args=(
            rank, world_size, port, device, backend, fns, {"seed": spec.seed, "keep_fp32": spec.keep_fp32}, payload,
            workdir, timeout_s, body_path))
            for rank in range(world_size)]
        deadline = time.monotonic() + timeout_s
        try:
            for p in procs:
                p.start()
            while True:
                codes = [p.exitcode for p in procs]  # read once: a rank may exit between two reads
                if any(c not in (None, 0) for c in codes):
                    raise RankRunError(f"{what} ({backend}, {world_size} ranks) failed: "
                                       + _first_error(workdir, procs))
                if all(c == 0 for c in codes):
                    break
                running = [p for p, c in zip(procs, codes) if c is None]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RankRunError(f"{what} ({backend}, {world_size} ranks) timed out after "
                                       f"{timeout_s:g} s; ranks {[procs.index(p) for p in running]} still running")
                ready = wait([p.sentinel for p in running], timeout=left)
                for p in running:
                    if p.sentinel in ready:  # its pipe closed as it exits: reap it (no spinning until it is gone)
                        p.join()
        finally:
            for p in procs:  # a failed rank leaves the others blocked in a collective: kill them
                if p.pid is None:  # never started (the start itself raised): the error raised is that one
                    continue
                if p.is_alive():
                    p.kill()
                p.join()
        return torch.load(os.path.join(workdir, "result.pt"), weights_only=True)


def exact_gradients(spec: TrainSpec, batches: list, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The all-reduced gradient DDP computes, exactly: each rank's float64 gradient from the seeded
    model (rank r on ``batches[r]``), averaged, on the CPU. Raises what the forward raises (a model
    whose output is not a loss: TypeError), and a GlobalStateError when ``model_fn`` or the forward
    and backward leave torch's process-wide state changed (restored; ``run.judged_state``)."""
    return averaged_gradients(spec, batches, device)[0]


def averaged_gradients(spec: TrainSpec, batches: list, device: str = "cpu", dtype: torch.dtype = torch.float64,
                       buffers_as_built: bool = False) -> tuple[dict[str, torch.Tensor], float]:
    """What data-parallel training computes, in one process: the gradient of each of ``batches``
    from the seeded model in ``dtype``, averaged (on the CPU), and the losses' mean; as
    ``exact_gradients`` says. In float64 the model's own float32 is read as float64
    (``run.read_as_float64``); ``buffers_as_built`` casts its parameters alone."""
    total: dict[str, torch.Tensor] = {}
    losses = []
    forward, owner = (("loss_fn(model, batch) and its backward", "loss_fn") if spec.loss_fn is not None
                      else ("the model's forward and backward", "the model"))
    for batch in batches:
        torch.manual_seed(spec.seed)
        with judged_state("model_fn()"):
            model = spec.model_fn().to(device)
        if buffers_as_built:
            parameters_to(model, dtype)
        else:
            model = model.to(dtype=dtype)
        with read_as_float64() if dtype == torch.float64 else contextlib.nullcontext(), \
                judged_state(forward, owner=owner):
            loss = spec.loss(model, _to_device(batch, device, dtype))
            loss.backward()
        losses.append(float(loss.detach()))
        for n, p in model.named_parameters():
            if p.grad is not None:
                g = p.grad.detach().cpu()
                total[n] = total[n] + g if n in total else g
    return {n: g / len(batches) for n, g in total.items()}, sum(losses) / len(losses)


def compare_gradients(label: str, dtype: torch.dtype, out: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                      exact: dict[str, torch.Tensor]) -> HookComparison:
    """Gradients ``out`` (communicated or computed in ``dtype``) against ``ref``; the underflow rates
    against ``exact`` (the module docstring's metrics)."""
    names = [n for n in ref if n in out]
    o = torch.cat([out[n].flatten().double() for n in names])
    r = torch.cat([ref[n].flatten().double() for n in names])
    ref_norm = float(torch.linalg.vector_norm(r))
    # where the exact value is significant (not a sum's rounding noise, compare.significant) and normal
    sig = torch.cat([(significant(exact[n]) if n in exact else torch.ones_like(ref[n], dtype=torch.bool)).flatten()
                     for n in names])
    normal = (r.abs() >= torch.finfo(dtype).smallest_normal) & sig
    rel = ((o - r).abs() / r.abs())[normal].nan_to_num(nan=math.inf)
    lost = underflow_rates(out, exact, torch.finfo(dtype).smallest_normal)
    return HookComparison(
        hook=label, grad_sqnr_db=tensors_sqnr_db(out, ref), max_rel=float(rel.max()) if rel.numel() else 0.0,
        underflow_rate=lost.rate, below_range_underflow=lost.below_range, underflow_elements=lost.elements,
        below_range_elements=lost.below_elements,
        overflow=int((~torch.isfinite(o) & torch.isfinite(r)).sum()),
        grad_norm=float(torch.linalg.vector_norm(o)), ref_grad_norm=ref_norm)


def compare_ddp_hooks(spec: TrainSpec, *, device: str = "cpu", world_size: int = 2, hooks=HOOKS,
                      timeout_s: float = 120) -> dict[str, HookComparison]:
    """One DDP forward/backward of ``spec`` (rank r on ``spec.batch_fn(r)``, model seeded with
    ``spec.seed``) uncompressed and under each of ``hooks``; the gradients compared per hook, the
    underflow rates against the exact all-reduced gradient. Raises ValueError where
    ``ddp_skip_reason`` gives a reason, TypeError for callables spawned processes cannot import,
    LossContractError (a TypeError) for a model whose output is not a loss and no ``loss_fn``,
    RankRunError when a rank fails or time runs out, GlobalStateError when ``batch_fn``,
    ``model_fn`` or the forward, called here, leave torch's process-wide state changed (restored;
    the spawned ranks' state ends with them). A model that cannot run in float64 has its rates
    judged against the uncompressed gradients instead."""
    unknown = [h for h in hooks if h not in _HOOK_DTYPES]
    if unknown:
        raise ValueError(f"unknown DDP compression hooks {unknown}; known: {list(HOOKS)}")
    reason = ddp_skip_reason(device, world_size)
    if reason:
        raise ValueError(f"compare_ddp_hooks: {reason}")
    rank_imports(spec)  # before any work: a spec the ranks cannot import is refused at once
    batches = []
    for rank in range(world_size):
        with judged_state(f"batch_fn({rank})"):
            batches.append(spec.batch_fn(rank))
    try:  # here, before spawning: a forward that does not give a loss fails fast
        exact = exact_gradients(spec, batches)
    except (LossContractError, GlobalStateError):
        raise
    except Exception:  # a model that cannot run in float64: the rates are judged against uncompressed DDP
        exact = None
    grads = run_ranks(spec, batches, device, world_size, tuple(hooks), timeout_s)
    return {h: compare_gradients(h, _HOOK_DTYPES[h], grads[h], grads["none"], grads["none"] if exact is None else exact)
            for h in hooks}
