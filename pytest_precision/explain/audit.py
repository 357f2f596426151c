"""The autocast audit (``--precision-audit``): what dtype each op really ran in under a config,
and the cases users care about.

It traces the call (``tracing.OpTracer``: ops after autocast chose their dtypes) and, beside it,
watches the Python-level casts the user's code makes (``.half()``, ``.to(torch.bfloat16)``),
which autocast's own casts never go through. So it shows the real CPU/CUDA differences
(on the CPU, softmax of bf16 inputs stays bf16 under autocast; on CUDA it runs in fp32)
rather than the documented lists, and flags:

- a matmul left in fp32 under autocast (the speed-up autocast is for did not happen);
- softmax, log-softmax, a norm or a loss run in 16 bits (their reductions need fp32 range and
  precision);
- an explicit cast to 16 bits in user code, which defeats the config: what follows runs in 16
  bits whatever autocast would have chosen.

A call that returns a training step's run (``training.run.Trajectory``) adds where each module ran
in its first step (``module_table``) and its module flags (``training.module_dtypes``).

On the CPU (torch 2.13) torch's math SDPA under amp-bf16 casts q, k and v to bf16 and back and runs
its matmuls in fp32: the audit flags them.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch
from tabulate import tabulate
from torch.overrides import TorchFunctionMode

from ..platform.user_code import user_frame
from .tracing import OpTracer

__all__ = ["audit", "render_audits", "MATMUL_OPS", "SENSITIVE_OPS"]

MATMUL_OPS = {"mm", "bmm", "addmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_cudnn_attention", "convolution"}
SENSITIVE_OPS = {"_softmax", "_log_softmax", "_safe_softmax", "native_layer_norm", "native_group_norm",
                 "native_batch_norm", "_native_batch_norm_legit", "_fused_rms_norm", "nll_loss_forward",
                 "nll_loss2d_forward", "mse_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
                 "smooth_l1_loss", "huber_loss", "kl_div", "_cdist_forward", "logsumexp"}
_HALF = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
_CAST_METHODS = {"half", "bfloat16", "to", "type"}


def _cast_target(func, args, kwargs) -> str | None:
    """The 16-bit dtype a Python-level cast asks for, or None."""
    name = getattr(func, "__name__", "")
    if name == "half":
        return "float16"
    if name == "bfloat16":
        return "bfloat16"
    if name in ("to", "type"):
        for a in (*args[1:], *kwargs.values()):
            if isinstance(a, torch.dtype) and a in _HALF:
                return _HALF[a]
    return None


class _CastWatcher(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.casts: list[tuple[str, str]] = []  # (dtype, where)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _CAST_METHODS:
            target = _cast_target(func, args, kwargs)
            src = args[0] if args else None
            if target and isinstance(src, torch.Tensor) and _HALF.get(src.dtype) != target:
                self.casts.append((target, user_frame()))
        return func(*args, **kwargs)


def audit(fn, autocast: bool) -> dict:
    """Run ``fn()`` and return what ran: ``ops`` (one row per op, dtypes and line, with a count)
    and ``flags`` (sentences). ``autocast``: whether the config runs under autocast. Plain data,
    so it travels from xdist workers with the case records."""
    tracer, watcher = OpTracer(), _CastWatcher()
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autograd.set_detect_anomaly(True, check_nan=False))
        stack.enter_context(tracer)
        stack.enter_context(watcher)
        result = fn()
    ops: "OrderedDict[tuple, int]" = OrderedDict()
    flags: list[str] = []
    for r in tracer.records:
        key = (r.op, r.phase.split(" ")[0], ",".join(r.in_dtypes), ",".join(r.out_dtypes), r.where)
        ops[key] = ops.get(key, 0) + 1
        out = r.out_dtypes[0] if r.out_dtypes else ""
        if autocast and r.name in MATMUL_OPS and out == "float32" and r.phase == "forward":
            flags.append(f"{r.op} at {r.where} ran in float32 under autocast: no low-precision speed-up")
        if r.name in SENSITIVE_OPS and out in ("float16", "bfloat16"):
            flags.append(f"{r.op} at {r.where} ran in {out}: its reduction needs fp32 range and precision")
    flags += [f"cast to {dtype} in user code at {where}: the ops after it run in 16 bits whatever the config "
              "asks" for dtype, where in watcher.casts]
    out = {"ops": [[*k, n] for k, n in ops.items()], "flags": list(OrderedDict.fromkeys(flags))}
    modules = getattr(result, "module_table", None)  # a training step's run says where each module ran
    if modules:
        out["modules"] = modules
        out["flags"] += [*(p.sentence for p in getattr(result, "module_failures", [])),
                         *getattr(result, "module_notes", [])]
    return out


def render_audits(records: list[dict]) -> list[str]:
    """The audit section of the terminal summary: per target and config, the ops and the flags."""
    lines = []
    for r in records:
        a = r.get("audit")
        if not a:
            continue
        lines.append(f"{r['target']} [{r['config']}] ({r['regime']} inputs):")
        table = tabulate([row for row in a["ops"]], headers=("op", "phase", "in", "out", "where", "calls"),
                         tablefmt="github")
        lines += ["  " + line for line in table.splitlines()]
        if a.get("modules"):  # a training step: where each module ran in its first step
            table = tabulate(a["modules"], headers=("module", "class", "params", "inputs", "outputs", "recompute"),
                             tablefmt="github")
            lines += ["  " + line for line in table.splitlines()]
        lines += [f"  FLAG {f}" for f in a["flags"]] or ["  no flags"]
    return lines
