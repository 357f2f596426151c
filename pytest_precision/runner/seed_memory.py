"""Seeds of fresh and drawn cases that failed, remembered in pytest's cache and replayed first.

A fresh case (``kinds.fresh``) or a drawn one (``kinds.tensor.drawn``) draws its inputs from a seed. When
one fails, its seed is kept under the case's name in ``.pytest_cache`` (``config.cache``; nothing
without pytest's cacheprovider), and the next runs replay it before the case's own seed, as
Hypothesis's example database replays a failing example, until it passes and is forgotten: a
failure found while exploring (``--precision-explore``) or after the target's code changed (its
derived seed moved) stays red until it is fixed. A seed given on the command line
(``--precision-fresh-seed``) is what the user asked to see: nothing is replayed before it.
One cache key per case, so that xdist workers never write the same one.
"""
from __future__ import annotations

import hashlib
from typing import Any

__all__ = ["SeedMemory", "KEEP"]

KEEP = 4  # seeds kept per case, the latest first


class SeedMemory:
    def __init__(self, cache: Any):
        self.cache = cache  # pytest's Cache, or None (-p no:cacheprovider)

    @staticmethod
    def _key(case_name: str) -> str:
        return "pytest_precision/failed_seeds/" + hashlib.sha1(case_name.encode()).hexdigest()[:24]

    def seeds(self, case_name: str) -> list[int]:
        """The remembered failing seeds of ``case_name``, the latest first."""
        if self.cache is None:
            return []
        entry = self.cache.get(self._key(case_name), None)
        if not isinstance(entry, dict) or entry.get("case") != case_name:
            return []
        return [s for s in entry.get("seeds", []) if isinstance(s, int) and not isinstance(s, bool)]

    def _write(self, case_name: str, seeds: list[int]) -> None:
        try:
            self.cache.set(self._key(case_name), {"case": case_name, "seeds": seeds[:KEEP]})
        except OSError:  # a read-only checkout: nothing remembered, nothing lost
            pass

    def remember(self, case_name: str, seed: int) -> None:
        if self.cache is not None:
            self._write(case_name, [seed, *(s for s in self.seeds(case_name) if s != seed)])

    def forget(self, case_name: str, seed: int) -> None:
        if self.cache is not None and seed in self.seeds(case_name):
            self._write(case_name, [s for s in self.seeds(case_name) if s != seed])
