"""A repository's own fp8 recipe, observed: the casts to a float8 dtype that a spec's conversion
(``TrainSpec(fp8=...)``: torchao's ``convert_to_float8_training``, or a module of the repository's
own) makes while the steps run, counted as ``training.fp8`` counts the harness's recipes and judged
by the same ``fp8_problems``.

**What is seen.** A dispatch mode sees every cast to ``float8_e4m3fn`` or ``float8_e5m2``
(``aten._to_copy``, ``aten.copy_`` into an fp8 tensor) and the clamp at a float8 format's max that
precedes it in a saturating cast (torchao's ``to_fp8_saturated``: ``x.clamp(-max, max).to(dtype)``).
The cast's input, or the clamp's, is the scaled tensor: an element *saturated* where it is past the
format's max by more than half the top binade's spacing, *lost to 0* where it is significant (above
2^-24 of the tensor's amax) and 0 in fp8. What current scaling in the careful format (e4m3 for
inputs and weights, e5m2 for gradients) loses of the same scaled tensor is counted beside it: a
scale is linear, so rescaling the tensor by its own amax is current scaling of the original.

**Whose cast.** A cast belongs to the innermost module running: forward pre- and post-hooks keep
the stack in the forward; in the backward, a hook on each module's output fires right before the
autograd node that made it runs, which is where a Linear's fp8 backward casts its output gradient,
so a backward cast belongs to the module whose output gradient arrived last. Its role is the
tensor it was computed from: the module's input, its weight (marked by the forward pre-hook) or
its output gradient (marked by that hook), followed through every op to the cast (torchao casts
the weight and input again in the backward, and an input can have the weight's shape).

**What a correct history saturates.** A delayed recipe scales a tensor by the amax of earlier
calls, and saturates what outgrows them however correct it is; the hooks see each module's true
input, weight and output gradient (unscaled), and count per module and role the elements above
every earlier amax (``TensorCounts.careful_saturated``): what the recipe saturates beyond that is
its own (a history that is never updated, fed the clamped tensor, or a scale too small).

Measured (CPU, torch 2.13) with ``tests/own_fp8.py``'s Linear on an MLP whose inputs grow 1.3 x a
step: its current and delayed scaling pass; a delayed history recorded once and never updated fails
(1718 of fc1's 8192 input elements, 21 %, saturated from call 1, beyond the 54 a correct history
saturates; loss 0.428 off fp32's at step 7); so do an inverted scale (every one of fc2's 2048 weight
elements lost to 0) and a scale 8 x too large (89.2 % of fc2's weight saturated). torchao's
``convert_to_float8_training`` passes on that MLP and on a GPT with zero-initialised projections (it
casts the weight and the input again in its backward: twice the calls of the harness's recipe).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from ..numerics.formats import format_of
from .fp8 import NOISE_FLOOR, Fp8Counts, careful_dtype, careful_lost, saturation_threshold

__all__ = ["observed_fp8_casts", "FP8_DTYPES"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_MAXES = {format_of(d).max: d for d in FP8_DTYPES}
_aten = torch.ops.aten
_CLAMPS = (_aten.clamp.default, _aten.clamp.Tensor, _aten.clamp_.default, _aten.clamp_.Tensor)
_CLAMP_MAXES = (_aten.clamp_max.default, _aten.clamp_max.Tensor, _aten.clamp_max_.default, _aten.clamp_max_.Tensor)
_IN_PLACE = (_aten.clamp_.default, _aten.clamp_.Tensor, _aten.clamp_max_.default, _aten.clamp_max_.Tensor)


class _Observer(TorchDispatchMode):
    """Counts each fp8 cast into ``counts``, per module (``self.current``) and role."""

    def __init__(self, counts: Fp8Counts):
        super().__init__()
        self.counts = counts
        self.stack: list[nn.Module] = []  # the forward's modules, innermost last
        self.backward: nn.Module | None = None  # the module whose output gradient arrived last
        self.names: dict[nn.Module, str] = {}
        self.last_grad = None  # the output gradient whose hook fired last (a module and its parent can share it)
        self.clamped = WeakIdKeyDictionary()  # a clamp's output -> its input (the scaled tensor)
        self.role = WeakIdKeyDictionary()  # a tensor -> the role of the tensor it was computed from

    def mark(self, t, role: str) -> None:
        if isinstance(t, torch.Tensor):
            self.role[t] = role

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        pre = self._clamp_input(func, args, kwargs)
        out = func(*args, **kwargs)
        if pre is not None and isinstance(out, torch.Tensor):
            self.clamped[out] = pre
        role = next((self.role.get(a) for a in pytree.tree_leaves((args, kwargs))
                     if isinstance(a, torch.Tensor) and a in self.role), None)
        if role is not None:
            for o in pytree.tree_leaves(out):
                if isinstance(o, torch.Tensor) and o not in self.role:
                    self.role[o] = role
        if func is _aten._to_copy.default and kwargs.get("dtype") in FP8_DTYPES:
            self._count(args[0], out, kwargs["dtype"])
        elif func is _aten.copy_.default and args[0].dtype in FP8_DTYPES and args[1].is_floating_point() \
                and args[1].dtype not in FP8_DTYPES:
            self._count(args[1], args[0], args[0].dtype)
        return out

    def _clamp_input(self, func, args, kwargs) -> torch.Tensor | None:
        """The input of a clamp at a float8 format's max (``clamp``, ``clamp_max`` and their in-place
        forms, whose input is copied before it is overwritten), or None."""
        if func in _CLAMPS:
            high = args[2] if len(args) > 2 else kwargs.get("max")
        elif func in _CLAMP_MAXES:
            high = args[1] if len(args) > 1 else kwargs.get("max")
        else:
            return None
        if isinstance(high, torch.Tensor) and high.numel() == 1:
            high = float(high)
        if not (isinstance(high, float | int) and float(high) in _MAXES):
            return None
        x = args[0]
        return x.detach().clone() if func in _IN_PLACE else x

    def _module(self) -> nn.Module | None:
        return self.stack[-1] if self.stack else self.backward

    def _count(self, x: torch.Tensor, q: torch.Tensor, dtype: torch.dtype) -> None:
        module = self._module()
        name = self.names.get(module, "(outside every module)")
        role = self.role.get(x) or ("input" if self.stack else "grad")
        pre = self.clamped.get(x, x).detach().float()
        c = self.counts.of(name, role)
        c.dtype = str(dtype).replace("torch.", "")
        magnitude = pre.abs()
        top = float(magnitude.max()) if magnitude.numel() else 0.0
        significant = magnitude > NOISE_FLOOR * top
        saturated = int((magnitude > saturation_threshold(dtype)).sum())
        if saturated and c.first_saturated_call is None:
            c.first_saturated_call = c.calls
        c.calls += 1
        c.elements += x.numel()
        c.significant += int(significant.sum())
        c.saturated += saturated
        c.underflowed += int(((q.float() == 0) & significant).sum())
        if top > 0:
            c.careful_underflowed += careful_lost(pre, significant, role)


class _TrueAmaxes:
    """Per module and role, the largest amax of the earlier calls: what a correct history holds."""

    def __init__(self, counts: Fp8Counts, observer: _Observer):
        self.counts, self.observer = counts, observer
        self.held: dict[tuple[str, str], float] = {}

    def see(self, name: str, role: str, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or not t.numel():
            return
        a = t.detach().abs()
        held = self.held.get((name, role), 0.0)
        if held > 0 and (name, role) in self.counts.tensors:
            dtype = careful_dtype(role)
            c = self.counts.tensors[(name, role)]
            if c.dtype:
                dtype = getattr(torch, c.dtype)
            fmax = format_of(dtype).max
            self.counts.tensors[(name, role)].careful_saturated += int((a.float() * (fmax / held) > saturation_threshold(dtype)).sum())
        self.held[(name, role)] = max(held, float(a.max()))


@contextlib.contextmanager
def observed_fp8_casts(model: nn.Module, counts: Fp8Counts | None = None) -> Iterator[Fp8Counts]:
    """Inside the block, every cast to a float8 dtype that ``model``'s code makes is counted per
    module and role into the counts yielded (the module docstring); the hooks are removed after."""
    counts = counts if counts is not None else Fp8Counts(None)
    observer = _Observer(counts)
    truth = _TrueAmaxes(counts, observer)
    handles = []
    observer.root = model
    for name, module in model.named_modules():
        name = name or type(module).__name__  # the root, under its class's name (the counts' key and the hooks')
        observer.names[module] = name

        def pre(m, args, name=name):
            observer.stack.append(m)
            if args and isinstance(args[0], torch.Tensor):
                observer.mark(args[0], "input")
                truth.see(name, "input", args[0])
            weight = getattr(m, "weight", None)
            if isinstance(weight, torch.Tensor):
                observer.mark(weight, "weight")
                truth.see(name, "weight", weight)

        def post(m, args, out, name=name):
            if observer.stack and observer.stack[-1] is m:
                observer.stack.pop()
            # (not a leaf: a hook on a parameter returned as it is would outlive the run)
            if isinstance(out, torch.Tensor) and out.grad_fn is not None and torch.is_grad_enabled():
                def arrived(g, m=m, name=name):
                    current = observer.names.get(observer.backward)
                    # one gradient can reach a module and its parent (an output passed through, or a residual's
                    # add, which passes its gradient on as it is): the innermost of them is the one running
                    root = observer.names[observer.root]
                    if g is observer.last_grad and not (current == root or name.startswith(f"{current}.")):
                        return
                    observer.last_grad, observer.backward = g, m
                    observer.mark(g, "grad")
                    truth.see(name, "grad", g)
                out.register_hook(arrived)
        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        with observer:
            yield counts
    finally:
        for h in handles:
            h.remove()
        counts.linears = sorted({n for n, _ in counts.tensors})
