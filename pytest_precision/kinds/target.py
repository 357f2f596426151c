"""A target: a user's callable (or training spec) registered under a name and a kind, with what it
declared it supports (``register(name, fn, kind=..., dtypes=..., ...)``; see ``Kind.declarations``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Target", "TargetError"]


@dataclass(frozen=True)
class Target:
    name: str
    fn: Any  # a callable in the kind's convention; a TrainSpec for train_step
    kind: str
    origin: str = "register()"
    # what the target declared at registration, as the kind normalised it (Kind.declare)
    declared: dict = field(default_factory=dict, compare=False)


class TargetError(Exception):
    """A target raised or broke its kind's contract; the message names target, config and input."""
