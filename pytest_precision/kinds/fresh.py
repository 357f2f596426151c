"""The fresh regime: inputs, and for the built-in kinds shapes, drawn from a seed of their own.

The seeded regimes draw the same bits on every run (goldens hang on them) and the drawn regime
the same examples: a target special-cased to those inputs (right only on rows of 256, or
returning outputs memoised by an input checksum) passes them forever. The ``fresh`` regime of
each tensor kind draws its inputs from a seed that is not the fixed regimes', never judged
against a golden (one file cannot follow inputs that change): the oracle with the peer budget,
the counts and the contract checks judge it. Which seed (``case_seed``):

- by default, one per target, derived from its code (``kinds.target_code``), its kind's code and
  the harness's version (``derived_seed``): the same code, machine and options give the same
  inputs and the same verdict on every run, CI included, and any edit of the target draws new
  ones, so that a target cannot be tuned to its fresh inputs either;
- ``--precision-fresh-seed=N``: N for every target (to replay what a failing case printed);
- ``--precision-explore``: a new seed every run, from the operating system's randomness (the
  tests seed Python's and torch's generators, which must not decide it), handed by the xdist
  controller to its workers; it also seeds the drawn regime's search (``drawn_seed``). For local
  runs and scheduled jobs: a default run's verdict never depends on it.

A fresh or drawn case that fails leaves its seed in pytest's cache (``runner.seed_memory``), and
later runs replay it first, as Hypothesis's example database does, until it passes. Each kind draws
its own (``Kind.fresh_regime``); the default, the op kind's, is the target's first seeded regime
called with a generator seeded from the fresh seed.

What each built-in kind draws: softmax and log_softmax 1 to 24 rows (not 2, 8 or 16) of 2 to 2048
logits (log-uniform; not 256 or 1000), valued as one of unit, scale20, scale200, sharp-peak, masked,
fully-masked (one row) and large-negative; the norms 1 to 12 rows (not 2 or 8) of 16 to 2048 (not 256
or 1000), valued as unit, near-eps or scale300; cross_entropy 3 to 24 rows (not 4 or 16) over 2 to
4096 classes (not 256 or 1000), as unit, N(0, 5^2), scale40, confident, and ignored or smoothing where
the target takes the keyword; attention 1 or 2 key/value heads (twice as many query heads half the
time, unless ``grouped_query=False``), a batch of 1 or 2, lengths 9 to 40, a head dim of 24, 32, 48,
64 or 80 within ``head_dims``, causal half the time (unless ``causal=None``; always under
``causal_only=True``), else key padding at either end two times in three where the target takes a
mask, q unscaled. The cheat zoo's bfloat16 exp on the short tail of rows whose length is no multiple
of 128 passes every seeded and drawn regime; 22 of the fresh seeds 0 to 99 take that path.
"""
from __future__ import annotations

import hashlib
import math
import secrets
import sys
import zlib
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..baselines.entry import BaselineResult
from .cases import Case, Regime
from .target import Target
from .target_code import code_digest

__all__ = ["FRESH", "REPLAY_OPTION", "EXPLORE_OPTION", "SEEDS", "new_seed", "parse_seed", "replay_advice",
           "seed_line", "derived_seed", "case_seed", "drawn_seed", "input_seed", "Plan", "reseeded", "is_fresh", "fresh_regime_of",
           "fresh_result", "note_fresh", "crash_note", "REPLAYED"]

FRESH = "fresh"  # the regime's name (its case ids carry no seed: they stay the same from run to run)
REPLAY_OPTION = "--precision-fresh-seed"
EXPLORE_OPTION = "--precision-explore"
SEEDS = 2 ** 32  # a session seed is one of these (what the header prints fits one line and one paste)


def new_seed() -> int:
    """A session seed from the operating system's randomness, which no test seeds."""
    return secrets.randbelow(SEEDS)


def parse_seed(raw: Any, where: str) -> int:
    """A seed given as text (``where`` names where it came from): ValueError unless a whole number in range."""
    try:
        seed = int(str(raw).strip())
    except ValueError:
        seed = -1
    if not 0 <= seed < SEEDS:
        raise ValueError(f"{where}={raw}: expected a whole number from 0 to {SEEDS - 1} (the seed a run printed)")
    return seed


def replay_advice(seed: int, explore: bool = False, derived: bool = False) -> str:
    """Where a case's fresh inputs came from, and the option that draws them again."""
    if explore:
        return f"fresh inputs from seed {seed}: replay with {EXPLORE_OPTION} {REPLAY_OPTION}={seed}"
    whose = " (derived from the target's code: the same on every run until it changes)" if derived else ""
    return f"fresh inputs from seed {seed}{whose}: replay with {REPLAY_OPTION}={seed}"


def seed_line(seed: int | None, explore: bool) -> str:
    """The session's line about its seeds (the header's, and the summary's after the tables)."""
    if explore:
        return (f"precision: exploring from seed {seed} (fresh inputs and drawn examples new every run): replay with "
                f"{EXPLORE_OPTION} {REPLAY_OPTION}={seed}")
    if seed is not None:
        return f"precision: {replay_advice(seed)}"
    return (f"precision: fresh inputs from a seed per target, derived from its code (the same on every run until the "
            f"code changes); {EXPLORE_OPTION} draws new ones every run")


def _version() -> str:
    try:
        return metadata.version("pytest-precision")
    except metadata.PackageNotFoundError:  # run from a checkout (PYTHONPATH=.)
        return "unknown"


def _kind_file(kind) -> bytes:
    """The kind's code: its module and its companions beside it (``attention_regimes.py`` beside
    ``attention.py``), so that an edit of how a kind draws its inputs draws other inputs."""
    module = sys.modules.get(type(kind).__module__)
    path = Path(getattr(module, "__file__", "") or "")
    if not path.is_file():
        return type(kind).__qualname__.encode()
    files = [path, *sorted(path.parent.glob(f"{path.stem}_*.py"))]
    return b"".join(f.read_bytes().replace(b"\r\n", b"\n") for f in files)


def derived_seed(kind, target: Target) -> int:
    """The default fresh seed of ``target``: a digest of its code, its kind's code (how the kind
    draws) and the harness's version, in [0, SEEDS)."""
    h = hashlib.sha256()
    for part in (_version().encode(), kind.name.encode(), hashlib.sha256(_kind_file(kind)).digest(),
                 target.name.encode(), code_digest(target.fn).encode()):
        h.update(part + b"\0")
    return int.from_bytes(h.digest()[:4], "big") % SEEDS


def case_seed(case: Case) -> int:
    """The seed ``case``'s fresh inputs come from (module docstring): a remembered failing seed being
    replayed (``RunState.replays``), else the run's (given or explored), else the target's own."""
    state = case.state
    replay = state.replays.get(case.name)
    if replay is not None:
        return replay
    if state.fresh_seed is not None:
        return state.fresh_seed
    key = (case.kind.name, case.target.name)
    if key not in state.derived_seeds:
        state.derived_seeds[key] = derived_seed(case.kind, case.target)
    return state.derived_seeds[key]


def is_derived(case: Case) -> bool:
    """Whether ``case`` draws from its target's derived seed (no seed given, none explored or replayed)."""
    return case.state.fresh_seed is None and case.name not in case.state.replays


def drawn_seed(case: Case) -> int:
    """The seed of the drawn regime's search for ``case``: from its name (the same examples on every run,
    whatever the harness's code), mixed with the run's seed when exploring, or a remembered failing one."""
    state = case.state
    replay = state.replays.get(case.name)
    if replay is not None:
        return replay
    own = zlib.crc32(case.name.encode())
    return own ^ state.fresh_seed if state.explore and state.fresh_seed is not None else own


def input_seed(case: Case) -> int | None:
    """The seed ``case`` draws its inputs from now: its fresh seed for the fresh case, its search's for
    the drawn one, None for a seeded regime (whose seed is the regime's own)."""
    if is_fresh(case):
        return case_seed(case)
    drawn = case.kind.drawn_for(case.target)
    return drawn_seed(case) if drawn is not None and case.regime == drawn.name else None


REPLAYED = "remembered in pytest's cache from an earlier run where this case failed, replayed first until it passes"


def _advice(case: Case) -> str:
    advice = replay_advice(case_seed(case), case.state.explore, is_derived(case))
    if case.name in case.state.replays:
        return advice.replace(": replay with", f" ({REPLAYED}): replay with", 1)
    return advice


class Plan:
    """What a kind draws before its inputs (sizes, a family of values), from a generator of its own
    seeded with the session seed: a few draws, made when the case's regime is built (cheap: the
    regime makes its inputs only when the case runs)."""

    def __init__(self, seed: int):
        self.seed = seed
        self.g = torch.Generator().manual_seed(seed)

    def regime(self, description: str, make: Callable[[torch.Generator], Any], **parameters) -> Regime:
        """The fresh regime: ``make(g)`` with ``g`` seeded from the session seed (``Regime.from_generator``),
        ``description`` and ``parameters`` saying what the plan drew."""
        return Regime.from_generator(FRESH, description, make, self.seed, parameters)

    def integer(self, low: int, high: int, avoid: Sequence[int] = ()) -> int:
        """Uniform in [low, high], never one of ``avoid`` (the fixed regimes' sizes)."""
        choices = [n for n in range(low, high + 1) if n not in avoid]
        return choices[int(torch.randint(len(choices), (), generator=self.g))]

    def length(self, low: int, high: int, avoid: Sequence[int] = ()) -> int:
        """Log-uniform in [low, high] (short rows as likely as long ones), never one of ``avoid``."""
        while True:
            u = float(torch.rand((), generator=self.g, dtype=torch.float64))
            n = int(round(math.exp(math.log(low) + u * (math.log(high) - math.log(low)))))
            if n not in avoid:
                return n

    def choice(self, options: Sequence) -> Any:
        return options[int(torch.randint(len(options), (), generator=self.g))]

    def flag(self, p: float = 0.5) -> bool:
        return bool(torch.rand((), generator=self.g, dtype=torch.float64) < p)


def reseeded(regime: Regime, seed: int) -> Regime:
    """``regime``'s inputs drawn from the fresh seed instead of its own (its shapes are its make's)."""
    return Regime(FRESH, f"{regime.description}, drawn from the fresh seed", regime.make, seed,
                  dict(regime.parameters), regime.irregular)


def is_fresh(case: Case) -> bool:
    """Whether ``case`` is its kind's fresh case."""
    fresh = getattr(case.kind, "fresh", None)
    return fresh is not None and case.regime == fresh


def fresh_regime_of(kind, case: Case) -> Regime | None:
    """The fresh regime of ``case`` when it is the kind's fresh case, else None."""
    if not is_fresh(case):
        return None
    regime = kind.fresh_regime(case.target, case_seed(case))
    if regime is None:  # regime_names lists it only where the kind draws one
        raise KeyError(f"{kind.name} draws no fresh inputs for target {case.target.name!r}")
    return regime


def fresh_result(kind, case: Case) -> BaselineResult | None:
    """The golden's part of a fresh case (there is none), or None for any other case."""
    if not is_fresh(case):
        return None
    return BaselineResult(absent="fresh inputs have no golden; the oracle and the peer judge them")


def note_fresh(kind, case: Case, regime: Regime, inputs: Any, details: list[str]) -> None:
    """First in a failing fresh case's details: the seed, how to replay it, and what was drawn."""
    if is_fresh(case):
        shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in kind.floating_inputs(inputs).items())
        details.insert(0, f"{_advice(case)} ({regime.description}; {shapes})")


def crash_note(case: Case, named: bool = False) -> str:
    """A line to end the message of a fresh case that crashed (the target raised, broke its
    contract, ran past its limit): the seed, how to replay it and what was drawn (a target that
    supports less than its kind draws, say no grouped-query heads, declares it: ``named``, the
    message named the declarations already); nothing for any other case."""
    if not is_fresh(case):
        return ""
    try:
        drawn = f" ({case.kind.fresh_regime(case.target, case_seed(case)).description})"
    except Exception:  # the crash may be the draw's own: its message says why
        drawn = ""
    if named:
        return f"\n  {_advice(case)}{drawn}"
    return (f"\n  {_advice(case)}{drawn}; a target that does not support all of that declares "
            f"its limits (its kind's declarations)")
