"""A run of a training step under one config: a few steps from a seeded model, recording
what the suite judges (losses, the gradients the optimizer applies at every step, updates, loss
scales, skipped steps, the first non-finite value, step times, the optimizer's parameter groups)
into a ``trajectory.Trajectory``.

The gradients recorded are the ones ``optimizer.step()`` applies (``recorder.StepRecorder``), and a
step whose ``optimizer.step()`` never ran is a step the GradScaler skipped. The loss scale a step ran
with is the one the GradScaler that scaled its loss applied, the step's own scaler where it used one
(``loop_watch``); under a config that scales the loss, a step that no enabled GradScaler scaled
(``loss.backward()`` without ``scaler.scale``) ran at 1 and is listed in ``Trajectory.unscaled``,
since its numbers are those of a scaler stuck at 1. Its backward passes are counted (a loop's
micro-batches). The first step also records where each module ran (``module_dtypes``) and whether
the loss was computed in 16 bits (``loss_precision``). The float64 run of the same spec is
``float64``; a spec that does not repeat itself is refused before any run (``determinism``).

**Random draws replay.** A step that draws random numbers (dropout, a sampled mask) draws them from
torch's global generators. A run records their state at the start of every step
(``Trajectory.rng_states``), and a re-run of a step (the float64 step, the traced re-runs that
locate a first fault) starts from the state the run had there, inside ``torch.random.fork_rng``:
it draws the same masks as the run it explains, however many draws ran before it, and leaves the
caller's generators as they were.

**The master weights.** Every config starts from the model ``model_fn`` built, in float32: a model
built in another dtype (bfloat16 from a checkpoint, say) is cast to float32 once (exact from 16
bits; float64 is rounded), and each config casts those weights to its own parameter dtype, so the
fp32 reference, the AMP configs, pure bf16 and the float64 step all start from the same values.
``Trajectory.built_dtypes`` says which parameters were not float32 (``built_dtype_note`` words it).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from ..numerics.configs import tf32_flags
from ..numerics.global_state import guarded, leak_message
from ..numerics.promote import read_as_float64
from ..numerics.rng import RngState, forked_rng
from ..speed.timing import synchronized_perf_counter
from .batches import data_digest, map_tensors
from .configs import FLOAT64, TrainConfig
from .loop_watch import watch_loop
from .loss_precision import LossPrecisionWatch
from .fp8 import scaled_mm_fp8_linears
from .fp8_observed import observed_fp8_casts
from .module_dtypes import cast_then_as_built, keep_fp32_params, module_flags, parameters_to, record_module_dtypes
from .recipes import emulated_fp8_linears, stochastic_rounding_updates
from .recorder import StepRecorder, wide_dtype
from .spec import TrainSpec, takes_model
from .trajectory import Trajectory

__all__ = ["TrainingError", "GlobalStateError", "judged_state", "step_owner", "run_training", "prepare_training",
           "PreparedRun", "run_casting_buffers", "built_dtype_note", "built_dtypes",
           "ModelDtypeWarning"]


class TrainingError(Exception):
    """A target's model_fn, optimizer_fn, batch_fn or step raised; the message names which."""


class GlobalStateError(TrainingError):
    """A target's callable left process-wide state changed (``judged_state``); the state
    is restored and the message names the callable and the change."""


@contextlib.contextmanager
def judged_state(what: str, where: str = "", owner: str | None = None):
    """Around one call of a target's callable (``what``: "model_fn()", "step 0 (step_fn)"): torch's
    process-wide state (``numerics.global_state``: default dtype, grad mode, an entered autocast and
    its nesting, flush-denormal, deterministic algorithms, the TF32 and fp32-precision flags),
    snapshotted as the harness set it for the config, must be the same after. A change is
    restored at once (also when the callable raised) and raised as a GlobalStateError naming
    ``what`` and the change; ``owner`` is the callable the message tells to restore it (default:
    ``what`` up to its parenthesis). The random generators are neither judged nor restored: the
    harness seeds them, and a step's dropout draws advance them on purpose (``forked_rng`` and
    ``RngState.replayed`` put the caller's back around a run)."""
    with guarded(rng=False) as state:
        yield
    if state.changed:
        raise GlobalStateError(leak_message(f"{where + ': ' if where else ''}{what}", state.changed, "step and case",
                                            owner or what.partition("(")[0]))


def step_owner(spec: TrainSpec) -> tuple[str, str]:
    """The user code a step of ``spec`` runs, as a state change's message names it: (what the step
    is, the callable to fix): its ``step_fn``, else the standard step's ``loss_fn`` or model."""
    if spec.step_fn is not None:
        return "step_fn", "step_fn"
    if spec.loss_fn is not None:
        return "loss_fn, in the standard step", "loss_fn"
    return "the model, in the standard step", "the model"


class ModelDtypeWarning(UserWarning):
    """A target's model_fn built parameters in another dtype than float32: what the harness did with
    them, and what to do (``built_dtype_note``)."""


def _cast_batch(batch: Any, dtype: torch.dtype, device: str) -> Any:
    """Floating tensors in ``batch`` to ``dtype`` on ``device``; token ids and masks keep theirs."""
    return map_tensors(lambda t: t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device), batch)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters as fp32 CPU copies (float64 ones stay float64)."""
    return {n: p.detach().to(device="cpu", dtype=wide_dtype(p), copy=True) for n, p in model.named_parameters()}


def run_training(spec: TrainSpec, config: TrainConfig, device: str, where: str = "") -> Trajectory:
    """Run ``spec.steps`` steps of the spec under ``config``; records the trajectory, with the
    gradients of every step the optimizer ran (a run whose first steps the scaler skipped is
    compared with fp32 on the same batch). A run in float32's range and precision that trained
    nothing raises TrainingError (``_nothing_trained``): there no GradScaler skips a step and no
    gradient underflows, and every case runs fp32, its reference. A model that raises with its
    buffers in the config's dtype runs again with them as it built them (``run_casting_buffers``)."""
    t = run_casting_buffers(spec, config, device, where or f"train_step under {config.id}")
    full = config.compute_dtype in (torch.float32, torch.float64) and not config.loss_scaling
    if full and not any(bool(g.any()) for grads in t.grads.values() for g in grads.values()):
        _nothing_trained(t, spec, where or f"train_step under {config.id}")
    return t


def built_dtypes(model: nn.Module) -> dict[str, list[str]]:
    """The floating parameters of ``model`` not in float32, by dtype name (``{"bfloat16": [names]}``)."""
    out: dict[str, list[str]] = {}
    for n, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            out.setdefault(str(p.dtype).replace("torch.", ""), []).append(n)
    return out


def built_dtype_note(built: dict[str, list[str]], total: int | None = None) -> str | None:
    """What the harness did with a model built in another dtype than float32, and what to do, or
    None for a float32 model."""
    if not built:
        return None
    parts = []
    for dtype, names in sorted(built.items()):
        some = ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")
        parts.append(f"{dtype} ({len(names)}{'' if total is None else f' of {total}'} parameter tensors: {some})")
    exact = all(d in ("bfloat16", "float16") for d in built)
    how = "exact" if exact else "rounded once"
    return (f"model_fn() built the model in {', '.join(parts)}: every config starts from these weights cast to float32 "
            f"master weights ({how}; pure bf16 casts them to bfloat16, the float64 step to float64), so all configs "
            "and machines start from the same weights and its goldens stay comparable. The fp32 and amp-* rows train "
            "float32 from these values; a bf16 training of yours is the bf16 and bf16-sr rows. To start from a float32 "
            "initialisation, return the model in float32 (drop .to(torch.bfloat16) or torch_dtype=torch.bfloat16)")


def _known_cause(e: Exception) -> str:
    """What a step did to raise ``e``, where torch's own message does not say it."""
    if "No inf checks were recorded prior to update" in str(e):
        return ("; scaler.update() ran with no scaler.step(optimizer) before it, as when it is called per "
                "micro-batch or after optimizer.step(): call scaler.step(optimizer), then scaler.update(), once per "
                "optimizer step, after the last micro-batch's backward")
    if "Attempted unscale_ but _scale is None" in str(e):
        return ("; the loss's backward ran past the GradScaler: loss.backward() in place of scaler.scale(loss).backward() "
                "(in Lightning's manual optimisation, in place of self.manual_backward(loss))")
    return ""


def prepare_training(spec: TrainSpec, config: TrainConfig, device: str, where: str = "",
                     rng_state: RngState | None = None, buffers_as_built: bool = False,
                     around_step: tuple[int, Callable[[], ContextManager]] | None = None,
                     start_params: dict[str, torch.Tensor] | None = None) -> "PreparedRun":
    """Build the seeded model, optimizer and scaler now; calling the result runs the steps. The
    tracer and the audit trace only that call, not the model's construction. The steps start from
    ``rng_state`` (default: the generators' state once the model and optimizer are built, the state
    every run of the spec starts its first step from), inside ``fork_rng``: each call draws the same
    random numbers, and neither the construction nor the call moves the caller's generators.

    The float64 step (``FLOAT64``) runs its steps inside ``numerics.promote.read_as_float64``: the
    model's own float32 (``h.float()`` for a head kept in float32, a mask made with
    ``dtype=torch.float32`` or the default dtype) is read as float64 there, so a model that upcasts on
    purpose runs exactly instead of meeting a float32 tensor with float64 parameters.
    ``buffers_as_built`` casts only the parameters to the config's dtype (``run_casting_buffers``
    retries so for a model whose code needs its buffers in the dtype it built them in).

    Re-running a step that failed: ``around_step=(k, context)`` runs step ``k`` alone inside
    ``context()`` (a tracer: the steps before it run as they did, outside it, on every thread autograd
    uses) and keeps the parameters it started from (``PreparedRun.around_step_params``);
    ``start_params`` replaces the built model's parameters (cast to the config's dtype) before the
    optimizer is built."""
    where = where or f"train_step under {config.id}"
    if config.ddp_hook is not None or config.fsdp is not None:
        raise ValueError(f"{config.id} is a {'DDP' if config.ddp_hook else 'FSDP2'} comparison (training.distributed, "
                         "training.fsdp), not a run of run_training")
    return PreparedRun(spec, config, device, where, rng_state, buffers_as_built, around_step, start_params)


class PreparedRun:
    """A seeded model, optimizer and scaler, built; ``run()`` (or calling it) runs the steps once."""

    def __init__(self, spec: TrainSpec, config: TrainConfig, device: str, where: str,
                 rng_state: RngState | None, buffers_as_built: bool,
                 around_step: tuple[int, Callable[[], ContextManager]] | None = None,
                 start_params: dict[str, torch.Tensor] | None = None):
        self.spec, self.config, self.device, self.where = spec, config, device, where
        self.around_step, self.around_step_params = around_step, None
        self.step_shown, self.step_owner = step_owner(spec)
        with forked_rng(device):
            torch.manual_seed(spec.seed)
            model = self._call("model_fn()", spec.model_fn)
            if not isinstance(model, nn.Module):
                raise TrainingError(f"{where}: model_fn() returned {type(model).__name__}, expected an nn.Module")
            built = built_dtypes(model)
            if built:  # the float32 master weights every config starts from (the module docstring)
                model = model.to(dtype=torch.float32)
            if buffers_as_built:
                model = model.to(device=device)
                parameters_to(model, config.param_dtype)
            else:
                model = model.to(device=device, dtype=config.param_dtype)
            if spec.keep_fp32 and config.param_dtype in (torch.float16, torch.bfloat16):
                keep_fp32_params(model, spec.keep_fp32)  # as the repository keeps them (training.module_dtypes)
            model.train()
            if config.own_fp8:
                model = self._own_fp8(model)
            if start_params is not None:
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(start_params[n])
            self.model = model
            self.optimizer = self._call("optimizer_fn(model)" if takes_model(spec.optimizer_fn) else
                                        "optimizer_fn(params)", spec.make_optimizer, model)
            if not isinstance(self.optimizer, torch.optim.Optimizer):
                raise TrainingError(f"{where}: optimizer_fn returned {type(self.optimizer).__name__}, expected a "
                                    "torch.optim.Optimizer")
            self.scaler = torch.amp.GradScaler(device, enabled=config.loss_scaling)
            self.rng_start = rng_state if rng_state is not None else RngState.capture(device)
        self.step_fn = spec.step()
        names = {p: n for n, p in model.named_parameters()}
        self.trajectory = Trajectory(config=config.id, initial=_snapshot(model), built_dtypes=built,
                                     groups=[[names[p] for p in g["params"] if p in names]
                                             for g in self.optimizer.param_groups])
        self.recorder = StepRecorder(names, self.trajectory)

    def _call(self, what: str, fn, *a, step: bool = False):
        # every call of the user's code: snapshotted inside the harness's contexts (the config's
        # TF32 flags, the fp8 and stochastic-rounding recipes), so only the callable's change is judged
        where = self.where
        try:
            with (judged_state(f"{what} ({self.step_shown})", where, self.step_owner) if step else
                  judged_state(what, where)):
                return fn(*a)
        except torch.OutOfMemoryError as e:
            raise TrainingError(f"{where}: {what} ran out of memory ({e})") from e
        except TrainingError:
            raise
        except Exception as e:
            raise TrainingError(f"{where}: {what} raised {type(e).__name__}: {e}{_known_cause(e)}") from e

    def _own_fp8(self, model: nn.Module) -> nn.Module:
        """The spec's own fp8 conversion applied (``TrainSpec(fp8=...)``); its parameters must keep
        their names, which the comparison with fp32 goes by."""
        if self.spec.fp8 is None:
            raise TrainingError(f"{self.where}: {self.config.id} runs the spec's own fp8 conversion, and the TrainSpec "
                                "declares none (fp8=)")
        names = [n for n, _ in model.named_parameters()]
        converted = self._call("fp8(model)", self.spec.fp8, model)
        model = converted if isinstance(converted, nn.Module) else model
        after = [n for n, _ in model.named_parameters()]
        if after != names:
            gone, new = sorted(set(names) - set(after)), sorted(set(after) - set(names))
            raise TrainingError(f"{self.where}: fp8(model) renamed the model's parameters (gone: {', '.join(gone[:3]) or '-'}; "
                                f"new: {', '.join(new[:3]) or '-'}): its steps cannot be compared with fp32's by name; "
                                "swap modules keeping their parameters (as convert_to_float8_training does)")
        return model

    def _timed_step(self, *a):  # the step's time, without the state's snapshots around it
        start = synchronized_perf_counter()
        loss = self.step_fn(*a)
        self.trajectory.step_times.append(synchronized_perf_counter() - start)
        return loss

    def _recipes(self, stack: contextlib.ExitStack) -> None:
        """The config's numerics around the steps: stochastic rounding, fp8, TF32, float64's reading."""
        config, t, spec, where = self.config, self.trajectory, self.spec, self.where
        if config.stochastic_rounding:
            stack.enter_context(stochastic_rounding_updates(self.optimizer, spec.seed + 1))
        if config.own_fp8:
            t.fp8 = stack.enter_context(observed_fp8_casts(self.model))
        elif config.float8 is not None:
            t.fp8 = stack.enter_context(scaled_mm_fp8_linears(self.model, config.float8, keep_fp32=spec.keep_fp32))
            if not t.fp8.linears:
                raise TrainingError(f"{where}: the model has no nn.Linear layer for {config.id} to run in fp8")
        elif config.fp8:
            if stack.enter_context(emulated_fp8_linears(self.model, spec.keep_fp32)) == 0:
                raise TrainingError(f"{where}: the model has no nn.Linear layer for the fp8 emulation to replace")
        if self.device == "cuda":
            stack.enter_context(tf32_flags(config.tf32))
        if config is FLOAT64:  # the model's float32 is its full precision: exact here
            stack.enter_context(read_as_float64())

    def __call__(self) -> Trajectory:
        return self.run()

    def run(self) -> Trajectory:
        spec, config, device, t, rec = self.spec, self.config, self.device, self.trajectory, self.recorder
        changed = {n: torch.zeros(p.shape, dtype=torch.bool) for n, p in t.initial.items()}
        previous = t.initial
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.rng_start.replayed())
            stack.enter_context(rec.watching(self.optimizer))  # first: sees the grads before the SR hook casts them
            loop = stack.enter_context(watch_loop(self.model))
            self._recipes(stack)
            autocast = config.autocast(device)
            for i in range(spec.steps):
                around = self.around_step is not None and i == self.around_step[0]
                if around:
                    self.around_step_params = previous
                with self.around_step[1]() if around else contextlib.nullcontext():
                    previous = self._step(i, loop, autocast, previous, changed)
        if config.own_fp8 and t.fp8 is not None and not t.fp8.tensors:
            raise TrainingError(f"{self.where}: the spec's fp8(model) conversion ran, and no cast to a float8 dtype ran in "
                                f"{spec.steps} steps: nothing of the model ran in fp8 to judge")
        t.grads0, t.first_step = rec.first_grads, rec.first_step
        t.final, t.changed = previous, changed
        return t

    def _step(self, i: int, loop, autocast, previous: dict[str, torch.Tensor],
              changed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Step ``i``, recorded; returns the parameters after it."""
        spec, config, device, t, rec = self.spec, self.config, self.device, self.trajectory, self.recorder
        t.rng_states.append(RngState.capture(device))
        raw = self._call(f"batch_fn({i})", spec.batch_fn, i)
        t.batch_digests.append(data_digest(raw))
        batch = _cast_batch(raw, config.param_dtype, device)
        rec.start_step(i)
        loop.start_step()
        with record_module_dtypes(self.model) if i == 0 else contextlib.nullcontext() as modules, \
                LossPrecisionWatch() if i == 0 and config is not FLOAT64 else contextlib.nullcontext() as loss_watch:
            loss = self._call(f"step {i}", self._timed_step, self.model, self.optimizer, self.scaler, batch,
                              autocast, step=True)
        if modules is not None:
            t.modules, t.low_precision_loss = modules, loss_watch.found if loss_watch is not None else None
            t.module_failures, t.module_notes = module_flags(modules, config.autocast_dtype,
                                                             config.param_dtype, spec.keep_fp32)
        self._record_loop(i, loop)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TrainingError(f"{self.where}: step {i} returned {type(loss).__name__}; step_fn must return "
                                "the loss")
        value = float(loss.detach().float())
        t.losses.append(value)
        t.scales.append(loop.scale_after() if loop.scaler is not None else t.scales_used[-1])
        ran = rec.applied is not None
        if not ran:
            t.skipped.append(i)
        if t.first_nonfinite is None:
            if not math.isfinite(value):
                t.first_nonfinite = (i, "loss")
            elif ran and rec.nonfinite is not None:
                t.first_nonfinite = (i, f"gradient of {rec.nonfinite}")
        t.grad_norms.append(rec.norm if ran else None)
        now = _snapshot(self.model)
        t.update_norms.append(float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(now[n] - previous[n]) for n in now]))) if ran else None)
        if ran and not t.after_first:
            t.after_first = now
        for n in now:
            changed[n] |= now[n] != previous[n]
        return now

    def _record_loop(self, i: int, loop) -> None:
        """What the step's loop did (``loop_watch``): the loss scale it ran with, its backward passes,
        optimizer steps, unscales, scalers and clips. Under a loss-scaling config a step that scaled
        nothing ran at 1, as a scaler stuck at 1 would."""
        t = self.trajectory
        if loop.scaler is None and self.config.loss_scaling:
            t.unscaled.append(i)
        t.scales_used.append(loop.scale if loop.scaler is not None else (1.0 if self.config.loss_scaling else None))
        t.backward_passes.append(loop.backward_passes)
        t.optimizer_steps.append(self.recorder.calls)
        t.unscales.append(loop.unscales)
        t.scalers.append(len(loop.scalers))
        t.clips.append(list(loop.clips))


def _nothing_trained(t: Trajectory, spec: TrainSpec, where: str) -> None:
    """A float32 run where no step applied a nonzero gradient: a step that never steps, never
    backpropagates or zeroes its loss trains nothing, and every config would agree with its fp32
    run, so every case would pass. Raised as the target's error, naming what the step left out and
    the user code to fix (``step_owner``)."""
    _, fix = step_owner(spec)
    steps = spec.steps
    applied = [i for i in range(steps) if i not in t.skipped]
    if not applied:
        raise TrainingError(f"{where}: optimizer.step() never ran in the {steps} step(s), in float32 where no "
                            f"GradScaler skips a step: nothing was trained, so nothing can be judged; {fix} must "
                            "call optimizer.step() (or scaler.step(optimizer)) once per step, on the optimizer it is "
                            "given (the one optimizer_fn built)")
    if not any(t.grads.values()):
        raise TrainingError(f"{where}: no parameter had a gradient when optimizer.step() ran ({len(applied)} of the "
                            f"{steps} step(s)): nothing was trained, so nothing can be judged; {fix} must "
                            "backpropagate its loss (scaler.scale(loss).backward()) before optimizer.step()")
    raise TrainingError(f"{where}: every gradient optimizer.step() saw in the {len(applied)} step(s) it ran was exactly "
                        f"0: nothing was trained, so nothing can be judged (a loss in {fix} that does not depend on "
                        "the parameters, or multiplied by 0)")


def run_casting_buffers(spec: TrainSpec, config: TrainConfig, device: str, where: str,
                        rng_state: RngState | None = None) -> Trajectory:
    """``spec`` run under ``config`` with its parameters and floating buffers cast to the config's
    parameter dtype, and where that raises, the parameters alone, its buffers in the dtypes the model
    built them in (``module_dtypes.cast_then_as_built``; pure bf16 and the float64 step cast, float32
    configs cast nothing). Raises the first try's TrainingError, the second's beside it, when neither
    runs; a change of torch's state (GlobalStateError) is raised at once."""
    if config.param_dtype == torch.float32:
        return prepare_training(spec, config, device, where, rng_state)()
    try:
        return cast_then_as_built(lambda as_built: prepare_training(spec, config, device, where, rng_state,
                                                                    buffers_as_built=as_built)(),
                                  passes=(GlobalStateError,))
    except TrainingError as first:
        second = getattr(first, "as_built_error", None)
        if not isinstance(second, TrainingError):
            raise

        def cause(e):  # the message without the ``where`` both share
            text = str(e)
            return text[len(where) + 2:] if text.startswith(where + ": ") else text
        if cause(second) == cause(first):
            raise first from first.__cause__
        raise TrainingError(f"{first}; with its buffers kept in the dtypes model_fn built them in: "
                            f"{cause(second)}") from first.__cause__
