"""Training recipes that change how weights are stored or matmuls computed: pure bf16 with
stochastic rounding of the update, and every ``nn.Linear`` emulated in fp8."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from ..numerics.configs import fp8_roundtrip
from .recorder import wrap_closure

__all__ = ["stochastic_round", "stochastic_rounding_updates", "emulated_fp8_linears"]


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
def stochastic_rounding_updates(optimizer: torch.optim.Optimizer, seed: int) -> Iterator[None]:
    """Around every optimizer.step(): the bf16 params, their grads and state up to fp32 before,
    params back to bf16 with stochastic rounding and state back with round-to-nearest after.
    Parameters stored in another dtype (modules a model keeps in float32) are left alone."""
    gen = torch.Generator().manual_seed(seed)
    rounded: set[int] = set()  # the params this step moved up from bf16

    def before(opt, args, kwargs):
        rounded.clear()
        # step(closure): the closure's forward and backward run inside the step on the bf16 model, so the
        # move up to fp32 waits until it has run (before each evaluation, back to bf16)
        wrapped = wrap_closure(opt, args, kwargs, lambda closure: _after_closure(closure, opt))
        if wrapped is not None:
            return wrapped
        up(opt)
        return None

    def _after_closure(closure, opt):
        def evaluate(*a, **k):
            down(opt)
            loss = closure(*a, **k)
            up(opt)
            return loss
        return evaluate

    def down(opt):  # an evaluation after the first: the params moved up go back to bf16 for the forward
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) in rounded:
                    p.data = p.data.to(torch.bfloat16)
                    if p.grad is not None:
                        p.grad = p.grad.to(torch.bfloat16)
        rounded.clear()

    def up(opt):
        for group in opt.param_groups:
            for p in group["params"]:
                if p.dtype != torch.bfloat16:
                    continue
                rounded.add(id(p))
                p.data = p.data.float()
                if p.grad is not None:
                    p.grad = p.grad.float()
                for k, v in opt.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
                        opt.state[p][k] = v.float()

    def after(opt, args, kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in rounded:
                    continue
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
def emulated_fp8_linears(model: nn.Module, keep_fp32: tuple[str, ...] = ()) -> Iterator[int]:
    """Every nn.Linear of ``model`` but those declared float32 (``keep_fp32``) runs through the fp8
    emulation inside the block; yields how many."""
    from .module_dtypes import declared_fp32

    linears = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and not declared_fp32(n, keep_fp32)]

    def fp8_forward(m):
        return lambda x: _Fp8Linear.apply(x, m.weight, m.bias)
    for m in linears:
        m.forward = fp8_forward(m)
    try:
        yield len(linears)
    finally:
        for m in linears:
            del m.forward
