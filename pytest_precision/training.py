"""Training steps under a precision config: the ``train_step`` contract, the training configs, the
run of a few steps that records everything the suite judges, and the comparison of a run with the
fp32 run from the same seed.

Contract (kind ``train_step``)::

    spec = pytest_precision.TrainSpec(model_fn, optimizer_fn, batch_fn, steps, step_fn=None)
    pytest_precision.register("my_model", spec, kind="train_step")

``model_fn()`` and ``optimizer_fn(params)`` build fresh objects (the harness seeds torch before
``model_fn``); ``batch_fn(i)`` returns batch ``i`` deterministically. ``step_fn(model, optimizer,
scaler, batch, autocast)`` runs one step and returns the loss; ``autocast()`` enters the config's
autocast region (wrap forward and loss in it) and ``scaler`` is a ``torch.amp.GradScaler``, enabled
only where the config scales the loss. Without a ``step_fn`` the standard loop runs
(``standard_step``). The loss of a batch is ``model(*batch)`` for a tuple or list and
``model(**batch)`` for a dict; a result with a ``.loss`` (Hugging Face models) gives that.

The harness watches the optimizer: the gradients it records are the ones ``optimizer.step()``
sees (unscaled, clipped: what is applied), through a step pre-hook, and a step whose
``optimizer.step()`` never ran is a step the GradScaler skipped.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .configs import fp8_roundtrip
from .formats import format_of
from .metrics import sqnr_db

__all__ = ["TrainSpec", "TrainConfig", "TRAIN_CONFIGS", "Trajectory", "TrainMetrics", "standard_step",
           "compute_loss", "run_training", "prepare_training", "compare_trajectories", "tensors_sqnr_db",
           "underflow_rates", "stochastic_round", "fp8_linears"]


@dataclass(frozen=True)
class TrainSpec:
    """A user's training step, as the suite runs it (see the module docstring)."""

    model_fn: Callable[[], nn.Module]
    optimizer_fn: Callable[[Any], torch.optim.Optimizer]
    batch_fn: Callable[[int], Any]
    steps: int = 8
    step_fn: Callable | None = None
    seed: int = 0

    def __post_init__(self):
        for name in ("model_fn", "optimizer_fn", "batch_fn"):
            if not callable(getattr(self, name)):
                raise TypeError(f"TrainSpec.{name} must be callable, got {getattr(self, name)!r}")
        if self.step_fn is not None and not callable(self.step_fn):
            raise TypeError(f"TrainSpec.step_fn must be callable or None, got {self.step_fn!r}")
        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise ValueError(f"TrainSpec.steps must be a positive int, got {self.steps!r}")


@dataclass(frozen=True)
class TrainConfig:
    """One training recipe. ``base`` is the matrix config id it belongs to (``--precision-configs``
    selects by it). ``autocast_dtype``: autocast region dtype. ``loss_scaling``: a GradScaler.
    ``param_dtype``: params, grads and optimizer state in that dtype (pure low precision).
    ``stochastic_rounding``: the weight update is computed in fp32 and stored with stochastic
    rounding. ``fp8``: nn.Linear layers emulated in fp8 (e4m3 forward, e5m2 gradients).
    ``shows``: what this config exists to show, reported rather than held to the absolute limits:
    ``underflow`` (gradient underflow), ``update_lost`` and ``update_size`` (the lost updates that
    follow from it, or from rounding the update away).
    ``loss_rtol``: the largest relative deviation of a step's loss from fp32 a correct step has."""

    id: str
    base: str
    description: str
    loss_rtol: float
    autocast_dtype: torch.dtype | None = None
    loss_scaling: bool = False
    param_dtype: torch.dtype = torch.float32
    stochastic_rounding: bool = False
    fp8: bool = False
    tf32: bool = False
    shows: tuple[str, ...] = ()
    ddp_hook: str | None = None  # a DDP gradient-compression comparison (distributed.py), not a run


    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the model's matmuls run in (what gradient underflow is measured against); for
        a DDP comparison, the dtype gradients are communicated in."""
        if self.ddp_hook is not None:
            return {"fp16": torch.float16, "bf16": torch.bfloat16}[self.ddp_hook]
        if self.fp8:
            return torch.float8_e5m2
        return self.autocast_dtype or self.param_dtype

    def skip_reason(self, device: str) -> str | None:
        from .configs import CONFIGS

        reason = CONFIGS[self.base].skip_reason(device)
        if reason is None and self.ddp_hook is not None:
            from .distributed import ddp_skip_reason

            reason = ddp_skip_reason(device)
            return f"{self.id}: {reason}" if reason else None
        return reason

    def autocast(self, device: str) -> Callable[[], contextlib.AbstractContextManager]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext
        return lambda: torch.autocast(device_type=device, dtype=self.autocast_dtype)


# loss_rtol: a correct step's largest relative loss deviation from fp32, with room. Measured on the
# built-in GPT (8 AdamW steps, CPU): 4e-5 in amp-bf16, 7e-6 in amp-fp16, 1e-2 in pure bf16 (with
# or without stochastic rounding), 2e-4 in fp8. The limits are the autocast dtype's ULP at 1 (bf16
# 2^-8 x 5, fp16 2^-11 x 10) and 0.1 where the weights themselves are 8-bit or 16-bit; a loss
# computed as log(softmax) in fp16, or a run that stalls or diverges, lands far outside them.
TRAIN_CONFIGS: dict[str, TrainConfig] = {c.id: c for c in (
    TrainConfig("fp32", "fp32", "float32, TF32 off (the reference trajectory)", 0.0),
    TrainConfig("tf32", "tf32", "float32 params, TF32 matmuls (CUDA)", 5e-3, tf32=True),
    TrainConfig("amp-bf16", "amp-bf16", "fp32 params, autocast bfloat16", 2e-2, autocast_dtype=torch.bfloat16),
    TrainConfig("amp-fp16", "amp-fp16", "fp32 params, autocast float16, GradScaler", 5e-3,
                autocast_dtype=torch.float16, loss_scaling=True),
    TrainConfig("amp-fp16-noscale", "amp-fp16", "fp32 params, autocast float16, no GradScaler (what the scaler prevents)",
                5e-3, autocast_dtype=torch.float16, shows=("underflow", "update_lost", "update_size")),
    TrainConfig("bf16", "bf16", "pure bfloat16: params, grads and optimizer state (updates below half a ULP are lost)",
                1e-1, param_dtype=torch.bfloat16, shows=("update_lost", "update_size")),
    TrainConfig("bf16-sr", "bf16", "pure bfloat16, the update computed in fp32 and stored with stochastic rounding",
                1e-1, param_dtype=torch.bfloat16, stochastic_rounding=True, shows=("update_lost", "update_size")),
    TrainConfig("fp8-e4m3", "fp8-e4m3", "nn.Linear in emulated fp8: e4m3 forward, e5m2 gradients, per-tensor current scaling",
                1e-1, fp8=True),
    TrainConfig("ddp-fp16", "fp16", "DDP on 2 processes, gradients all-reduced through fp16_compress_hook, against "
                "uncompressed DDP", 0.0, ddp_hook="fp16"),
    TrainConfig("ddp-bf16", "bf16", "DDP on 2 processes, gradients all-reduced through bf16_compress_hook, against "
                "uncompressed DDP", 0.0, ddp_hook="bf16"),
)}


# ---------------------------------------------------------------------------------------------
# the step


def compute_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss of ``batch``: ``model(*batch)``, ``model(**batch)`` or ``model(batch)``; a
    ``.loss`` attribute (Hugging Face outputs) is taken when present."""
    if isinstance(batch, dict):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    loss = getattr(out, "loss", out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"the model returned {type(out).__name__}; the standard step needs a scalar loss tensor "
                        "(or an output with .loss); give the TrainSpec a step_fn otherwise")
    return loss.reshape(())


def standard_step(model, optimizer, scaler, batch, autocast) -> torch.Tensor:
    """The loop from torch's AMP recipe: zero_grad, forward and loss under autocast, scaled
    backward, unscale, step, update."""
    optimizer.zero_grad(set_to_none=True)
    with autocast():
        loss = compute_loss(model, batch)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    return loss


# ---------------------------------------------------------------------------------------------
# pure bf16 with stochastic rounding, and fp8 Linear emulation


def stochastic_round(x: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """Round fp32 ``x`` to bfloat16 up or down with probability proportional to the distance, so
    E[result] = x: a uniform 16-bit integer is added to the bit pattern and the low 16 bits
    dropped. Non-finite values round to nearest."""
    if dtype != torch.bfloat16:
        raise ValueError(f"stochastic_round: only bfloat16 is supported, got {dtype}")
    x32 = x.detach().to(torch.float32).contiguous()
    noise = torch.randint(0, 1 << 16, x32.shape, dtype=torch.int32, generator=generator, device="cpu").to(x32.device)
    bits = (x32.view(torch.int32) + noise) & -65536  # 0xFFFF0000 as int32
    rounded = bits.view(torch.float32).to(torch.bfloat16)  # exact: the low bits are zero
    return torch.where(torch.isfinite(x32), rounded, x32.to(torch.bfloat16))


@contextlib.contextmanager
def _stochastic_rounding_updates(optimizer: torch.optim.Optimizer, seed: int) -> Iterator[None]:
    """Around every optimizer.step(): params, grads and state up to fp32 before, params back to
    bf16 with stochastic rounding and state back with round-to-nearest after."""
    gen = torch.Generator().manual_seed(seed)

    def before(opt, args, kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                p.data = p.data.float()
                if p.grad is not None:
                    p.grad = p.grad.float()
                for k, v in opt.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
                        opt.state[p][k] = v.float()

    def after(opt, args, kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                p.data = stochastic_round(p.data, generator=gen)
                if p.grad is not None:
                    p.grad = p.grad.to(torch.bfloat16)
                for k, v in opt.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
                        opt.state[p][k] = v.to(torch.bfloat16)

    handles = [optimizer.register_step_pre_hook(before), optimizer.register_step_post_hook(after)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class _Fp8Linear(torch.autograd.Function):
    """y = x W^T + b with x and W quantised to e4m3 and the output gradient to e5m2, each at a
    per-tensor power-of-two scale from its current amax (fp8_roundtrip); products in fp32."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        xq, _ = fp8_roundtrip(x, torch.float8_e4m3fn)
        wq, _ = fp8_roundtrip(weight, torch.float8_e4m3fn)
        ctx.save_for_backward(xq, wq)
        ctx.has_bias = bias is not None
        y = xq @ wq.t()
        return (y + bias.float() if bias is not None else y).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        xq, wq = ctx.saved_tensors
        gq, _ = fp8_roundtrip(grad, torch.float8_e5m2)
        gx = gq @ wq
        gw = gq.reshape(-1, gq.shape[-1]).t() @ xq.reshape(-1, xq.shape[-1])
        gb = gq.reshape(-1, gq.shape[-1]).sum(0) if ctx.has_bias else None
        return gx.to(grad.dtype), gw.to(wq.dtype), gb


@contextlib.contextmanager
def fp8_linears(model: nn.Module) -> Iterator[int]:
    """Every nn.Linear of ``model`` runs through the fp8 emulation inside the block; yields how many."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]

    def fp8_forward(m):
        return lambda x: _Fp8Linear.apply(x, m.weight, m.bias)
    for m in linears:
        m.forward = fp8_forward(m)
    try:
        yield len(linears)
    finally:
        for m in linears:
            del m.forward


# ---------------------------------------------------------------------------------------------
# a run


@dataclass
class Trajectory:
    """What a run of ``steps`` steps under one config recorded. Gradients and parameters are fp32
    copies on the CPU; per-step entries are None at a step the scaler skipped."""

    config: str
    losses: list[float]
    grad_norms: list[float | None]
    update_norms: list[float | None]
    scales: list[float | None]  # GradScaler scale after each step (None without a scaler)
    skipped: list[int]  # steps whose optimizer.step() did not run
    first_nonfinite: tuple[int, str] | None  # (step, "loss"/"gradient of <param>") at a step not skipped
    first_step: int | None  # the first step whose optimizer.step() ran
    grads0: dict[str, torch.Tensor]  # the gradients optimizer.step() saw at that step
    initial: dict[str, torch.Tensor]  # parameters before the first step, as stored
    final: dict[str, torch.Tensor]  # parameters after the last step, as stored
    changed: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)  # bool: element ever changed
    grads: dict[int, dict[str, torch.Tensor]] = field(repr=False, default_factory=dict)  # per step (keep_grads)
    step_times: list[float] = field(default_factory=list)  # wall seconds of each step (synchronised)


class TrainingError(Exception):
    """A target's model_fn, optimizer_fn, batch_fn or step raised; the message names which."""


def _cast_batch(batch: Any, dtype: torch.dtype, device: str) -> Any:
    """Floating tensors in ``batch`` to ``dtype`` on ``device``; token ids and masks keep theirs."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device=device, dtype=dtype) if batch.is_floating_point() else batch.to(device)
    if isinstance(batch, dict):
        return {k: _cast_batch(v, dtype, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_cast_batch(v, dtype, device) for v in batch)
    return batch


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(device="cpu", dtype=torch.float32, copy=True) for n, p in model.named_parameters()}


def run_training(spec: TrainSpec, config: TrainConfig, device: str, where: str = "",
                 keep_grads: bool = False) -> Trajectory:
    """Run ``spec.steps`` steps of the spec under ``config``; records the trajectory. With
    ``keep_grads`` (the fp32 reference) the gradients of every step are kept, so a run whose first
    steps the scaler skipped is compared on the same batch."""
    return prepare_training(spec, config, device, where, keep_grads)()


def prepare_training(spec: TrainSpec, config: TrainConfig, device: str, where: str = "",
                     keep_grads: bool = False) -> Callable[[], Trajectory]:
    """Build the seeded model, optimizer and scaler now; the returned call runs the steps. The
    tracer and the audit trace only that call, not the model's construction."""
    from .configs import _tf32_flags
    from .timing import synchronized_perf_counter

    where = where or f"train_step under {config.id}"
    if config.ddp_hook is not None:
        raise ValueError(f"{config.id} is a DDP comparison: distributed.compare_ddp_hooks runs it, not run_training")

    def call(what, fn, *a):
        try:
            return fn(*a)
        except torch.OutOfMemoryError as e:
            raise TrainingError(f"{where}: {what} ran out of memory ({e})") from e
        except TrainingError:
            raise
        except Exception as e:
            raise TrainingError(f"{where}: {what} raised {type(e).__name__}: {e}") from e

    torch.manual_seed(spec.seed)
    model = call("model_fn()", spec.model_fn)
    if not isinstance(model, nn.Module):
        raise TrainingError(f"{where}: model_fn() returned {type(model).__name__}, expected an nn.Module")
    model = model.to(device=device, dtype=config.param_dtype)
    model.train()
    names = {p: n for n, p in model.named_parameters()}
    optimizer = call("optimizer_fn(params)", spec.optimizer_fn, model.parameters())
    scaler = torch.amp.GradScaler(device, enabled=config.loss_scaling)
    step_fn = spec.step_fn or standard_step

    seen: dict = {}

    def watch(opt, args, kwargs):  # registered first: sees the grads before the SR hook casts them
        grads = {names[p]: p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None and p in names}
        seen["grads"] = grads
        seen["norm"] = float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.float()) for g in grads.values()]))) if grads else 0.0
        bad = next((n for n, g in grads.items() if not bool(torch.isfinite(g).all())), None)
        seen["bad"] = bad
        if "grads0" not in seen or keep_grads:
            copy = {n: g.detach().to(device="cpu", dtype=torch.float32, copy=True) for n, g in grads.items()}
            seen.setdefault("grads0", copy)
            seen.setdefault("first", seen["step"])
            if keep_grads:
                t.grads[seen["step"]] = copy

    initial = _snapshot(model)
    changed = {n: torch.zeros(p.shape, dtype=torch.bool) for n, p in initial.items()}
    t = Trajectory(config.id, [], [], [], [], [], None, None, {}, initial, {})
    def run() -> Trajectory:
        previous = t.initial
        with contextlib.ExitStack() as stack:
            hook = optimizer.register_step_pre_hook(watch)
            stack.callback(hook.remove)
            if config.stochastic_rounding:
                stack.enter_context(_stochastic_rounding_updates(optimizer, spec.seed + 1))
            if config.fp8:
                if stack.enter_context(fp8_linears(model)) == 0:
                    raise TrainingError(f"{where}: the model has no nn.Linear layer for the fp8 emulation to replace")
            if device == "cuda":
                stack.enter_context(_tf32_flags(config.tf32))
            autocast = config.autocast(device)
            for i in range(spec.steps):
                batch = _cast_batch(call(f"batch_fn({i})", spec.batch_fn, i), config.param_dtype, device)
                seen.pop("grads", None)
                seen.pop("bad", None)
                seen["step"] = i
                start = synchronized_perf_counter()
                loss = call(f"step {i}", step_fn, model, optimizer, scaler, batch, autocast)
                t.step_times.append(synchronized_perf_counter() - start)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise TrainingError(f"{where}: step {i} returned {type(loss).__name__}; step_fn must return the loss")
                value = float(loss.detach().float())
                t.losses.append(value)
                t.scales.append(float(scaler.get_scale()) if config.loss_scaling else None)
                ran = "grads" in seen
                if not ran:
                    t.skipped.append(i)
                if t.first_nonfinite is None:
                    if not math.isfinite(value):
                        t.first_nonfinite = (i, "loss")
                    elif ran and seen["bad"] is not None:
                        t.first_nonfinite = (i, f"gradient of {seen['bad']}")
                t.grad_norms.append(seen["norm"] if ran else None)
                now = _snapshot(model)
                t.update_norms.append(float(torch.linalg.vector_norm(torch.stack(
                    [torch.linalg.vector_norm(now[n] - previous[n]) for n in now]))) if ran else None)
                for n in now:
                    changed[n] |= now[n] != previous[n]
                previous = now
        t.grads0 = seen.get("grads0", {})
        t.first_step = seen.get("first")
        t.final = previous
        t.changed = changed
        return t

    return run


# ---------------------------------------------------------------------------------------------
# a run against the fp32 run


def tensors_sqnr_db(out: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """The SQNR of all the named tensors together (metrics.sqnr_db); -inf when ``out`` holds a
    non-finite value, NaN when the two share no name."""
    names = [n for n in ref if n in out]
    if not names:
        return float("nan")
    r = torch.cat([ref[n].flatten().double() for n in names])
    o = torch.cat([out[n].flatten().double() for n in names])
    if not bool(torch.isfinite(o).all()):
        return float("-inf")
    return sqnr_db(float(torch.linalg.vector_norm(r)), float(torch.linalg.vector_norm(o - r)))


def underflow_rates(out: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter of ``ref``: the fraction of its nonzero gradients that are 0 in ``out`` (1.0
    where no gradient reached it in ``out``); parameters whose reference is all zeros are left out."""
    rates = {}
    for n, g_ref in ref.items():
        nonzero = g_ref != 0
        total = int(nonzero.sum())
        if total:
            g = out.get(n)
            rates[n] = 1.0 if g is None else int(((g == 0) & nonzero).sum()) / total
    return rates


@dataclass
class TrainMetrics:
    """One config's run against the fp32 run from the same seed (all plain values)."""

    steps: int
    loss_deviation: list[float | None]  # |loss - fp32 loss| / |fp32 loss| per step
    max_loss_deviation: float
    grad_sqnr_db: float  # gradients at step 0
    param_sqnr_db: float  # final parameters
    underflow_rate: dict[str, float]  # per parameter: grads 0 here, nonzero in fp32, at step 0
    update_lost_rate: dict[str, float]  # per parameter: never changed here, changed in fp32
    update_ratio: float | None  # median over steps of |update| / |fp32 update|
    skipped: list[int]
    scales: list[float | None]
    first_nonfinite: tuple[int, str] | None
    grad_norms: list[float | None]
    fp32_grad_norms: list[float | None]
    losses: list[float]
    fp32_losses: list[float]
    step_time_s: float  # median wall time of a step, the first (warm-up) left out
    fp32_step_time_s: float

    def worst(self, rates: dict[str, float]) -> tuple[str, float]:
        name = max(rates, key=lambda n: (rates[n], n)) if rates else None
        return (name, rates[name]) if name is not None and rates[name] > 0 else ("-", 0.0)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["first_nonfinite"] = list(self.first_nonfinite) if self.first_nonfinite else None
        return d


def compare_trajectories(run: Trajectory, ref: Trajectory) -> TrainMetrics:
    dev = []
    for a, b in zip(run.losses, ref.losses):
        dev.append(abs(a - b) / abs(b) if math.isfinite(a) and b != 0 else (0.0 if a == b else math.inf))
    ref_grads = ref.grads.get(run.first_step, ref.grads0) if run.first_step is not None else {}
    underflow = underflow_rates(run.grads0, ref_grads)
    lost = {}
    for n, moved32 in ref.changed.items():
        total = int(moved32.sum())
        if total:
            lost[n] = int((~run.changed[n] & moved32).sum()) / total
    ratios = [a / b for a, b in zip(run.update_norms, ref.update_norms) if a is not None and b]
    ratio = float(torch.tensor(ratios).median()) if ratios else None
    finite = [d for d in dev if d is not None]
    return TrainMetrics(
        steps=len(run.losses), loss_deviation=dev, max_loss_deviation=max(finite) if finite else 0.0,
        grad_sqnr_db=tensors_sqnr_db(run.grads0, ref_grads), param_sqnr_db=tensors_sqnr_db(run.final, ref.final),
        underflow_rate=underflow, update_lost_rate=lost, update_ratio=ratio, skipped=run.skipped,
        scales=run.scales, first_nonfinite=run.first_nonfinite, grad_norms=run.grad_norms,
        fp32_grad_norms=ref.grad_norms, losses=run.losses, fp32_losses=ref.losses,
        step_time_s=_median_step(run), fp32_step_time_s=_median_step(ref))


def _median_step(t: Trajectory) -> float:
    times = t.step_times[1:] or t.step_times
    return float(torch.tensor(times).median()) if times else math.nan


def mantissa_eps(dtype: torch.dtype) -> float:
    return 2.0 ** -format_of(dtype).mantissa_bits
