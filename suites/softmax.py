"""The softmax suite: softmax / log_softmax targets x configs x input regimes.

Each case is judged three ways (float64 oracle with the peer budget, golden with the regression
budget, overflow / underflow / NaN counts); the peer is torch's own op of the kind run in the
same config on the same inputs.

Fully masked rows (every logit -inf): the expected output is NaN in every position of the row,
for softmax and log_softmax alike. That is the exact value (0/0) and what torch.softmax and
torch.log_softmax return; a target returning zeros or a uniform row there fails with
"NaN expected but missing". Partially masked positions must be exactly 0 (softmax) or -inf
(log_softmax), which the oracle holds them to.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import torch

from pytest_precision.checking import CaseOutcome, judge
from pytest_precision.configs import Config
from pytest_precision.budgets import peer_budget
from pytest_precision.faults import first_fault
from pytest_precision.golden import Golden
from pytest_precision.inputs import seeded_normal
from pytest_precision.metrics import compare
from pytest_precision.targets import Target, TargetError
from pytest_precision.timing import Bench

NAME = "softmax"
KINDS = ("softmax", "log_softmax")
BASE_SEED = 20261122
ROWS, COLS = 16, 256  # small: goldens are committed, and 16 rows already show every row effect


@dataclass(frozen=True)
class Regime:
    name: str
    description: str
    make: Callable[[torch.Generator], torch.Tensor]  # float32, CPU

    @property
    def seed(self) -> int:
        return BASE_SEED + zlib.crc32(self.name.encode()) % 100_000

    def inputs(self) -> torch.Tensor:
        g = torch.Generator(device="cpu").manual_seed(self.seed)
        return self.make(g)

    def spec(self, x: torch.Tensor) -> dict:
        return {"regime": self.name, "shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch."), "seed": self.seed}


def _randn(g, *shape, scale=1.0, shift=0.0):
    return seeded_normal(g, *shape, scale=scale, shift=shift)


def _near_ties(g):
    # 10.0 against 10.01: fp16 spacing at 10 is 2**-7, bf16 2**-4, so bf16 cannot tell them apart
    return 10.0 + 0.01 * torch.randint(0, 2, (ROWS, COLS), generator=g).to(torch.float32)


def _sharp_peak(g):
    x = _randn(g, ROWS, COLS)
    cols = torch.randint(0, COLS, (ROWS,), generator=g)
    x[torch.arange(ROWS), cols] = 30.0  # exp(30) overflows fp16 without max subtraction
    return x


def _masked(g):
    x = _randn(g, ROWS, COLS, scale=5.0)
    mask = torch.rand(ROWS, COLS, generator=g) < 0.5
    keep = torch.randint(0, COLS, (ROWS,), generator=g)
    mask[torch.arange(ROWS), keep] = False  # every row keeps one finite logit
    return x.masked_fill(mask, float("-inf"))


def _fully_masked(g):
    x = _masked(g)
    x[3] = float("-inf")
    x[11] = float("-inf")
    return x


REGIMES: dict[str, Regime] = {r.name: r for r in (
    Regime("unit", "N(0, 1) logits, 16 x 256", lambda g: _randn(g, ROWS, COLS)),
    Regime("scale20", "N(0, 20^2) logits", lambda g: _randn(g, ROWS, COLS, scale=20.0)),
    Regime("scale200", "N(0, 200^2) logits", lambda g: _randn(g, ROWS, COLS, scale=200.0)),
    Regime("near-ties", "logits 10.0 and 10.01 at random", _near_ties),
    Regime("sharp-peak", "N(0, 1) with one logit of 30 per row", _sharp_peak),
    Regime("len1", "rows of length 1", lambda g: _randn(g, ROWS, 1, scale=5.0)),
    Regime("len1000", "rows of length 1000", lambda g: _randn(g, 8, 1000, scale=5.0)),
    Regime("len32768", "rows of length 32768", lambda g: _randn(g, 2, 32768, scale=5.0)),
    Regime("masked", "half the logits -inf, one finite per row", _masked),
    Regime("fully-masked", "rows 3 and 11 entirely -inf (expected: NaN rows)", _fully_masked),
    Regime("large-negative", "N(-1000, 5^2) logits: exp underflows without max subtraction",
           lambda g: _randn(g, ROWS, COLS, scale=5.0, shift=-1000.0)),
)}
# Not a fixed input: Hypothesis attacks the target with extreme logits (pytest_precision.strategies)
# under the suite's profile. No golden for it (one baseline cannot hold many examples): the oracle
# with the peer budget and the counts judge each example, and a failure shows the shrunk input.
HYPOTHESIS_REGIME = "hypothesis"
HYPOTHESIS_EXAMPLES = 30
REGIME_NAMES = (*REGIMES, HYPOTHESIS_REGIME)


def _torch_op(kind: str) -> Callable[[torch.Tensor], torch.Tensor]:
    op = torch.softmax if kind == "softmax" else torch.log_softmax
    return lambda x: op(x, -1)


def default_targets() -> list[Target]:
    """torch's ops, and the project's Triton kernels where they can run (kernels/targets.py)."""
    from pytest_precision.kernels.targets import builtin_targets

    return [Target(f"torch.{k}", _torch_op(k), k, origin="built-in") for k in KINDS] + builtin_targets(KINDS)


def oracle(kind: str, x64: torch.Tensor) -> torch.Tensor:
    """Exact-enough result of the kind on the rounded inputs: float64 arithmetic.

    log_softmax is ``(x - max) - log1p(s)``, s the sum of exp(x - max) without one copy of the
    max's term 1: where one logit dominates its row (logits -104 and -141), the true value there
    is -exp(-37) = -8.5e-17, and ``log(1 + s)`` in float64 (torch's formula) rounds it to 0, which
    is 6e8 ULPs of float32 away from a kernel that gets it right.
    """
    x = x64.to(torch.float64)
    if kind == "softmax":
        return torch.softmax(x, -1)
    if x.shape[-1] == 0:
        return x.clone()
    m = x.amax(-1, keepdim=True)
    e = torch.exp(x - torch.where(m == -torch.inf, 0.0, m))  # fully masked rows: s 0, NaN below
    e = e.scatter(-1, x.argmax(-1, keepdim=True), 0.0)
    return (x - m) - torch.log1p(e.sum(-1, keepdim=True))


def _call(target: Target, config: Config, x: torch.Tensor, device: str, regime: str) -> torch.Tensor:
    where = f"target {target.name!r} ({target.kind}) under config {config.id} on regime {regime}"
    try:
        with config.active(device):
            out = target.fn(x)
    except torch.OutOfMemoryError as e:
        raise TargetError(f"{where}: out of memory ({e}); input shape {tuple(x.shape)}") from e
    except Exception as e:
        raise TargetError(f"{where} raised {type(e).__name__}: {e}") from e
    if not isinstance(out, torch.Tensor):
        raise TargetError(f"{where} returned {type(out).__name__}, expected a tensor")
    if tuple(out.shape) != tuple(x.shape):
        raise TargetError(f"{where}: shape mismatch, output {tuple(out.shape)} for input {tuple(x.shape)}")
    if config.autocast_dtype is None and config.fp8 is None and out.dtype != x.dtype:
        raise TargetError(f"{where}: output dtype {out.dtype}, the kind requires the input's {x.dtype}")
    if not out.is_floating_point():
        raise TargetError(f"{where}: output dtype {out.dtype} is not floating point")
    return out


def variants(device: str) -> list[str]:
    return [""]


def _judge_inputs(target: Target, config: Config, x: torch.Tensor, device: str, regime_name: str):
    """Run target and peer on ``x`` under ``config``: (prepared inputs, output as compared, its
    scale and ULP dtype, oracle comparison, peer comparison, float64 reference)."""
    log_domain = target.kind == "log_softmax"
    prep = config.prepare(x, device)
    ref = oracle(target.kind, prep.exact)
    out = _call(target, config, prep.value, device, regime_name)
    peer_target = Target(f"torch.{target.kind}", _torch_op(target.kind), target.kind)
    peer_out = _call(peer_target, config, prep.value, device, regime_name)
    dtype = config.ulp_dtype(out)
    out_c, scale = config.finish(out)
    peer_c, peer_scale = config.finish(peer_out)
    oracle_cmp = compare(out_c, ref, dtype, scale=scale, log_domain=log_domain)
    peer_cmp = compare(peer_c, ref, dtype, scale=peer_scale, log_domain=log_domain)
    return prep, out, out_c, scale, dtype, oracle_cmp, peer_cmp, ref


class _Falsified(AssertionError):
    def __init__(self, x: torch.Tensor, oracle_cmp, peer_cmp, problems):
        super().__init__("; ".join(problems))
        self.x, self.oracle_cmp, self.peer_cmp = x, oracle_cmp, peer_cmp


def _attack(target: Target, config: Config, device: str, golden: Golden) -> CaseOutcome:
    """Hypothesis search for an input on which the target breaks its peer budget or counts."""
    from hypothesis import given, settings
    from hypothesis import target as steer

    from pytest_precision.budgets import violations
    from pytest_precision.golden import GoldenResult
    from pytest_precision.strategies import PROFILE, logits

    draw_dtype = config.input_dtype if config.fp8 is None else torch.float32
    seen = {"oracle": None, "peer": None}

    @settings(settings.get_profile(PROFILE), max_examples=HYPOTHESIS_EXAMPLES, database=None, deadline=None)
    @given(logits(draw_dtype))
    def attack(x):
        _, _, _, _, _, oc, pc, _ = _judge_inputs(target, config, x.to(torch.float32), device, HYPOTHESIS_REGIME)
        if seen["oracle"] is None or oc.max_ulp > seen["oracle"].max_ulp:
            seen["oracle"], seen["peer"] = oc, pc
        steer(min(oc.max_ulp, 1e300) if oc.max_ulp == oc.max_ulp else 1e300, label="max ULP")
        problems = [s for _, s in violations(oc, peer_budget(pc))]
        if problems:
            raise _Falsified(x, oc, pc, problems)

    problems: list[str] = []
    try:
        attack()
    except _Falsified as f:
        seen["oracle"], seen["peer"] = f.oracle_cmp, f.peer_cmp
        shrunk = f.x.to(torch.float32)
        problems = [f"Hypothesis found a failing input of shape {tuple(f.x.shape)}"]
        details = [f"Hypothesis found (after shrinking) logits of shape {tuple(f.x.shape)}, {draw_dtype}:",
                   *("  " + line for line in repr(f.x.tolist()).splitlines())]
    oc, pc = seen["oracle"], seen["peer"]
    outcome = judge(suite=NAME, target=target.name, config=config.id, regime=HYPOTHESIS_REGIME,
                    oracle={"reference": oc}, peer={"reference": pc}, peer_budget={"reference": peer_budget(pc)},
                    golden=GoldenResult(absent="drawn inputs have no golden; the oracle and the peer judge them"))
    if problems:
        outcome.problems = [("oracle", c, s) for c, s in violations(oc, peer_budget(pc))] or \
            [("oracle", "accuracy", "oracle: budget exceeded")]
        outcome.problems.append(("oracle", "hypothesis", problems[0]))
        outcome.details = details
        if oc.nan or oc.overflow or oc.underflow:  # name the op where the shrunk input lost it
            outcome.fault = _locate_fault(target, config, config.prepare(shrunk, device), device)
    return outcome


def bench_call(target: Target, config: Config, regime_name: str, device: str, variant: str = ""):
    """The timed call of a case: the target on the regime's prepared inputs under the config, or
    None for the drawn (hypothesis) inputs, which have no fixed size to time, and for Triton kernels
    under the interpreter, whose time is the interpreter's."""
    from pytest_precision.kernels.targets import interpreted

    if regime_name not in REGIMES or interpreted(target.fn, device):
        return None
    x = config.prepare(REGIMES[regime_name].inputs(), device).value
    return Bench(lambda: target.fn(x), context=lambda: config.active(device))


AUDIT_REGIME = "unit"  # --precision-audit looks at one regime per target and config


def trace_call(target: Target, config: Config, regime_name: str, device: str, variant: str = ""):
    """The call --precision-trace and --precision-audit run traced (as timed, in the config)."""
    bench = bench_call(target, config, regime_name, device, variant)
    return None if bench is None else bench.__call__


def run_case(target: Target, config: Config, regime_name: str, device: str, golden: Golden,
             variant: str = "") -> CaseOutcome:
    from pytest_precision.kernels.targets import skip_reason

    reason = skip_reason(target.fn, device)
    if reason:
        import pytest
        pytest.skip(f"{target.name}: {reason}")
    if regime_name == HYPOTHESIS_REGIME:
        return _attack(target, config, device, golden)
    regime = REGIMES[regime_name]
    log_domain = target.kind == "log_softmax"
    x = regime.inputs()
    prep, out, out_c, scale, dtype, oracle_cmp, peer_cmp, ref = _judge_inputs(target, config, x, device, regime_name)
    gold = golden.check(out_c, ref, dtype=dtype, inputs=x, scale=scale, log_domain=log_domain,
                        seed=regime.seed, input_spec=regime.spec(x))

    outcome = judge(suite=NAME, target=target.name, config=config.id, regime=regime_name,
                    oracle={"reference": oracle_cmp}, peer={"reference": peer_cmp},
                    peer_budget={"reference": peer_budget(peer_cmp)}, golden=gold)
    if not outcome.passed and (not bool(torch.isfinite(out).all()) or "underflow" in outcome.categories):
        outcome.fault = _locate_fault(target, config, prep, device)
    return outcome


def _locate_fault(target: Target, config: Config, prep, device: str):
    """Re-run the target traced under the config, and on the float64 inputs without autocast."""
    def traced():
        with config.active(device):
            target.fn(prep.value)
    return first_fault(traced, lambda: target.fn(prep.exact.to(device)))
