"""A PyTorch Lightning ``LightningModule`` as a ``train_step`` target: its own ``training_step``,
``configure_optimizers`` and hooks, with the ``Trainer`` options that change numerics, under every
training config.

    spec = lightning_spec(LitModel, batches, steps=4, precision="bf16-mixed", accumulate_grad_batches=2,
                          gradient_clip_val=1.0, gradient_clip_algorithm="norm")
    pytest_precision.register("lit", spec, kind="train_step")

**One harness step is one optimizer step of Lightning's loop** (``loops``, 2.6), driven here
with Lightning's own objects: a ``Trainer`` built from the keyword arguments (accumulation,
clipping and its algorithm, callbacks), its strategy, precision plugin and ``LightningOptimizer``.
A run starts as ``fit`` does: ``setup``, ``configure_model`` (which must build no parameters: the
harness casts and snapshots the module ``module_fn()`` returns), ``configure_optimizers``,
``on_fit_start``, ``on_train_start``, ``on_train_epoch_start``. Automatic optimisation then runs,
per micro-batch, ``on_train_batch_start``, ``training_step`` in the precision plugin's context,
``zero_grad`` (with ``on_before_zero_grad``) on a window's first micro-batch, the loss divided by
``accumulate_grad_batches``, the strategy's ``backward`` (the module's ``backward`` hook, the
plugin's scaling, ``on_before_backward``/``on_after_backward``), ``on_train_batch_end`` with the
outputs Lightning gives it; the last micro-batch's step runs inside the module's ``optimizer_step``
hook as its closure, where the precision plugin unscales, calls ``on_before_optimizer_step`` and the
module's ``configure_gradient_clipping`` (default: clip to ``gradient_clip_val`` by
``gradient_clip_algorithm``), and steps and updates its scaler; ``global_step`` counts the steps
completed. Then the ``"step"`` schedulers step at Lightning's frequency (``batch_idx + 1``);
plateau schedulers, which step on a monitored metric, and ``"epoch"`` ones (a harness run is inside
one epoch) do not. Manual optimisation (``automatic_optimization = False``) runs ``training_step``
once per step, where the module calls ``self.optimizers()``, ``manual_backward``, ``opt.step()``
and its schedulers itself, through the same plugin. ``self.log`` works and is kept nowhere;
checkpoint, progress-bar and summary callbacks are left out (files and lines, not numerics).
``tests/test_training_lightning.py`` runs a real ``Trainer(...).fit`` beside it on the same module
and batches and gets the same parameters, bit for bit. A module of the ``lightning`` package
(``lightning.pytorch``) runs with that package's objects, one of ``pytorch_lightning`` with its.

**The config decides the precision.** Each config runs the plugin Lightning builds for it:
``amp-bf16`` ``MixedPrecision("bf16-mixed")``, ``amp-fp16`` ``MixedPrecision("16-mixed")`` with
the harness's GradScaler (disabled under ``amp-fp16-noscale``), every other config Lightning's
``Precision()`` on the model the harness cast (pure bf16, fp8, the float64 step). ``precision=``
names the config the repository ships (``"bf16-mixed"`` is ``amp-bf16``): the training summary
marks that row ``(shipped)`` (``TrainSpec.ships``).

**Data.** ``batches`` is what the repository's ``DataLoader`` yields, in order (a list, or the
loader itself, read once): harness step ``i`` takes micro-batches ``i N`` to ``i N + N - 1`` of it
(N = ``accumulate_grad_batches``), wrapping around, as ``MicroBatches``, so the accumulation
verdict splits a step into its micro-batches. Outside the loop (the careful-loop peer, the DDP
cases) a step's loss is the mean of its micro-batches' ``training_step`` losses; a module that
steps its own optimizer in ``training_step`` has none, and those comparisons say so. In the DDP and
FSDP2 cases the step runs through the wrapper, as Lightning's strategies run it: the wrapped
module's ``forward`` is its ``training_step`` for that one call, and ``self(x)`` inside reaches
its own ``forward``.

PyTorch Lightning is imported when a run starts, not with this module (the ``lightning`` extra).

Caught on a first run (``tests/lit_modules.py``): ``zero_grad()`` in ``on_train_batch_start``, in
every config; clipping in ``on_after_backward``, per micro-batch and before the plugin unscales
(amp-fp16); a ``configure_gradient_clipping`` that divides by the loss scale again; ``loss.backward()``
in place of ``self.manual_backward(loss)``. Lightning's own ``self.clip_gradients`` in manual
optimisation under ``16-mixed`` clips the gradients still scaled, and the harness says so. Modules of
``lightning.pytorch`` run unverified here (only ``pytorch_lightning`` is installed in this project's
environment).
"""
from __future__ import annotations

import contextlib
import importlib
import itertools
import logging
import math
import warnings
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import nn

from .batches import MicroBatches
from .spec import LossContractError, TrainSpec
from .run import GlobalStateError

__all__ = ["lightning_spec", "lightning_loss", "PRECISION_CONFIGS"]

# Lightning's precision= -> the harness config that runs it
PRECISION_CONFIGS = {"32-true": "fp32", "32": "fp32", 32: "fp32", "bf16-mixed": "amp-bf16", "bf16": "amp-bf16",
                     "16-mixed": "amp-fp16", "16": "amp-fp16", 16: "amp-fp16", "bf16-true": "bf16"}
# what lightning_spec sets on the Trainer itself; a repository's value for them is not its numerics
_SET_HERE = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
             "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0}
_NOT_NUMERICS = {"max_steps", "max_epochs", "min_steps", "min_epochs", "max_time", "limit_train_batches",
                 "limit_val_batches", "val_check_interval", "check_val_every_n_epoch", "log_every_n_steps",
                 "default_root_dir", "enable_checkpointing", "enable_progress_bar", "enable_model_summary", "logger",
                 "num_sanity_val_steps", "accelerator", "devices", "strategy", "num_nodes", "profiler", "fast_dev_run",
                 "deterministic", "benchmark", "inference_mode", "use_distributed_sampler", "reload_dataloaders_every_n_epochs",
                 "detect_anomaly", "barebones", "sync_batchnorm", "overfit_batches", "precision"}


def _require_lightning() -> None:
    if importlib.util.find_spec("pytorch_lightning") is None and importlib.util.find_spec("lightning") is None:
        raise ImportError("lightning_spec needs PyTorch Lightning (pip install 'pytest-precision[lightning]', or the "
                          "lightning package)")


def _lightning_of(module: nn.Module):
    """The package the module's ``LightningModule`` comes from: ``pytorch_lightning`` or
    ``lightning.pytorch`` (two packages with classes of their own); None for another module."""
    for cls in type(module).__mro__:
        if cls.__name__ == "LightningModule" and ".core" in cls.__module__:
            return importlib.import_module(cls.__module__.split(".core")[0])
    return None


@contextlib.contextmanager
def _quiet():
    """Lightning's advice about a CPU run, workers and logging, which says nothing about numerics
    (its warnings, and the lines its loggers print when a Trainer is built)."""
    loggers = [logging.getLogger(name) for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"(pytorch_)?lightning.*")
        warnings.filterwarnings("ignore", message=r".*self\.log\(\).*")
        for lg in loggers:
            lg.setLevel(logging.WARNING)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


class _LoopRun:
    """One harness run's Trainer around its module: built with the optimizer (``optimizer_fn``), its
    precision plugin set at the first step (when the config's precision is known)."""

    def __init__(self, pl, module, trainer_kwargs: dict):
        self.pl, self.module = pl, module
        call = _import(pl, "trainer.call")
        skipped = tuple(getattr(pl.callbacks, c) for c in ("Checkpoint", "ProgressBar", "ModelSummary"))
        callbacks = trainer_kwargs.get("callbacks") or []
        callbacks = [c for c in (callbacks if isinstance(callbacks, list) else [callbacks])
                     if not isinstance(c, skipped)]  # no files, no progress lines: not numerics
        with _quiet():
            self.trainer = pl.Trainer(**{**trainer_kwargs, "callbacks": callbacks, **_SET_HERE})
        trainer = self.trainer
        trainer.strategy.connect(module)
        module.trainer = trainer
        trainer.state.fn, trainer.state.stage = "fit", "train"
        built = [n for n, _ in module.named_parameters()]
        with _quiet():
            # fit's hooks before the first batch: setup and configure_model, the optimizers, the starts
            call._call_callback_hooks(trainer, "setup", stage="fit")
            call._call_lightning_module_hook(trainer, "setup", stage="fit")
            call._call_lightning_module_hook(trainer, "configure_model")
            if [n for n, _ in module.named_parameters()] != built:
                raise ValueError("lightning_spec: setup() or configure_model() built parameters the module did not have: "
                                 "the harness casts and snapshots the module module_fn() returns, so build its layers in "
                                 "__init__")
            optimizers, schedulers = _import(pl, "core.optimizer")._init_optimizers_and_lr_schedulers(module)
            if len(optimizers) != 1:
                raise ValueError(f"lightning_spec: configure_optimizers returned {len(optimizers)} optimizers; a "
                                 "train_step case watches one")
            trainer.strategy.optimizers = optimizers
            trainer.strategy.lr_scheduler_configs = schedulers
            for hook in ("on_fit_start", "on_train_start", "on_train_epoch_start"):
                call._call_callback_hooks(trainer, hook)
                call._call_lightning_module_hook(trainer, hook)
        # a plateau scheduler steps on a monitored metric, which a harness run does not log; said in the docstring
        self.schedulers = [c for c in schedulers if c.interval == "step" and not c.reduce_on_plateau]
        self.optimizer = optimizers[0]
        self.prepared = False
        self.batches = 0  # micro-batches run (Lightning's batch_idx)

    def prepare(self, autocast: Callable, scaler: torch.amp.GradScaler) -> None:
        """The precision plugin Lightning builds for the config's precision (the module docstring)."""
        precision = _import(self.pl, "plugins.precision")
        ctx = autocast()
        dtype = ctx.fast_dtype if isinstance(ctx, torch.autocast) else None
        device = next(self.module.parameters()).device.type
        params = next(self.module.parameters()).dtype
        if dtype == torch.bfloat16:
            plugin = precision.MixedPrecision("bf16-mixed", device)
        elif dtype == torch.float16:
            plugin = precision.MixedPrecision("16-mixed", device, scaler=scaler)
        elif dtype is None and params in (torch.bfloat16, torch.float16):
            # pure 16 bits as Lightning's "bf16-true" runs it: the default dtype is the parameters' inside
            # the step, so a mask the model builds with torch.full matches them
            plugin = precision.HalfPrecision("bf16-true" if params == torch.bfloat16 else "16-true")
        elif dtype is None and params == torch.float64:
            plugin = precision.DoublePrecision()  # the float64 step: "64-true"
        elif dtype is None:
            plugin = precision.Precision()
        else:
            raise ValueError(f"lightning_spec: Lightning has no mixed precision for autocast {dtype}")
        self.trainer.strategy.precision_plugin = plugin
        self.prepared = True

    def step(self, batch: list, autocast: Callable, scaler: torch.amp.GradScaler):
        if not self.prepared:
            self.prepare(autocast, scaler)
        module, trainer = self.module, self.trainer
        lightning_optimizer = trainer.strategy._lightning_optimizers[0]
        loop = trainer.fit_loop.epoch_loop
        with _quiet():
            if not module.automatic_optimization:
                # the manual loop counts the optimizer's steps (global_step) as Lightning's does
                progress = loop.manual_optimization.optim_step_progress
                lightning_optimizer._on_before_step = progress.increment_ready
                lightning_optimizer._on_after_step = progress.increment_completed
                outs = [self._training_step(mb, self.batches + j) for j, mb in enumerate(batch)]
                loss = _loss_of(outs[-1])
            else:
                loss = self._automatic(batch, self.batches, lightning_optimizer,
                                       loop.automatic_optimization.optim_progress.optimizer.step)
                self._update_schedulers(self.batches + len(batch) - 1)
        self.batches += len(batch)
        return loss

    def _training_step(self, micro_batch, batch_idx, step=None):
        """``on_train_batch_start``, the training step (``step``, default the strategy's, in the precision
        plugin's context), ``on_train_batch_end`` with the outputs Lightning hands it: the hooks around
        each batch, the module's and the callbacks'."""
        call = _import(self.pl, "trainer.call")
        trainer = self.trainer
        call._call_callback_hooks(trainer, "on_train_batch_start", micro_batch, batch_idx)
        call._call_lightning_module_hook(trainer, "on_train_batch_start", micro_batch, batch_idx)
        out = (step or (lambda: call._call_strategy_hook(trainer, "training_step", micro_batch, batch_idx)))()
        outputs = _batch_outputs(out)
        call._call_callback_hooks(trainer, "on_train_batch_end", outputs, micro_batch, batch_idx)
        call._call_lightning_module_hook(trainer, "on_train_batch_end", outputs, micro_batch, batch_idx)
        return out

    def _automatic(self, batch: list, first: int, optimizer, progress) -> torch.Tensor:
        call = _import(self.pl, "trainer.call")
        trainer, n = self.trainer, len(batch)
        total = []

        def closure_for(j, micro_batch):
            def closure():  # Lightning's Closure: the step, zero_grad on a window's first batch, backward
                out = call._call_strategy_hook(trainer, "training_step", micro_batch, first + j)
                loss = _loss_of(out)
                if j == 0:
                    call._call_callback_hooks(trainer, "on_before_zero_grad", optimizer)
                    call._call_lightning_module_hook(trainer, "on_before_zero_grad", optimizer)
                    call._call_lightning_module_hook(trainer, "optimizer_zero_grad", trainer.current_epoch,
                                                     first + j, optimizer)
                if loss is None:  # Lightning skips the backward of a step that returned None
                    return None
                loss = loss / n
                call._call_strategy_hook(trainer, "backward", loss, optimizer)
                total.append(loss.detach())
                result[j] = {**(out if isinstance(out, dict) else {}), "loss": loss.detach()}
                return loss
            return closure
        result: dict[int, dict] = {}

        def stepped(j, micro_batch):  # the last micro-batch: its closure runs inside the optimizer step
            progress.increment_ready()
            call._call_lightning_module_hook(trainer, "optimizer_step", trainer.current_epoch, first + j, optimizer,
                                             closure_for(j, micro_batch))
            progress.increment_completed()  # global_step: the optimizer steps completed
            return result.get(j)
        for j, micro_batch in enumerate(batch):
            if j < n - 1:
                closure = closure_for(j, micro_batch)
                self._training_step(micro_batch, first + j, lambda c=closure, j=j: (c(), result.get(j))[1])
            else:
                self._training_step(micro_batch, first + j, lambda j=j, mb=micro_batch: stepped(j, mb))
        return sum(total) if total else torch.tensor(math.nan)

    def _update_schedulers(self, batch_idx: int) -> None:
        """The "step" schedulers after an optimizer step, as Lightning's loop counts their frequency
        (by batch_idx + 1, micro-batches included)."""
        for config in self.schedulers:
            if (batch_idx + 1) % config.frequency == 0:
                config.scheduler.step()


def _batch_outputs(out: Any) -> Any:
    """What ``on_train_batch_end`` receives: a dict with the (divided) loss, as Lightning's loops pass it."""
    if isinstance(out, torch.Tensor):
        return {"loss": out.detach()}
    return out


def _import(pl, name: str):
    """``pl``'s submodule ``name`` (``pytorch_lightning`` or ``lightning.pytorch``, whichever the module is of)."""
    return importlib.import_module(f"{pl.__name__}.{name}")


def _loss_of(out: Any) -> torch.Tensor | None:
    """The loss a ``training_step`` returned: a tensor, a dict's ``"loss"``, or None."""
    if out is None or isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) and "loss" in out:
        return out["loss"]
    raise TypeError(f"training_step returned {type(out).__name__}: Lightning takes a loss tensor, a dict with a "
                    "\"loss\" key, or None")


def lightning_spec(module_fn: Callable[[], nn.Module], batches: Any, steps: int = 4, seed: int = 0,
                   keep_fp32: tuple[str, ...] | str = (), seeds: int = 1, **trainer_kwargs) -> TrainSpec:
    """A ``TrainSpec`` whose step is Lightning's loop around the module ``module_fn()`` builds (the
    module docstring). ``batches``: what the DataLoader yields, in order (a loader is read for the
    steps' micro-batches only); ``trainer_kwargs``: the repository's ``Trainer`` arguments
    (``precision`` names the shipped config; accumulation, clipping and callbacks are run; those that
    do not change numerics, as ``max_epochs``, are left out, and so are checkpoint, progress-bar and
    summary callbacks)."""
    _require_lightning()
    precision = trainer_kwargs.pop("precision", "32-true")
    ships = PRECISION_CONFIGS.get(precision)  # a precision with no harness config ("16-true"): no row marked
    kwargs = {k: v for k, v in trainer_kwargs.items() if k not in _NOT_NUMERICS}
    accumulate = int(kwargs.get("accumulate_grad_batches", 1))
    if isinstance(batches, Sequence) and not isinstance(batches, (str, bytes)):
        data = list(batches)
    else:  # a DataLoader: the micro-batches the steps take, in its order
        data = list(itertools.islice(iter(batches), steps * accumulate))
    if not data:
        raise ValueError("lightning_spec: batches is empty")

    def optimizer_fn(model):
        pl = _lightning_of(model)
        if pl is None:
            raise TypeError(f"lightning_spec: module_fn() returned {type(model).__name__}, expected a LightningModule")
        if not model.automatic_optimization and accumulate != 1:
            raise ValueError("lightning_spec: accumulate_grad_batches with manual optimisation (Lightning refuses it: "
                             "accumulate in training_step)")
        run = _LoopRun(pl, model, kwargs)
        # the run rides on its optimizer (no table of runs keeps a model, its Trainer and optimizer alive)
        run.optimizer._precision_lightning_run = run
        return run.optimizer

    def batch_fn(i: int) -> MicroBatches:
        return MicroBatches(data[(i * accumulate + m) % len(data)] for m in range(accumulate))

    def step_fn(model, optimizer, scaler, batch, autocast):
        return optimizer._precision_lightning_run.step(batch, autocast, scaler)

    # module_fn and lightning_loss by name: the DDP and FSDP ranks import them
    return TrainSpec(module_fn, optimizer_fn, batch_fn, steps=steps, step_fn=step_fn, seed=seed,
                     loss_fn=lightning_loss, keep_fp32=keep_fp32, seeds=seeds, ships=ships)


def lightning_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """A ``lightning_spec`` step's loss outside Lightning's loop (the careful-loop peer, the DDP and
    FSDP cases): the mean of its micro-batches' ``training_step`` losses. A module that steps its own
    optimizer has none (LossContractError: those comparisons say so)."""
    if not getattr(model, "automatic_optimization", True):
        raise LossContractError("the module steps its own optimizer in training_step (manual optimisation): it has no "
                                "loss to run outside Lightning's loop")
    parts = batch if isinstance(batch, list) else [batch]
    wrapped = model is not getattr(model, "module", model) or _fully_sharded(model)
    routing = _forward_as_training_step(model) if wrapped else contextlib.nullcontext(model)
    with _quiet(), _default_dtype(_true_precision_dtype(model)), routing as inner, _logging_as_training_step(inner):
        # through the wrapper where there is one (DDP, FSDP2), else the step itself (no forward hooks of the root)
        losses = [_loss_of(model(mb, k) if wrapped else inner.training_step(mb, k)) for k, mb in enumerate(parts)]
    return torch.stack(losses).mean()


def _true_precision_dtype(model: nn.Module) -> torch.dtype | None:
    """The default dtype Lightning's "true" precision plugins (HalfPrecision, DoublePrecision, FSDP's
    "bf16-true") set inside a step, so that a mask or position table the model builds matches its
    parameters: their dtype in a pure 16-bit or float64 run, FSDP2's ``param_dtype``; None under
    autocast (Lightning's "-mixed" plugins leave float32 the default) or in float32."""
    if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
        return None
    if _fully_sharded(model):
        state = model._get_fsdp_state() if hasattr(model, "_get_fsdp_state") else None
        dtype = getattr(getattr(state, "_mp_policy", None), "param_dtype", None)
    else:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return dtype if dtype in (torch.bfloat16, torch.float16, torch.float64) else None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None):
    """``dtype`` as torch's default inside (None: left as it is), the one before restored after; a
    step that changed the default itself is named (GlobalStateError), as the harness's state check
    names it around every callable, not repaired in silence."""
    before = torch.get_default_dtype()
    inside = dtype or before
    torch.set_default_dtype(inside)
    try:
        yield
    finally:
        left = torch.get_default_dtype()
        torch.set_default_dtype(before)
    if left != inside:
        raise GlobalStateError(f"the LightningModule's training_step left torch's default dtype {left} (it ran with "
                               f"{inside}): restored; set it back inside the step, or not at all")


def _fully_sharded(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def _forward_as_training_step(model: nn.Module):
    """The module's ``forward`` routed to its ``training_step``, as Lightning's strategies wrap a module
    for DDP and FSDP: a call through the wrapper (DDP's forward, FSDP2's pre-forward unshard) runs
    the training step, where ``self(x)`` reaches the module's own forward. Yields the LightningModule."""
    inner = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    own = inner.__dict__.get("forward")

    def restore():
        if own is None:
            inner.__dict__.pop("forward", None)
        else:
            inner.forward = own

    def routed(*args, **kwargs):
        restore()  # the step's own self(x) calls the module's forward
        try:
            return inner.training_step(*args, **kwargs)
        finally:
            inner.forward = routed
    inner.forward = routed
    try:
        yield inner
    finally:
        restore()


@contextlib.contextmanager
def _logging_as_training_step(module):
    """``self.log`` inside ``training_step`` called outside the loop: as the loop's own call (kept nowhere)."""
    previous = module._current_fx_name
    module._current_fx_name = "training_step"
    try:
        yield
    finally:
        module._current_fx_name = previous
