"""Where a failing tensor case lost its value: the target re-run traced under the config beside
the same callable on the float64 inputs, and the first op that lost the value named
(``explain.faults.first_fault``)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ...explain.faults import first_fault
from ...numerics.configs import CONFIGS
from ..cases import NO_VARIANT, Case
from ..kind import Kind
from .measurement import Measurement
from ..outcome import Outcome

__all__ = ["locate_fault"]


def locate_fault(kind: Kind, case: Case, m: Measurement, inputs: Any, grad_seed: int, outcome: Outcome):
    """Re-run the target of ``case`` (a TensorKind's) traced under the config, beside the same callable on the float64
    inputs without autocast or variant, and name the first op that lost the value. A target
    that refuses float64 (its host code maps only the 32- and 16-bit dtypes) is compared with
    its float32 run instead, and the message says so. Every run starts from the random state
    the measured call started from, so a target drawing random numbers (dropout) draws the
    same ones."""
    plain = replace(case, config=CONFIGS["fp32"], variant=NO_VARIANT)
    why_not: list[str] = []

    def replayed(fn):
        def run():
            if m.rng_state is None:
                return fn()
            with m.rng_state.replayed():
                return fn()
        return run

    import pytest

    def reference(dtype):
        values = {n: t.to(case.device, dtype) for n, t in m.exact.items()}
        run = replayed(lambda: kind.call(plain, case.target.fn, values, inputs, grad_seed, check=False))

        def attempt():
            try:
                return run()
            # a skip or NotImplementedError from a target limited to low precision (TensorKind.call makes
            # any Exception, pytest.exit's too, a TargetError); the case's time limit (CaseTimeout),
            # KeyboardInterrupt and SystemExit are not refusals and end the case
            except (Exception, pytest.skip.Exception, pytest.fail.Exception) as e:
                why_not.append(f"{type(e).__name__}: {getattr(e, 'msg', None) or e}".splitlines()[0])
                raise RuntimeError(why_not[-1]) from e
        return attempt

    # each attempt is traced on its own: a float64 run abandoned halfway leaves no ops in the float32 one's trace
    fault = first_fault(replayed(lambda: kind.call(case, case.target.fn, m.values, inputs, grad_seed)),
                        (reference(torch.float64), reference(torch.float32)))
    if why_not:  # the verdict stands; only the explanation is weaker (or missing)
        cause = why_not[0].removeprefix("TargetError: ")
        if len(why_not) == 1:
            outcome.details.append(f"the first fault is located against the target's float32 run, not a float64 "
                                   f"one: it did not run on the float64 inputs ({cause})")
        else:
            outcome.details.append(f"no float64 or float32 trace to compare with: the target did not run on the "
                                   f"float64 inputs ({cause}) nor on float32 ones; the verdict above stands")
    return fault
