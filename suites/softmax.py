"""The softmax and log_softmax kinds: ``fn(x)`` over the last dimension, output shaped and typed as
``x``, judged against the float64 result on the config's rounded inputs, with torch's own op in
the same config as the peer.

Fully masked rows (every logit -inf): the expected output is NaN in every position of the row,
for softmax and log_softmax alike. That is the exact value (0/0) and what torch.softmax and
torch.log_softmax return; a target returning zeros or a uniform row there fails with
"NaN expected but missing". Partially masked positions must be exactly 0 (softmax) or -inf
(log_softmax), which the oracle holds them to.

The peer budget adds half of sqrt(row length) fp32 ULPs because the peer sums the row in another
order: torch's fused CPU softmax is 94 ULP off on rows of 32768 where the composite
``exp(x - max) / sum`` is 32. Log-probabilities in (-1, 1) are counted in steps of the dtype at 1.0:
counted at its own magnitude, a correct ``x - max - log(sum(exp))`` in fp32 is 84 ULP off at
log p = -0.0185, torch's fused kernel 22 on AVX512 and 41 on AVX2. torch's op as the peer, measured
on the CPU in fp16 and bf16: its softmax is bit-identical to float32 arithmetic rounded once (0 of
818,088 elements differ; rows of 1 to 32768, scales 1 to 40); its log_softmax is not float32
throughout (up to 1.29 ULP off, mean 0.37, where float32 rounded once is 0.50 and 0.25).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from pytest_precision.kinds import (ULP_FLOOR, Case, DrawnRegime, OutputRule, Plan, Regime, Target, TensorKind,
                                    format_of, seeded_normal)

__all__ = ["SoftmaxKind", "SOFTMAX", "LOG_SOFTMAX", "REGIMES", "oracle", "BASE_SEED"]

BASE_SEED = 20261122
ROWS, COLS = 16, 256  # small: goldens are committed, and 16 rows already show every row effect


def _randn(g, *shape, scale=1.0, shift=0.0):
    return seeded_normal(g, *shape, scale=scale, shift=shift)


def _near_ties(g):
    # 10.0 against 10.01: fp16 spacing at 10 is 2**-7, bf16 2**-4, so bf16 cannot tell them apart;
    # one logit of 12 per row keeps the exact result from being one constant where they collapse
    # (a regime a constant output would pass judges nothing: kinds.tensor.contract.degenerate)
    x = 10.0 + 0.01 * torch.randint(0, 2, (ROWS, COLS), generator=g).to(torch.float32)
    x[torch.arange(ROWS), torch.randint(0, COLS, (ROWS,), generator=g)] = 12.0
    return x


def _len1(g):
    # softmax of one logit is 1 (log_softmax 0) whatever it is: row 5 is -inf (0 / 0, NaN expected),
    # so that a constant output cannot pass
    x = _randn(g, ROWS, 1, scale=5.0)
    x[5] = float("-inf")
    return x


def _sharp_peak(g, rows=ROWS, cols=COLS):
    x = _randn(g, rows, cols)
    peaks = torch.randint(0, cols, (rows,), generator=g)
    x[torch.arange(rows), peaks] = 30.0  # exp(30) overflows fp16 without max subtraction
    return x


def _masked(g, rows=ROWS, cols=COLS):
    x = _randn(g, rows, cols, scale=5.0)
    mask = torch.rand(rows, cols, generator=g) < 0.5
    keep = torch.randint(0, cols, (rows,), generator=g)
    mask[torch.arange(rows), keep] = False  # every row keeps one finite logit
    return x.masked_fill(mask, float("-inf"))


def _fully_masked(g, rows=ROWS, cols=COLS, dead=(3, 11)):
    x = _masked(g, rows, cols)
    x[list(dead)] = float("-inf")
    return x


def _regime(name: str, description: str, make: Callable[[torch.Generator], torch.Tensor]) -> Regime:
    return Regime.from_generator(name, description, make, BASE_SEED)


REGIMES: dict[str, Regime] = {r.name: r for r in (
    _regime("unit", "N(0, 1) logits, 16 x 256", lambda g: _randn(g, ROWS, COLS)),
    _regime("scale20", "N(0, 20^2) logits", lambda g: _randn(g, ROWS, COLS, scale=20.0)),
    _regime("scale200", "N(0, 200^2) logits", lambda g: _randn(g, ROWS, COLS, scale=200.0)),
    _regime("near-ties", "logits 10.0 and 10.01 at random, one of 12 per row", _near_ties),
    _regime("sharp-peak", "N(0, 1) with one logit of 30 per row", _sharp_peak),
    _regime("len1", "rows of length 1, row 5 -inf (expected: NaN there)", _len1),
    _regime("len1000", "rows of length 1000", lambda g: _randn(g, 8, 1000, scale=5.0)),
    _regime("len32768", "rows of length 32768", lambda g: _randn(g, 2, 32768, scale=5.0)),
    _regime("masked", "half the logits -inf, one finite per row", _masked),
    _regime("fully-masked", "rows 3 and 11 entirely -inf (expected: NaN rows)", _fully_masked),
    _regime("large-negative", "N(-1000, 5^2) logits: exp underflows without max subtraction",
            lambda g: _randn(g, ROWS, COLS, scale=5.0, shift=-1000.0)),
)}
# Not a fixed input: Hypothesis attacks the target with extreme logits (pytest_precision.strategies)
# under the suite's profile; the oracle with the peer budget and the counts judge each example.
HYPOTHESIS = DrawnRegime("hypothesis", examples=30)
# The fresh regime (kinds.fresh): one of the fixed regimes' families of logits, on rows and lengths
# drawn anew every run, never the fixed ones (16 or 8 or 2 rows; lengths 256 and 1000)
FRESH_FAMILIES: dict[str, Callable[[torch.Generator, int, int], torch.Tensor]] = {
    "unit": lambda g, rows, cols: _randn(g, rows, cols),
    "scale20": lambda g, rows, cols: _randn(g, rows, cols, scale=20.0),
    "scale200": lambda g, rows, cols: _randn(g, rows, cols, scale=200.0),
    "sharp-peak": _sharp_peak,
    "masked": _masked,
    "fully-masked": lambda g, rows, cols: _fully_masked(g, rows, cols, dead=(rows // 2,)),
    "large-negative": lambda g, rows, cols: _randn(g, rows, cols, scale=5.0, shift=-1000.0),
}


def fresh_regime(seed: int) -> Regime:
    """The fresh regime of softmax and log_softmax from the session seed (the same for both)."""
    plan = Plan(seed)
    rows, cols = plan.integer(1, 24, avoid=(ROWS, 8, 2)), plan.length(2, 2048, avoid=(COLS, 1000))
    # a fully masked row beside others; logits near -1000 on rows of 64 or more: fp8's steps there (64)
    # round 3 of them to one value, whose softmax any constant passes (kinds.tensor.contract.degenerate)
    family = plan.choice(tuple(f for f in FRESH_FAMILIES if (rows > 1 or f != "fully-masked")
                               and (cols >= 64 or f != "large-negative")))
    return plan.regime(f"{rows} rows of {cols} logits, valued as the {family} regime's",
                       lambda g: FRESH_FAMILIES[family](g, rows, cols), rows=rows, cols=cols, family=family)


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


class SoftmaxKind(TensorKind):
    """softmax (``log=False``) or log_softmax (``log=True``) over the last dimension."""

    suite = "softmax"
    regimes = REGIMES
    drawn = HYPOTHESIS

    def __init__(self, log: bool):
        self.log = log
        self.name = "log_softmax" if log else "softmax"
        self.contract = f"fn(x) -> {self.name} over the last dimension, same shape and dtype as x"
        self._op = torch.log_softmax if log else torch.softmax
        super().__init__()

    def default_targets(self) -> list[Target]:
        """torch's op, and the project's Triton kernel where it can run (kernels/builtin.py)."""
        from pytest_precision.kernels.builtin import builtin_targets

        return [Target(f"torch.{self.name}", self.peer, self.name, origin="built-in")] + builtin_targets((self.name,))

    def floating_inputs(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x": inputs}

    def invoke(self, fn, values, inputs, device):
        return fn(values["x"])

    def expected_shape(self, values, inputs):
        return tuple(values["x"].shape)

    def batch_size(self, case, inputs, values):
        return inputs.shape[0] if inputs.dim() >= 2 else None  # each row is its own softmax

    def rows_of(self, case, inputs, values, rows):
        return inputs[rows], {"x": values["x"][rows.to(values["x"].device)]}

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return oracle(self.name, x)

    def fresh_regime(self, target: Target, seed: int) -> Regime:
        return fresh_regime(seed)

    def peer(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, -1)

    independent_peer_name = "the composite exp(x - max) / sum, in the config's dtype"

    def independent_peer(self, x: torch.Tensor) -> torch.Tensor:
        """torch's op is its own peer otherwise: the same math from separate ops, each rounding in
        the config's dtype (what the built-in ``torch.softmax`` target is held against)."""
        m = x.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # a fully masked row: exp(-inf) = 0, then 0 / 0
        e = torch.exp(x - m)
        s = e.sum(-1, keepdim=True)
        return (x - m) - torch.log(s) if self.log else e / s

    def output_rule(self, ctx, name, out, peer, ref) -> OutputRule:
        rule = super().output_rule(ctx, name, out, peer, ref)
        rule.log_domain = self.log
        # the peer sums the row in another order: a sum of n terms in fp32 is off by about
        # sqrt(n) 2^-24 relative in whatever order (torch's fused CPU softmax is 94 ULP off on rows
        # of 32768 where the composite is 32), half of that in the dtype's ULPs on top of the floor
        n = max(1, int(ctx.exact["x"].shape[-1]))
        rule.ulp_floor = ULP_FLOOR + 0.5 * math.sqrt(n) * 2.0 ** (format_of(rule.dtype).mantissa_bits - 23)
        return rule

    def input_spec(self, regime: Regime, x: torch.Tensor) -> dict:
        return {"regime": regime.name, "shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch."),
                "seed": regime.seed}

    def checksum_input(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def magnitude_input(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def draw(self, case: Case):
        from pytest_precision.strategies import logits

        return logits(self._draw_dtype(case))

    def drawn_inputs(self, example: torch.Tensor) -> torch.Tensor:
        return example.to(torch.float32)

    def describe_drawn(self, example: torch.Tensor, case: Case) -> list[str]:
        return [f"Hypothesis found (after shrinking) logits of shape {tuple(example.shape)}, {self._draw_dtype(case)}:",
                *("  " + line for line in repr(example.tolist()).splitlines())]

    @staticmethod
    def _draw_dtype(case: Case) -> torch.dtype:
        return case.config.input_dtype if case.config.fp8 is None else torch.float32


SOFTMAX = SoftmaxKind(log=False)
LOG_SOFTMAX = SoftmaxKind(log=True)
