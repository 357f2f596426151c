"""A repository's own fp8 Linear, as a user writes one: per-tensor current or delayed scaling,
e4m3 forward, e5m2 output gradients, the products on the dequantised values. ``convert(model,
...)`` swaps it in for every ``nn.Linear``, keeping their parameters. ``defect`` plants what the
fp8-own config exists to catch: ``stale`` (a delayed history recorded once, never updated),
``inverted`` (amax / max for max / amax), ``saturating`` (a scale 8 x too large)."""
import torch
from torch import nn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def cast(module, role, x, dtype):
    fmax = torch.finfo(dtype).max
    amax = x.detach().abs().max().float()
    held = amax
    if module.scaling == "delayed":
        history = module.history[role]
        if history and max(history) > 0:
            held = max(history)
        if module.defect != "stale" or not history:
            history.append(amax)
            del history[:-16]
    scale = fmax / torch.clamp(held, min=1e-12)
    if module.defect == "inverted":
        scale = 1 / scale
    elif module.defect == "saturating":
        scale = scale * 8
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype), scale


class _Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, module):
        xq, sx = cast(module, "input", x, E4M3)
        wq, sw = cast(module, "weight", weight, E4M3)
        xd, wd = xq.float() / sx, wq.float() / sw
        ctx.save_for_backward(xd, wd)
        ctx.module = module
        return xd @ wd.t()

    @staticmethod
    def backward(ctx, grad):
        xd, wd = ctx.saved_tensors
        gq, sg = cast(ctx.module, "grad", grad, E5M2)
        gd = gq.float() / sg
        return gd @ wd, gd.reshape(-1, gd.shape[-1]).t() @ xd.reshape(-1, xd.shape[-1]), None


class Fp8Linear(nn.Linear):
    def forward(self, x):
        y = _Fp8Matmul.apply(x, self.weight, self)
        return y if self.bias is None else y + self.bias


def convert(model, scaling="current", defect=None):
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                new = Fp8Linear.__new__(Fp8Linear)
                new.__dict__ = child.__dict__  # the same parameters, under the same names
                new.scaling, new.defect, new.history = scaling, defect, {"input": [], "weight": [], "grad": []}
                setattr(parent, name, new)
    return model
