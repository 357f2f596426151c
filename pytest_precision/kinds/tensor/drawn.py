"""The drawn regime of a tensor kind: Hypothesis searches for inputs on which the target breaks
its peer budget or counts, steered toward the largest error, shrinks what it finds, and the case
reports the shrunk input (and, where a value was lost, its first fault)."""
from __future__ import annotations

import time
from typing import Any

from ...baselines.entry import BaselineResult
from ...platform.triton import interpreter_excuse
from ..cases import Case
from .fault import locate_fault
from ..fresh import drawn_seed
from ..kind import Kind, skip, xfail
from ..outcome import Outcome

__all__ = ["attack"]


def attack(kind: Kind, case: Case) -> Outcome:
    """The drawn regime of ``case`` (``kind`` a TensorKind): Hypothesis searches for inputs on which
    the target breaks its peer budget or counts, steered toward the largest error, and shrinks
    what it finds."""
    from hypothesis import HealthCheck, given, reject, seed, settings
    from hypothesis.errors import Unsatisfiable
    from hypothesis import target as steer

    from ...strategies import PROFILE

    import pytest

    worst: dict[str, Any] = {}
    declined: list[str] = []  # why the target skipped drawn inputs from inside the callable
    drawn = kind.drawn_for(case.target)
    # CPU seconds of this process, not wall time: a busy machine or a second xdist worker
    # stretches wall time without this search doing more
    deadline = time.process_time() + drawn.seconds

    class Falsified(AssertionError):
        pass

    profile = settings.get_profile(PROFILE)

    # inputs outside what the target declared, or that it declined, are filtered: a target that
    # declines most of them is the target's choice, said in the skip below, not a health problem
    @settings(profile, max_examples=drawn.examples, database=None, deadline=None,
              suppress_health_check=[*profile.suppress_health_check, HealthCheck.filter_too_much])
    @given(kind.draw(case))
    def attack(example):
        if time.process_time() > deadline:
            # time is up. With a failure in hand every call fails, so the shrinker accepts each
            # candidate and ends in a few steps (letting them pass kept it trying thousands);
            # what is reported is the last input that really failed (``worst``). Without one,
            # each call passes at once and the search runs out its examples.
            failed = "example" in worst
        else:
            inputs = kind.for_target(case, kind.drawn_inputs(example))
            if kind.unsupported(case, inputs):  # outside what the target declared: not an example
                reject()
            try:
                m = kind.measure(case, inputs)
            except pytest.skip.Exception as e:  # the target declined this input: the search goes on
                declined.append(str(e.msg))
                reject()
            error = m.results[kind.forward_output].oracle.max_ulp
            # the worst passing measurement stands until a failure, which then stays with its input
            if "example" not in worst and ("m" not in worst or error > worst["m"].results[kind.forward_output].oracle.max_ulp):
                worst["m"] = m
            steer(min(error, 1e300) if error == error else 1e300, label="max ULP")
            failed = bool(m.failed_outputs())
            if failed:
                worst.update(m=m, example=example)
        if failed:  # one place: Hypothesis tells failures apart by where they are raised
            raise Falsified()

    # the same examples for the same case on every run, CI or not, whatever the harness's code (Hypothesis's
    # derandomize seeds from a digest of ``attack``'s source, so an unrelated edit here moved every case);
    # new ones under --precision-explore, and a remembered failing seed first (kinds.fresh.drawn_seed)
    attack = seed(drawn_seed(case))(attack)
    try:
        attack()
    except Falsified:
        pass
    except Unsatisfiable:
        if declined:
            skip(f"{case.target.name}: it skipped every drawn input it was given ({declined[-1]})")
        skip(f"{case.target.name}: every drawn input lies outside what it declared")
    if "m" not in worst:
        skip(f"{case.target.name}: no drawn input was judged within {drawn.seconds:g} s")
    m = worst["m"]
    if worst.get("example") is not None:
        excuse = interpreter_excuse(m.launches) or kind.known_limit(case, worst["example"], m)
        if excuse:
            xfail(excuse)
    absent = BaselineResult(absent="drawn inputs have no golden; the oracle and the peer judge them")
    outcome = kind.outcome(case, m, absent)
    example = worst.get("example")
    if example is not None:
        shape = tuple(m.values[next(iter(m.values))].shape)
        outcome.add("oracle", "hypothesis", f"Hypothesis found a failing input of shape {shape}")
        outcome.details = kind.describe_drawn(example, case)
        if any(r.oracle.nan or r.oracle.overflow or r.oracle.underflow for r in m.results.values()):  # where the shrunk input lost it
            outcome.fault = locate_fault(kind, case, m, kind.for_target(case, kind.drawn_inputs(example)), 0,
                                               outcome)
    return outcome
