"""A Hugging Face ``Trainer`` as a ``train_step`` target: the repository's own ``TrainingArguments``
and Trainer (subclass) run under every training config, stepped by the Trainer's own code.

    spec = trainer_spec(model_fn, TrainingArguments(output_dir=..., max_grad_norm=1.0,
                                                    gradient_accumulation_steps=2, bf16=True),
                        train_dataset, data_collator=None, steps=4)
    pytest_precision.register("my_trainer", spec, kind="train_step")

**One harness step is one optimizer step of the Trainer**, the body of its training loop
(``Trainer._run_epoch``, transformers 5): ``get_batch_samples`` (the tokens that normalise the loss
under accumulation), for each micro-batch ``training_step`` (forward under the accelerator's
autocast, the loss divided as the Trainer divides it, ``accelerator.backward`` through its
GradScaler), then ``_clip_grad_norm`` (``accelerator.clip_grad_norm_``: unscale, then clip to
``max_grad_norm``), ``optimizer.step()`` (accelerate's ``AcceleratedOptimizer``: the scaler's step
and update), the learning-rate scheduler unless the scaler skipped the step, ``zero_grad``. The
optimizer and scheduler are the Trainer's (``create_optimizer``, ``create_scheduler`` from the
arguments, over ``steps``); a Trainer subclass (``trainer_cls``) runs its own ``compute_loss`` and
``training_step``. Of the TrainerCallbacks, the two around the optimizer step run
(``on_pre_optimizer_step``, ``on_optimizer_step``: a callback may change the gradients there); the
others (logging, saving, evaluation, progress) are not called. The harness
watches the torch optimizer inside ``AcceleratedOptimizer`` (its step pre-hook sees the gradients
after unscaling and clipping: the applied ones; the Trainer's default fused AdamW, stepped without an
``unscale_`` where nothing clips, unscales inside its step, and ``run`` records grad / grad_scale)
and the scaler's ``scale`` calls. The float64 step the rates are judged against runs the same
Trainer code in float64; the DDP cases run forward and loss only (``microbatch_loss``).
``activation_checkpointing=True`` in the arguments, which ``train()`` turns on and the per-step
code does not, becomes the spec's ``checkpoint`` (the same call ``train()`` makes), so the
checkpointed step is judged against the step without it (``training.checkpointing``).

**The harness's config decides the precision; the arguments decide everything else.** Each config
runs a Trainer built from a copy of the arguments with ``bf16``/``fp16`` set from the config: fp32
and pure bf16 (the model cast by the harness) with neither, ``amp-bf16`` with ``bf16=True``,
``amp-fp16`` with ``fp16=True``, so the fp32 reference and every mixed-precision row train with the
same optimizer, clipping, accumulation and schedule; the row of the arguments' own choice is the
one to read (``amp-bf16`` for ``bf16=True``). ``amp-fp16-noscale`` runs ``fp16=True`` with the
accelerator's scaler disabled (what the scaler prevents). accelerate does not run fp16 on a CPU
(1.15: ``fp16=True`` there gives no autocast and no scaler, so the Trainer silently trains in
float32); on a CPU the spec gives the accelerator the float16 autocast and ``GradScaler`` it builds
on a GPU, so the CPU runs the Trainer's GPU fp16 path. On a GPU nothing is changed.

**Data.** ``batch_fn(i)`` is the list of ``gradient_accumulation_steps`` micro-batches of optimizer
step ``i``, each ``per_device_train_batch_size`` examples collated by ``data_collator`` (default
``transformers.default_data_collator``), taken from ``train_dataset`` in order and wrapping around:
the same on every call (the Trainer's own sampler shuffles from the global generator).

transformers and accelerate are imported when a spec is built, not with this module.

Measured (CPU): a tiny Llama (2 layers, width 64; 2 steps, 2
micro-batches, clipping to 1) passes every config, first-step gradient SQNR amp-bf16 44.9 dB,
amp-fp16 63.9, amp-fp16-noscale 63.0, bf16 41.3 (all 64 of model.norm.weight's updates lost), bf16-sr
41.3, fp8-e4m3 21.7, ddp-fp16 70.9, ddp-bf16 52.9. A Trainer subclass that clips in its
``training_step`` (after backward, before the accelerator unscales) fails under amp-fp16 only
(gradient norm 1.53e-05 x fp32's, a cosine of 0.69 with fp32's since it clips each micro-batch); a
``compute_loss`` that returns ``model(**inputs).loss`` and drops ``num_items_in_batch`` is not divided
by the micro-batches, which the fp32 reference against the Trainer's own goldens reads as "loss 2.00
x" with the default ``max_grad_norm=1`` clipping both runs' gradients to norm 1, and as "first-step
gradient norm 2.00 x" without clipping.
"""
from __future__ import annotations

import contextlib
import dataclasses
import random
import weakref
from typing import Any, Callable

import torch
from torch import nn

from .spec import TrainSpec, compute_loss

__all__ = ["trainer_spec", "microbatch_loss"]


def _require_transformers():
    try:
        import transformers  # noqa: F401
        import accelerate  # noqa: F401
    except ImportError as e:
        raise ImportError(f"trainer_spec needs transformers and accelerate (pip install 'pytest-precision[hf]'): "
                          f"{e}") from e
    return transformers


def microbatch_loss(model: nn.Module, batch: list) -> torch.Tensor:
    """The loss of a ``trainer_spec`` batch outside the Trainer (the DDP cases): the mean of its
    micro-batches' losses (``compute_loss``: a Hugging Face output's ``.loss``)."""
    losses = [compute_loss(model, mb) for mb in batch]
    return torch.stack(losses).mean()


@contextlib.contextmanager
def _kept_rng():
    """The Trainer's constructor seeds every generator (``set_seed(args.seed)``): keep the harness's."""
    state = random.getstate()
    try:
        import numpy
        np_state = numpy.random.get_state()
    except ImportError:  # pragma: no cover - numpy comes with torch
        numpy, np_state = None, None
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []):
        yield
    random.setstate(state)
    if numpy is not None:
        numpy.random.set_state(np_state)


def _precision(autocast: Callable, scaler: torch.amp.GradScaler) -> tuple[torch.dtype | None, bool]:
    """The config's autocast dtype (None: no autocast) and whether it scales the loss, read from what
    the harness hands the step."""
    ctx = autocast()
    dtype = ctx.fast_dtype if isinstance(ctx, torch.autocast) else None
    return dtype, bool(scaler.is_enabled())


class _TrainerRun:
    """One harness run's Trainer, built at its first step (when the config's precision is known)."""

    def __init__(self, make_trainer, args, steps):
        self.make_trainer, self.args, self.steps = make_trainer, args, steps
        self.trainer = None
        self.model = None  # the model the accelerator prepared (forward wrapped in its autocast)

    def prepare(self, model, optimizer, autocast, scaler):
        dtype, scaling = _precision(autocast, scaler)
        device = next(model.parameters()).device
        overrides = dict(bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, use_cpu=device.type == "cpu")
        if dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"trainer_spec: the Trainer has no mixed precision for autocast {dtype}")
        args = dataclasses.replace(self.args, **overrides)
        with _kept_rng():
            trainer = self.make_trainer(model, args)
        accelerator = trainer.accelerator
        if dtype == torch.float16 and not accelerator.native_amp:
            # accelerate builds no fp16 autocast or scaler on a CPU: give it what it builds on a GPU
            accelerator.native_amp = True
            kwargs = accelerator.scaler_handler.to_kwargs() if accelerator.scaler_handler is not None else {}
            accelerator.scaler = torch.amp.GradScaler(device.type, **kwargs)
        if dtype == torch.float16 and not scaling:
            # amp-fp16-noscale: the Trainer's fp16 path with a disabled scaler (accelerate's fp16
            # unscale_ needs one; a disabled one scales by 1 and steps as it is)
            accelerator.scaler = torch.amp.GradScaler(device.type, enabled=False)
        trainer.optimizer = optimizer  # create_optimizer keeps it: the optimizer the harness watches
        self.model, trainer.optimizer = accelerator.prepare(model, optimizer)
        trainer.model_wrapped = self.model
        trainer.create_scheduler(num_training_steps=self.steps, optimizer=trainer.optimizer)
        for attr in ("model", "optimizer", "lr_scheduler"):  # as Trainer._prepare_for_training hands them on
            setattr(trainer.callback_handler, attr, getattr(trainer, attr))
        self.trainer = trainer

    def step(self, model, optimizer, scaler, batch, autocast):
        if self.trainer is None:
            self.prepare(model, optimizer, autocast, scaler)
        trainer, model = self.trainer, self.model
        samples, num_items = trainer.get_batch_samples(iter(batch), len(batch), trainer.args.device)
        trainer.current_gradient_accumulation_steps = len(samples)
        loss = None
        for m, inputs in enumerate(samples):
            last = m == len(samples) - 1
            trainer.accelerator.gradient_state._set_sync_gradients(last)
            with contextlib.nullcontext() if last else trainer.accelerator.no_sync(model=model):
                part = trainer.training_step(model, inputs, num_items)
            loss = part if loss is None else loss + part
        if trainer.args.max_grad_norm is not None and trainer.args.max_grad_norm > 0:
            trainer._clip_grad_norm(model)
        handler = trainer.callback_handler
        trainer.control = handler.on_pre_optimizer_step(trainer.args, trainer.state, trainer.control)
        trainer.optimizer.step()
        trainer.control = handler.on_optimizer_step(trainer.args, trainer.state, trainer.control)
        if not trainer.accelerator.optimizer_step_was_skipped:
            trainer.lr_scheduler.step()
        model.zero_grad()
        trainer.state.global_step += 1
        return loss


def trainer_spec(model_fn: Callable[[], nn.Module], training_args: Any, train_dataset: Any,
                 data_collator: Callable | None = None, steps: int = 4, trainer_cls: type | None = None,
                 seed: int = 0, keep_fp32: tuple[str, ...] | str = (), seeds: int = 1,
                 **trainer_kwargs) -> TrainSpec:
    """A ``TrainSpec`` whose step is the Trainer's own (the module docstring). ``training_args``: a
    ``transformers.TrainingArguments``; ``train_dataset``: a sequence of examples (``len`` and
    indexing: a list of dicts, a ``datasets.Dataset``, a torch ``Dataset``); ``trainer_cls``: the
    repository's Trainer subclass (default ``transformers.Trainer``); ``keep_fp32`` and ``seeds``
    as ``TrainSpec``'s; ``trainer_kwargs`` go to its constructor (not ``model``, ``args``,
    ``train_dataset``, ``data_collator`` or ``optimizers``)."""
    transformers = _require_transformers()
    if not isinstance(training_args, transformers.TrainingArguments):
        raise TypeError(f"trainer_spec: training_args must be a transformers.TrainingArguments, got "
                        f"{type(training_args).__name__}")
    trainer_cls = transformers.Trainer if trainer_cls is None else trainer_cls
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, transformers.Trainer)):
        raise TypeError(f"trainer_spec: trainer_cls must be transformers.Trainer or a subclass, got {trainer_cls!r}")
    try:
        size = len(train_dataset)
        if size:
            train_dataset[0]
    except Exception as e:
        raise TypeError(f"trainer_spec: train_dataset must support len() and indexing (a list of examples, a "
                        f"datasets.Dataset), got {type(train_dataset).__name__} ({e})") from e
    if size == 0:
        raise ValueError("trainer_spec: train_dataset is empty")
    clashing = sorted({"model", "args", "train_dataset", "data_collator", "optimizers"} & set(trainer_kwargs))
    if clashing:
        raise TypeError(f"trainer_spec: {', '.join(clashing)} are set by trainer_spec, not through trainer_kwargs")
    collate = transformers.default_data_collator if data_collator is None else data_collator
    per_step = training_args.per_device_train_batch_size
    accumulate = training_args.gradient_accumulation_steps

    def batch_fn(i: int) -> list:
        first = i * accumulate * per_step
        return [collate([train_dataset[(first + m * per_step + j) % size] for j in range(per_step)])
                for m in range(accumulate)]

    def make_trainer(model, args):
        return trainer_cls(model=model, args=args, train_dataset=train_dataset, data_collator=collate,
                           **trainer_kwargs)

    runs: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _TrainerRun]" = weakref.WeakKeyDictionary()

    def optimizer_fn(model):
        # the Trainer's optimizer from the arguments (its decay groups, optim, betas, lr); the
        # config's Trainer is built at the first step, when its precision is known
        args = dataclasses.replace(training_args, bf16=False, fp16=False,
                                   use_cpu=next(model.parameters()).device.type == "cpu")
        with _kept_rng():
            trainer = make_trainer(model, args)
        optimizer = trainer.create_optimizer()
        runs[optimizer] = _TrainerRun(make_trainer, training_args, steps)
        return optimizer

    def step_fn(model, optimizer, scaler, batch, autocast):
        return runs[optimizer].step(model, optimizer, scaler, batch, autocast)

    return TrainSpec(model_fn, optimizer_fn, batch_fn, steps=steps, step_fn=step_fn, seed=seed,
                     loss_fn=microbatch_loss, keep_fp32=keep_fp32, seeds=seeds,
                     checkpoint=_trainer_checkpointing(training_args))


def _trainer_checkpointing(args) -> Callable[[nn.Module], None] | None:
    """What ``Trainer.train()`` turns on for ``activation_checkpointing=True`` (transformers 5; its
    alias ``gradient_checkpointing``, the name in 4.x), as a ``TrainSpec.checkpoint`` callable: the
    harness's steps are the Trainer's per-step code, which leaves that to ``train()``, so without it
    a repository's checkpointed training would go unjudged."""
    on = getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", None)
    if not on:
        return None
    given = getattr(args, "activation_checkpointing_kwargs", None) or getattr(args, "gradient_checkpointing_kwargs", None)

    def enable(model: nn.Module) -> None:
        kwargs = dict(given or {})
        # train() (transformers 5) takes these two out of the kwargs and passes the rest to torch's checkpoint
        layout = {k: kwargs.pop(k) for k in ("every_n_layers", "offload") if k in kwargs}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None, **layout)
        elif hasattr(model, "gradient_checkpointing_enable"):  # the deprecated name, which 4.x models have
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None, **layout)
        else:
            raise TypeError(f"trainer_spec: TrainingArguments(activation_checkpointing=True), and "
                            f"{type(model).__name__} has no activation_checkpointing_enable or "
                            "gradient_checkpointing_enable (Trainer.train() would call it)")
    return enable
