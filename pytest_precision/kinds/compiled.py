"""The ``+compiled`` variant (``--precision-compile``): a target run under ``torch.compile`` in every
config, beside its eager run.

A compiled case is judged as the eager one is (the oracle with the peer budget, its own golden,
the counts) and, in the same case, against the eager target on the same inputs: its error may be
at most the peer factor x the eager error plus the output's floor; past that it fails in the
category ``compiled``. The eager run costs one more call of the target, nothing next to a compile.

Compiled artefacts are shared without a cache of ours: dynamo keeps its compiled frames on the
target's code object, whichever ``torch.compile`` wrapper called it (measured: a new wrapper per
case compiles the same 16 graphs for torch.softmax's 66 cases as one wrapper does), and Inductor
keeps its kernels on disk (``/tmp/torchinductor_<user>``) across processes. What a run must change
is the recompile limit: every config (dtype, autocast) and regime shape is a guard that fails, so
one target meets more than dynamo's default of 8 recompiles, after which dynamo would run the
target eagerly without a word and the compiled case would judge the eager code. The limit is
raised around the call, and reaching it raises instead. Shapes are compiled as ``torch.compile``
does by default (static, then dynamic once a shape changes), as users compile.

One compiled variant per target, with no SDPA backend forced: dynamo does not guard on
``sdpa_kernel``'s choice (measured: a function compiled under the math backend and called under
flash reuses the math graph, bit for bit), so ``+flash+compiled`` would judge whichever backend
compiled first. The compiled case runs what Inductor chooses, beside the eager target on torch's
default choice.

What compiling costs, measured on a 2-core CPU (torch 2.13; cold: Inductor's disk cache empty, warm:
filled by an earlier run): the first compile in a process 27 to 31 s cold (42 s for SDPA with its
backward), 3 to 10 s warm; each further graph 1 to 3 s cold, 0.1 to 0.3 s warm; a case whose graph is
compiled already a median 0.04 s. ``torch.softmax``'s 66 cases (6 configs x 11 regimes, 16 graphs
shared) 57 s cold, 32 s warm (73 and 54 s with a dynamo reset per case); SDPA with 3 gradients, 60
cases, 22 graphs: 113 and 62 s; the whole ``pytest --precision-suite --precision-compile -k
torch.softmax`` run (144 cases, 29 s without the option) 166 and 98 s. The timed call (no grad)
compiles once more per config and shape; the drawn regime's changing shapes compile until dynamo makes
them dynamic (10 to 34 s per config for softmax's 30 examples).
"""
from __future__ import annotations

import contextlib
import logging
import os
import warnings
from dataclasses import replace
from typing import Callable

import torch

from .cases import Case, Variant
from .kind import Kind
from .tensor.measurement import MeasureContext, Measurement
from .target import Target, TargetError
from ..platform.triton import interpreted

__all__ = ["Compiled", "RECOMPILE_LIMIT"]

# compiled frames one target may have. Measured over 6 configs and every regime: torch.softmax 16
# (32 with the timed no-grad call), SDPA with its gradients 37; a limit no suite
# reaches, still an end if a guard recompiles without end
RECOMPILE_LIMIT = 512


def _drop(record) -> bool:
    return False


# the names torch renamed (cache_size_limit became recompile_limit): whichever this torch has
_LIMITS = ((("recompile_limit", "cache_size_limit"), RECOMPILE_LIMIT),
           (("accumulated_recompile_limit", "accumulated_cache_size_limit"), 64 * RECOMPILE_LIMIT),
           (("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"), True))


def _recompile_limits() -> dict:
    import torch._dynamo

    limits = {}
    for names, value in _LIMITS:
        name = next((n for n in names if hasattr(torch._dynamo.config, n)), None)
        if name is not None:
            limits[name] = value
    return limits


class Compiled(Variant):
    """``base`` (no variant; a variant whose context dynamo guards on could be another) with the
    target compiled: suffix ``+compiled`` after the base's."""

    guards_global_state = True  # dynamo guards a compiled frame on torch's deterministic mode, among others

    def __init__(self, base: Variant, device: str = "cpu"):
        self.base = base
        self.device = device
        self.suffix = base.suffix + "+compiled"
        self._wrapped: dict[int, tuple[Callable, Callable]] = {}

    @contextlib.contextmanager
    def context(self):
        import torch._dynamo

        # dynamo's structured trace (empty DEBUG records, written to a file only under TORCH_TRACE)
        # reaches pytest's log capture, dozens of lines under each failing case: dropped unless asked for
        trace_log = logging.getLogger("torch.__trace")
        quiet = not os.environ.get("TORCH_TRACE")
        if quiet:
            trace_log.addFilter(_drop)
        try:
            with self.base.context(), torch._dynamo.config.patch(**_recompile_limits()):
                yield
        finally:
            if quiet:
                trace_log.removeFilter(_drop)

    def wrap(self, fn: Callable) -> Callable:
        cached = self._wrapped.get(id(fn))
        if cached is not None and cached[0] is fn:
            return cached[1]
        with warnings.catch_warnings():
            # the first torch.compile imports Inductor, whose mkldnn module warns that torch.jit's
            # script_method is deprecated: torch's own, nothing the user can act on
            warnings.filterwarnings("ignore", message="`torch.jit.script_method` is deprecated",
                                    category=DeprecationWarning)
            compiled = torch.compile(fn)

        def run(*args, **kwargs):
            # under a TorchDispatchMode (the op tracer, the audit, the alignment lint) dynamo runs the
            # code eagerly and marks it to be skipped from then on: every later compiled case of the
            # target would run eagerly. Traced calls run the eager code instead, as they would anyway.
            if torch._C._len_torch_dispatch_stack():
                return fn(*args, **kwargs)
            return compiled(*args, **kwargs)
        self._wrapped[id(fn)] = (fn, run)  # one wrapper per callable, not one per call
        return run

    def skip_reason(self, target: Target) -> str | None:
        if interpreted(target.fn, self.device):  # dynamo cannot trace the interpreter's launch
            return "torch.compile cannot trace a Triton kernel run by the interpreter (TRITON_INTERPRET=1)"
        return self.base.skip_reason(target)

    def unavailable(self, error: TargetError, case: Case) -> str | None:
        return self.base.unavailable(error, case)

    def beside(self, kind: Kind, ctx: MeasureContext, m: Measurement) -> None:
        """The eager target on the same values, in the same config and base variant, against the
        same oracle: the budget of the compiled output (peer factor x its error + the floor)."""
        eager_case = replace(ctx.case, variant=self.base)
        eager = kind.call(eager_case, eager_case.target.fn, m.values, ctx.inputs, ctx.grad_seed)
        eager_ctx = replace(ctx, case=eager_case, rules={})
        for name, result in m.results.items():
            ref = result.golden.reference
            rule = kind.rule(eager_ctx, name, eager[name], eager[name], ref)
            result.eager = rule.oracle(ref)
            result.eager_budget = rule.budget(result.eager)

    def __repr__(self) -> str:
        return f"Compiled({self.base!r})"
