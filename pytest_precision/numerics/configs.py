"""The precision configurations: what each one casts, which flags it sets, where it runs.

A config is entered with ``with config.active(device):``; every flag it touches is restored on
exit, also when the body raises. ``prepare`` gives the inputs the callable sees under the config
and, separately, the same rounded values in float64 for the oracle.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch

from .formats import format_of

__all__ = ["Config", "CONFIGS", "CONFIG_IDS", "Prepared", "select_configs", "fp8_scale", "fp8_roundtrip", "tf32_flags",
           "tf32_matmul_allowed"]


@dataclass(frozen=True)
class Prepared:
    """Inputs under a config: ``value`` goes to the callable, ``exact`` (float64, same rounded
    values) goes to the oracle."""

    value: torch.Tensor
    exact: torch.Tensor


def fp8_scale(x: torch.Tensor, dtype: torch.dtype) -> float:
    """Per-tensor power-of-two scale putting max |finite x| at or under the fp8 format's max.

    A power of two keeps dequantisation exact, so the only rounding is the fp8 cast itself.
    """
    finite = x[torch.isfinite(x)]
    amax = float(finite.abs().max()) if finite.numel() else 0.0
    if amax == 0.0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(amax / format_of(dtype).max))


def fp8_roundtrip(x: torch.Tensor, dtype: torch.dtype, scale: float | None = None) -> tuple[torch.Tensor, float]:
    """Quantise finite values of ``x`` to ``dtype`` at a per-tensor scale and dequantise (fp32).

    Non-finite entries (a -inf mask, say) pass through: masks are applied in higher precision in
    fp8 pipelines, and e4m3fn has no infinity to hold them.
    """
    scale = fp8_scale(x, dtype) if scale is None else scale
    x32 = x.to(torch.float32)
    q = (x32 / scale).to(dtype).to(torch.float32) * scale
    return torch.where(torch.isfinite(x32), q, x32), scale


@dataclass(frozen=True)
class Config:
    """One cell of the precision matrix.

    ``input_dtype``: dtype the inputs are cast to. ``autocast_dtype``: autocast region dtype or
    None. ``tf32``: TF32 matmuls and convolutions on CUDA (off in every other config, so fp32
    means fp32). ``fp8``: fp8 format emulated around the call (inputs quantised, callable run in
    fp32 on the dequantised values, output quantised and dequantised at per-tensor scales).
    """

    id: str
    input_dtype: torch.dtype
    autocast_dtype: torch.dtype | None = None
    tf32: bool = False
    fp8: torch.dtype | None = None
    description: str = ""

    @property
    def tensor_core_dtypes(self) -> bool:
        """Whether the callable's matmuls can run in a tensor-core dtype: 16-bit inputs, autocast,
        or TF32 (fp8 here is emulated around an fp32 call)."""
        return self.tf32 or self.autocast_dtype is not None or self.input_dtype in (torch.float16, torch.bfloat16)

    def skip_reason(self, device: str) -> str | None:
        """Why this config cannot run on ``device`` ("cpu" or "cuda"), or None if it can."""
        if device == "cpu":
            if self.tf32:
                return f"{self.id}: TF32 is a CUDA tensor-core mode; the CPU has no TF32 path"
            return None
        if device == "cuda":
            if not torch.cuda.is_available():
                return f"{self.id}: no CUDA device"
            major, _ = torch.cuda.get_device_capability()
            if self.tf32 and major < 8:
                return f"{self.id}: TF32 needs compute capability 8.0 or newer, this GPU is {major}.x"
            uses_bf16 = torch.bfloat16 in (self.input_dtype, self.autocast_dtype)
            if uses_bf16 and not torch.cuda.is_bf16_supported():
                return f"{self.id}: this GPU does not support bfloat16"
            return None
        return f"{self.id}: unknown device {device!r}"

    def ulp_dtype(self, out: torch.Tensor) -> torch.dtype:
        """The dtype whose ULPs measure the output: the fp8 format, else what the callable returned
        (under autocast that is what autocast really produced)."""
        if self.fp8 is not None:
            return self.fp8
        return out.dtype if out.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) else torch.float32

    def prepare(self, x: torch.Tensor, device: str) -> Prepared:
        """Round ``x`` the way this config feeds it to the callable."""
        if self.fp8 is not None:
            q, _ = fp8_roundtrip(x, self.fp8)
            return Prepared(q.to(device), q.to(torch.float64))
        value = x.to(device=device, dtype=self.input_dtype)
        return Prepared(value, value.to(torch.float64).cpu())

    def finish(self, out: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The output as compared, with its per-tensor scale (1.0 unless fp8)."""
        if self.fp8 is not None:
            return fp8_roundtrip(out, self.fp8)
        return out, 1.0

    @contextlib.contextmanager
    def active(self, device: str) -> Iterator["Config"]:
        """Enter the config on ``device``; restores every flag it touched, also on error."""
        with contextlib.ExitStack() as stack:
            if device == "cuda":
                stack.enter_context(tf32_flags(self.tf32))
            if self.autocast_dtype is not None:
                stack.enter_context(torch.autocast(device_type=device, dtype=self.autocast_dtype))
            yield self


# torch's fp32 precision settings (torch 2.9 and later): a tree whose children inherit from their
# parent while "none". Set through this API, the legacy flags (``allow_tf32``,
# ``set_float32_matmul_precision``) are left as they were, and reading a legacy flag that disagrees
# with the new one raises ("a mix of the legacy and new APIs"); the legacy setters write the new
# settings too. So the flags are read and set here through the new settings only, and exactly
# those are restored: whichever API a user set them with, it reads as before.
_MATMUL = ("cuda", "matmul")  # its parents: ("cuda", "all"), then ("generic", "all")
_CUDNN = (("cuda", "conv"), ("cuda", "rnn"))


def _precision_api() -> bool:
    return hasattr(torch.backends, "fp32_precision") and hasattr(torch.backends.cuda.matmul, "fp32_precision")


def _tf32_settings() -> dict[tuple[str, str], object]:
    """The settings of every node the TF32 flags touch or inherit from."""
    b = torch.backends
    return {("generic", "all"): b, ("cuda", "all"): b.cudnn, ("cuda", "matmul"): b.cuda.matmul,
            ("cuda", "conv"): b.cudnn.conv, ("cuda", "rnn"): b.cudnn.rnn}


def _effective(node: tuple[str, str], settings: dict) -> str:
    """The precision a node runs at: its own setting, else its nearest parent's that is set."""
    chain = [node, (node[0], "all"), ("generic", "all")]
    for n in dict.fromkeys(chain):  # ("generic", "all") once
        value = settings[n].fp32_precision
        if value != "none":
            return value
    return "none"


def tf32_matmul_allowed() -> bool:
    """Whether float32 matmuls on CUDA may use TF32 now, by either API, without ever raising."""
    if _precision_api():
        return _effective(_MATMUL, _tf32_settings()) == "tf32"
    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


@contextlib.contextmanager
def tf32_flags(enabled: bool) -> Iterator[None]:
    """TF32 for CUDA matmuls and cuDNN convolutions and RNNs on (``enabled``) or off, restored on
    exit, also on error."""
    if not _precision_api():  # torch before 2.9: only the legacy flags exist
        matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        try:
            torch.backends.cuda.matmul.allow_tf32 = enabled
            torch.backends.cudnn.allow_tf32 = enabled
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = matmul
            torch.backends.cudnn.allow_tf32 = cudnn
        return
    settings = _tf32_settings()
    saved = {node: s.fp32_precision for node, s in settings.items()}
    value = "tf32" if enabled else "ieee"
    try:
        for node in (_MATMUL, *_CUDNN):  # operator level: nothing a parent says overrides them
            settings[node].fp32_precision = value
        yield
    finally:
        for node, s in settings.items():
            s.fp32_precision = saved[node]


CONFIGS: dict[str, Config] = {
    c.id: c
    for c in (
        Config("fp32", torch.float32, description="float32 inputs, TF32 off"),
        Config("tf32", torch.float32, tf32=True, description="float32 inputs, TF32 matmuls (CUDA)"),
        Config("fp16", torch.float16, description="float16 inputs"),
        Config("bf16", torch.bfloat16, description="bfloat16 inputs"),
        Config("amp-fp16", torch.float32, autocast_dtype=torch.float16, description="float32 inputs, autocast float16"),
        Config("amp-bf16", torch.float32, autocast_dtype=torch.bfloat16, description="float32 inputs, autocast bfloat16"),
        Config("fp8-e4m3", torch.float32, fp8=torch.float8_e4m3fn,
               description="emulated e4m3: per-tensor scaled quantise, fp32 compute, quantised output"),
    )
}
CONFIG_IDS: tuple[str, ...] = tuple(CONFIGS)


def select_configs(spec: str | None) -> list[Config]:
    """Configs named by ``--precision-configs`` ("fp16,bf16"), in matrix order; all if None."""
    if not spec:
        return list(CONFIGS.values())
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [w for w in wanted if w not in CONFIGS]
    if unknown:
        raise ValueError(
            f"--precision-configs: unknown config id(s) {', '.join(unknown)}; known: {', '.join(CONFIG_IDS)}"
        )
    return [c for c in CONFIGS.values() if c.id in wanted]
