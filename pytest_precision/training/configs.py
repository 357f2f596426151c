"""The training configs: each a recipe of the training suite (autocast, loss scaling, pure low
precision, stochastic rounding, fp8 Linear emulation, DDP gradient compression, FSDP2 mixed
precision), named and selected by the matrix config it belongs to."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from ..numerics.configs import CONFIGS
from ..numerics.formats import format_of
from .fp8 import Float8Recipe

__all__ = ["TrainConfig", "TRAIN_CONFIGS", "FLOAT64", "GRAD_SCALER_INIT_SCALE"]

# torch.amp.GradScaler's default init_scale: the scale a loop with a scaler starts from
GRAD_SCALER_INIT_SCALE = 2.0 ** 16


@dataclass(frozen=True)
class TrainConfig:
    """One training recipe. ``base`` is the matrix config id it belongs to (``--precision-configs``
    selects by it). ``autocast_dtype``: autocast region dtype. ``loss_scaling``: a GradScaler.
    ``param_dtype``: params, grads and optimizer state in that dtype (pure low precision).
    ``stochastic_rounding``: the weight update is computed in fp32 and stored with stochastic
    rounding. ``fp8``: nn.Linear layers emulated in fp8 (e4m3 forward, e5m2 gradients), or, with a
    ``float8`` recipe, computed in fp8 by ``torch._scaled_mm`` (``training.fp8``); ``own_fp8``: the
    spec's own conversion applied instead, its casts observed (``training.fp8_observed``; only for a
    spec that declares one).
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
    float8: Float8Recipe | None = None
    tf32: bool = False
    own_fp8: bool = False  # the spec's own fp8 conversion (TrainSpec(fp8=...)), its casts observed (fp8_observed)
    shows: tuple[str, ...] = ()
    ddp_hook: str | None = None  # a DDP gradient-compression comparison (distributed.py), not a run
    fsdp: tuple[torch.dtype, torch.dtype] | None = None  # an FSDP2 (param_dtype, reduce_dtype) comparison (fsdp.py)


    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the model's matmuls run in (what gradient underflow is measured against); for
        a DDP comparison, the dtype gradients are communicated in."""
        if self.ddp_hook is not None:
            return {"fp16": torch.float16, "bf16": torch.bfloat16}[self.ddp_hook]
        if self.fsdp is not None:
            return self.fsdp[0]
        if self.fp8:
            return self.float8.grad_dtype if self.float8 is not None else torch.float8_e5m2
        return self.autocast_dtype or self.param_dtype

    @property
    def mantissa_bits(self) -> int:
        """The precision the config computes in, in mantissa bits: TF32's 10 (it has no dtype), else
        the compute dtype's."""
        return 10 if self.tf32 else format_of(self.compute_dtype).mantissa_bits

    @property
    def precision_name(self) -> str:
        return "tf32" if self.tf32 else str(self.compute_dtype).replace("torch.", "")

    def underflow_scale(self, scale_used: float | None) -> float:
        """The loss scale a gradient's range is judged at: the one the step ran with, and for fp16
        autocast without a scaler the GradScaler's initial scale (that config exists to show what
        the scaler keeps); 1 where no scaling is needed."""
        if scale_used:
            return scale_used
        if self.autocast_dtype == torch.float16 and not self.loss_scaling:
            return GRAD_SCALER_INIT_SCALE
        return 1.0

    def skip_reason(self, device: str) -> str | None:
        """Why the matrix config this recipe belongs to cannot run on ``device``, or None (the
        training kind adds the DDP cases' own reasons)."""
        if self.float8 is not None and device.startswith("cuda") and torch.cuda.is_available() and \
                torch.cuda.get_device_capability(device) < (8, 9):
            return f"{self.id}: torch._scaled_mm needs fp8 tensor cores on CUDA (compute capability 8.9 or newer)"
        return CONFIGS[self.base].skip_reason(device)

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
    TrainConfig("fp8-tensorwise", "fp8-e4m3", "nn.Linear in fp8 through torch._scaled_mm: e4m3 forward, e5m2 "
                "gradients, per-tensor current scaling", 1e-1, fp8=True, float8=Float8Recipe("tensorwise")),
    TrainConfig("fp8-delayed", "fp8-e4m3", "nn.Linear in fp8 through torch._scaled_mm: e4m3 forward, e5m2 gradients, "
                "per-tensor delayed scaling (amax history of 16 calls)", 1e-1, fp8=True,
                float8=Float8Recipe("delayed", 16)),
    TrainConfig("fp8-own", "fp8-e4m3", "the spec's own fp8 conversion (TrainSpec(fp8=...)), every cast to a float8 dtype "
                "observed", 1e-1, fp8=True, own_fp8=True),
    TrainConfig("ddp-fp16", "fp16", "DDP on 2 processes, gradients all-reduced through fp16_compress_hook, against "
                "uncompressed DDP", 0.0, ddp_hook="fp16"),
    TrainConfig("ddp-bf16", "bf16", "DDP on 2 processes, gradients all-reduced through bf16_compress_hook, against "
                "uncompressed DDP", 0.0, ddp_hook="bf16"),
    # FSDP2 (fsdp.py): one step on 2 processes against single-process fp32; loss_rtol as autocast's
    TrainConfig("fsdp-bf16", "bf16", "FSDP2 fully_shard on 2 processes, bfloat16 params and compute, gradients "
                "reduce-scattered in float32, against single-process fp32", 2e-2, fsdp=(torch.bfloat16, torch.float32)),
    TrainConfig("fsdp-bf16-reduce-bf16", "bf16", "FSDP2 fully_shard on 2 processes, bfloat16 params and compute, "
                "gradients reduce-scattered in bfloat16, against single-process fp32", 2e-2,
                fsdp=(torch.bfloat16, torch.bfloat16)),
    TrainConfig("fsdp-fp16-reduce-fp16", "fp16", "FSDP2 fully_shard on 2 processes, float16 params and compute, "
                "gradients reduce-scattered in float16, no loss scaling, against single-process fp32", 5e-3,
                fsdp=(torch.float16, torch.float16)),
)}

# the first step in float64, no autocast: the exact gradients and update the rates are judged
# against (and the run the first fault is localised against); not a config of the suite
FLOAT64 = TrainConfig("float64", "fp32", "float64 reference of the first step", 0.0, param_dtype=torch.float64)
