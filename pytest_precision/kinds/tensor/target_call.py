"""One call of a target (or a peer) in a tensor kind's case, the one place every call goes through
(``TensorKind.call``: the case, Hypothesis's examples, the first-fault re-run, traces, the contract's
re-calls): on copies of the inputs, under the case's config and variant, with torch's process-wide
state judged around it, the forward output and the gradients under a seeded upstream gradient, and
anything the target raises turned into a :class:`~.target.TargetError` naming target, config and
regime.

What a target prints is kept from its first call in a case; its re-calls (the contract's second
call, Hypothesis's examples, the first-fault re-run, the timed calls) print into nothing, so a
target printing 50 MB a call costs pytest's capture 50 MB, not ten times that.
"""
from __future__ import annotations

import contextlib
import io
from typing import Any, Callable

import torch

from ...numerics.global_state import guarded, leak_message
from ...platform.launches import as_harness
from ...platform.triton import bf16_as_on_gpu, triton_error
from .contract import InputWatch, aliased_inputs, declared_names, plain_output
from ..declarations import Declaration
from ..kind import skip
from .measurement import upstream_gradient
from ..session import Memo
from ..target import TargetError

__all__ = ["call_target", "quiet_after_first"]

CALLS: Memo[str, int] = Memo("case name -> the target's calls so far")


class _Discarded(io.TextIOBase):
    """A text stream that keeps nothing written to it."""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        return len(s)


@contextlib.contextmanager
def quiet_after_first(case, peer: bool = False):
    """Around one call of ``case``'s target: its first call prints as it does, every later one into
    nothing (Python's sys.stdout and sys.stderr; a peer's calls are not the target's)."""
    calls = case.state.memo(CALLS)
    first = peer or not calls.get(case.name)
    if not peer:
        calls[case.name] = calls.get(case.name, 0) + 1
    if first:
        yield
        return
    with contextlib.redirect_stdout(_Discarded()), contextlib.redirect_stderr(_Discarded()):
        yield


def call_target(kind, case, fn: Callable, values: dict[str, torch.Tensor], inputs: Any, grad_seed: int = 0, *,
                where: str, check: bool = True, breaches: list | None = None,
                upstream: torch.Tensor | None = None, forward_only: bool = False,
                peer: bool = False) -> dict[str, torch.Tensor]:
    """``fn`` on copies of ``values`` (see ``TensorKind.call``; ``kind`` a TensorKind)."""
    grads = () if forward_only else kind.case_grad_inputs(case, inputs)
    declared = case.target.declared
    # the copies and the watch's snapshots and comparisons are the harness's ops (as_harness): an op
    # trace (--precision-trace, the first fault) shows the target's alone
    with as_harness():
        # copies, so that nothing the target does to them reaches the peer, the oracle or a second call
        leaves = {n: v.detach().clone().requires_grad_(n in grads) for n, v in values.items()}
        # on every call, so that the inputs the target gets as they are (masks, labels) are put back
        # for the next; compared and reported only with ``breaches`` given
        others = kind.other_tensors(inputs)
        watch = InputWatch(values, others, declared_names(case.target.name, "mutates", declared.get("mutates", ()),
                                                          [*values, *others]))
    # interpreted Triton kernels launched in the call (forward and backward) compute bfloat16 as a
    # GPU does where the interpreter's is wrong: entered here, the one place every call of a target
    # goes through (the case, Hypothesis's examples, the first-fault re-run, traces); made before
    # the try, so that a failing canary is not reported as the target's error
    gpu_bf16 = bf16_as_on_gpu()
    try:
        # torch's process-wide state, as the config set it, judged around the forward and the
        # target's backward
        with gpu_bf16, case.config.active(case.device), case.variant.context(), guarded(rng=True) as state, \
                quiet_after_first(case, peer):
            out = kind.invoke(case.variant.wrap(fn), leaves, inputs, case.device)
            plain_output(out, where)
            if check:
                kind.validate(case, out, values, inputs, where, **({"wider": True} if peer else {}))
            if breaches is not None:
                with as_harness():
                    breaches += watch.changes(leaves, "forward")
                    breaches += aliased_inputs(out, {**leaves, **watch.others},
                                               declared_names(case.target.name, "aliases", declared.get("aliases", ()),
                                                              [*leaves, *watch.others]))
            if grads and not out.requires_grad and not peer:
                error = TargetError(f"{where}: its output carries no autograd graph (a kernel without a backward, or "
                                    "a detached result), so no gradient can be judged")
                error.declarations, error.by_design = (Declaration("forward_only", True),), True
                error.features = ("it returns an output without gradients",)
                raise error
            if grads:
                # copied into place rather than cast with .to(): the audit flags Python-level
                # 16-bit casts as the user's, and this one is the harness's
                grad_out = torch.empty_like(out).copy_(upstream_gradient(out.shape, grad_seed)
                                                       if upstream is None else upstream)
                out.backward(grad_out)
                if breaches is not None:
                    with as_harness():
                        breaches += watch.changes(leaves, "backward")
        if state.changed:
            raise TargetError(leak_message(where, state.changed, "case", "the target"))
    except TargetError:
        raise
    except torch.OutOfMemoryError as e:
        shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in values.items())
        raise TargetError(f"{where}: out of memory ({e}); inputs {shapes}") from e
    except Exception as e:
        hint = triton_error(e)
        if hint is None:
            raise TargetError(f"{where} raised {type(e).__name__}: {e}") from e
        first = case.state.first_launch_failure(case.target.name, case.name)
        if first is not None:  # said once, in the first case's failure
            skip(f"{case.target.name}: its Triton kernel cannot launch here (see {first})")
        raise TargetError(f"{where}: {hint}") from None
    finally:
        with as_harness():
            watch.restore()
    outputs = {kind.forward_output: out.detach()}
    for n in grads:
        if leaves[n].grad is None:
            raise TargetError(f"{where}: no gradient reached {n} (is the output detached?)")
        outputs[f"d{n}"] = leaves[n].grad.detach()
    return outputs

