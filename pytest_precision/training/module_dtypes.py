"""Where each module of a training step ran: per module, the dtypes of its parameters, inputs and
outputs in a config's first step, and the modules that ran in another precision than the config
and the spec's declarations mean.

Repositories keep some modules in float32 under a 16-bit config (a language-model head, the norms,
a router). Storing a module's *parameters* in float32 does not do it under autocast: autocast casts
a Linear's input and weight to the autocast dtype whatever they are stored in, so a head whose
weights are float32 still computes in bfloat16 unless it runs with autocast disabled on float32
inputs. What a module computed in shows in its output's dtype, so that is what is judged:

- a module the spec declares float32 (``TrainSpec(keep_fp32=("lm_head", "*.norm"))``, fnmatch
  patterns on qualified module names) whose output is 16-bit fails the case (category ``dtype``);
  under pure bfloat16 the harness keeps those modules' parameters in float32, as such a repository
  does;
- a matmul module (Linear, Conv, Hugging Face's Conv1D) the config means in 16 bits (autocast)
  whose output is float32, and that is not declared, is reported: the matmul ran in float32 (an
  explicit ``.float()``, autocast disabled around it), which costs the speed-up and is a choice to
  declare;

Recorded in the first step only (forward hooks, removed after it). A checkpoint's recompute in the
backward (autograd's engine running) is recorded apart, in the audit's ``recompute`` column: one
run outside the forward's autocast state gives tensors of other dtypes, which torch refuses itself
(its recomputed-metadata check, or a dtype mismatch in the backward), so it is shown, not judged.
"""
from __future__ import annotations

import contextlib
import fnmatch
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch
from torch import nn

from ..numerics.problem import Problem

__all__ = ["ModuleRun", "record_module_dtypes", "declared_fp32", "declared_modules", "keep_fp32_params", "parameters_to", "cast_then_as_built", "module_flags",
           "module_rows", "MATMUL_MODULES"]

MATMUL_MODULES = (nn.Linear, nn.Bilinear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}
_16_BIT = (torch.float16, torch.bfloat16)


def _short(dtypes: Iterable[torch.dtype]) -> str:
    return ",".join(sorted({_SHORT.get(d, str(d).replace("torch.", "")) for d in dtypes})) or "-"


@dataclass
class ModuleRun:
    """One module's dtypes in the step: parameters (its own, not its children's), the floating
    tensors it was called with and returned, in the forward and in a backward recompute."""

    kind: str
    params: set = field(default_factory=set)
    inputs: set = field(default_factory=set)
    outputs: set = field(default_factory=set)
    recompute_outputs: set = field(default_factory=set)
    matmul: bool = False

    def as_row(self, name: str) -> list:
        recompute = _short(self.recompute_outputs) if self.recompute_outputs else ""
        return [name, self.kind, _short(self.params), _short(self.inputs), _short(self.outputs), recompute]


def _floating(obj: Any, seen: int = 0) -> Iterator[torch.Tensor]:
    """The floating tensors in a module's arguments or output (tuples, lists, dicts, Hugging Face
    outputs), not deeper than a few levels."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield obj
    elif seen < 4 and isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _floating(o, seen + 1)
    elif seen < 4 and isinstance(obj, dict):
        for o in obj.values():
            yield from _floating(o, seen + 1)


def _is_matmul(module: nn.Module) -> bool:
    return isinstance(module, MATMUL_MODULES) or type(module).__name__ == "Conv1D"  # transformers' GPT-2 Conv1D


def declared_fp32(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether module ``name`` (qualified, as ``named_modules`` gives it) or a module above it is
    declared float32."""
    parts = name.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(fnmatch.fnmatchcase(p, pat) for p in prefixes for pat in patterns)


def declared_modules(model: nn.Module, patterns: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """The outermost modules of ``model`` declared float32 (the root itself excluded)."""
    return [(name, module) for name, module in model.named_modules()
            if name and declared_fp32(name, patterns) and not declared_fp32(name.rpartition(".")[0], patterns)]


def keep_fp32_params(model: nn.Module, patterns: tuple[str, ...]) -> list[str]:
    """Cast the declared modules' parameters and buffers back to float32 (pure low-precision
    configs keep them there, as a repository keeping its head or norms in float32 does); returns
    the names of the modules cast."""
    cast = []
    for name, module in declared_modules(model, patterns):
        module.to(torch.float32)
        cast.append(name)
    return cast


@contextlib.contextmanager
def record_module_dtypes(model: nn.Module) -> Iterator[dict[str, ModuleRun]]:
    """Inside the block every named submodule's calls are recorded into the yielded dict (name ->
    ModuleRun); the hooks are removed on exit."""
    runs: dict[str, ModuleRun] = {}
    handles = []

    def hook_for(name: str, module: nn.Module):
        def hook(mod, args, kwargs, output):
            run = runs.get(name)
            if run is None:
                run = runs[name] = ModuleRun(type(mod).__name__, {p.dtype for p in mod.parameters(recurse=False)},
                                             matmul=_is_matmul(mod))
            out = {t.dtype for t in _floating(output)}
            if torch._C._current_graph_task_id() != -1:  # inside autograd's engine: a checkpoint's recompute
                run.recompute_outputs |= out
            else:
                run.inputs |= {t.dtype for t in _floating((args, kwargs))}
                run.outputs |= out
        return hook

    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_hook(hook_for(name, module), with_kwargs=True))
    try:
        yield runs
    finally:
        for h in handles:
            h.remove()


def module_flags(runs: dict[str, ModuleRun], autocast_dtype: torch.dtype | None, param_dtype: torch.dtype,
                 keep_fp32: tuple[str, ...]) -> tuple[list[Problem], list[str]]:
    """(problems, notes) for one config's recorded step (the module docstring): ``dtype`` problems for a
    declared-float32 module that computed in 16 bits; notes for a matmul the config means in 16
    bits that ran in float32."""
    failures, notes = [], []
    low = autocast_dtype if autocast_dtype in _16_BIT else (param_dtype if param_dtype in _16_BIT else None)
    for name, run in runs.items():
        if low is None or not run.outputs:
            continue
        declared = declared_fp32(name, keep_fp32)
        # a declared module's own output: the first declared module on the path, not its children
        # (a declared block's Linear children run as the block lets them)
        top_declared = declared and not declared_fp32(name.rpartition(".")[0], keep_fp32)
        if top_declared and run.outputs & set(_16_BIT):
            if run.matmul and autocast_dtype in _16_BIT:
                how = (f"autocast casts a {run.kind}'s input and weight to {_short([low])} whatever they are stored "
                       "in: run it inside torch.autocast(device_type, enabled=False) on inputs cast to float32")
            else:
                how = ("its inputs reached it in 16 bits and it computed in their dtype: cast them to float32 inside "
                       "it (x.float()), outside autocast")
            failures.append(Problem("oracle", "dtype", f"{name} ({run.kind}) is declared float32 (keep_fp32) and ran in {_short(run.outputs)} "
                            f"(parameters {_short(run.params)}, inputs {_short(run.inputs)}): {how}"))
        elif (not declared and run.matmul and autocast_dtype in _16_BIT and run.outputs == {torch.float32}):
            notes.append(f"{name} ({run.kind}) ran in float32 under autocast {_short([autocast_dtype])} (inputs "
                         f"{_short(run.inputs)}): its matmul gets no 16-bit speed-up; declare keep_fp32=({name!r},) if "
                         "that is by design")
    return failures, notes


def module_rows(runs: dict[str, ModuleRun]) -> list[list]:
    """The audit's table rows: module, class, parameters, inputs, outputs, recompute."""
    return [run.as_row(name) for name, run in runs.items()]


def parameters_to(model: nn.Module, dtype: torch.dtype) -> None:
    """The floating parameters of ``model`` to ``dtype``, its buffers left as built (a parameter
    shared by two modules stays one parameter)."""
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None or not p.is_floating_point():
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            module._parameters[name] = done[id(p)]


_T = TypeVar("_T")


def cast_then_as_built(attempt: Callable[[bool], _T], passes: tuple[type[BaseException], ...] = ()) -> _T:
    """``attempt(False)`` (the model with its buffers cast to the run's dtype) and, where that raises,
    ``attempt(True)`` (its parameters alone cast, its buffers as built: a model that asserts its rotary
    tables are in the compute dtype it fixed at import). An error of a type in ``passes`` is raised at
    once; where both raise, the first is raised with the second as its ``as_built_error``."""
    try:
        return attempt(False)
    except passes:
        raise
    except Exception as first:
        try:
            return attempt(True)
        except passes:
            raise
        except Exception as second:
            first.as_built_error = second
            raise first
