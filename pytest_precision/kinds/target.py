"""A target: a user's callable (or training spec) registered under a name and a kind, with what it
declared it supports (``register(name, fn, kind=..., dtypes=..., ...)``; see ``Kind.declarations``)."""
from __future__ import annotations

import inspect
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

    def accepts(self, keyword: str) -> bool:
        """Whether the callable takes ``keyword`` (by name or through ``**kwargs``); True where its
        signature cannot be read (a builtin, a C extension): the call then says for itself."""
        try:
            params = inspect.signature(self.fn).parameters
        except (TypeError, ValueError):
            return True
        return keyword in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class TargetError(Exception):
    """A target raised or broke its kind's contract; the message names target, config and input."""
