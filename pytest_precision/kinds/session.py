"""What one pytest session learns while its cases run and keeps for the cases after it: a
:class:`RunState`, made in ``pytest_configure`` and kept on ``config.stash``, handed to every case
(``Case.state``) and dropped with the session. Nothing of it lives in module globals, so two
sessions in one process (pytester's) never see each other's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["RunState", "Memo"]

K = TypeVar("K")
V = TypeVar("V")


@dataclass(frozen=True, eq=False)
class Memo(Generic[K, V]):
    """One memo kinds keep across a session's cases, declared once where it is used:
    ``FP32_RUNS: Memo[tuple[TrainSpec, str], Trajectory] = Memo("the fp32 run of (spec, device)")``;
    ``RunState.memo(FP32_RUNS)`` is its dict. Two declarations are two memos, whatever they say."""

    what: str  # what a key and its value are, in words (repr and errors)

    def __repr__(self) -> str:
        return f"<Memo: {self.what}>"


class RunState:
    """One session's run state: the fresh and drawn regimes' seeds, which target's Triton kernel was already
    found unable to launch, and the memos kinds keep across their cases (``memo``: the train_step
    kind's fp32 runs and float64 steps, the DDP comparisons, the op kind's regimes seen to repeat)."""

    def __init__(self, fresh_seed: int | None = None, train_seeds: int | None = None, explore: bool = False):
        self._launch_failures: dict[str, str] = {}  # target name -> the case that reported it
        # the seed of the fresh regime's inputs for every target (kinds.fresh): given, or the
        # controller's under --precision-explore; None: each target's own, derived from its code
        self.fresh_seed = fresh_seed
        self.explore = explore  # --precision-explore: new inputs every run (fresh and drawn regimes)
        self.replays: dict[str, int] = {}  # case name -> a remembered failing seed it replays now (runner.seed_memory)
        self.derived_seeds: dict[tuple[str, str], int] = {}  # (kind, target) -> its derived fresh seed
        self.train_seeds = train_seeds  # --precision-train-seeds: the seeds every TrainSpec runs from (None: its own)
        self._memos: dict[Memo, dict] = {}

    def first_launch_failure(self, target: str, case: str) -> str | None:
        """The case that already failed because ``target``'s Triton kernel cannot launch here (its
        later cases are skipped, pointing there), or None after noting ``case`` as that case."""
        first = self._launch_failures.setdefault(target, case)
        return None if first == case else first

    def memo(self, memo: Memo[K, V]) -> dict[K, V]:
        """The session's dict of ``memo`` (a :class:`Memo`), empty at first."""
        if not isinstance(memo, Memo):
            raise TypeError(f"RunState.memo takes a pytest_precision.kinds.Memo declared where it is used, got {memo!r}")
        return self._memos.setdefault(memo, {})

    def __repr__(self) -> str:
        return f"<RunState: {len(self._launch_failures)} launch failures, {len(self._memos)} memos>"
