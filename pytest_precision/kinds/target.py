"""A target: a user's callable (or training spec) registered under a name and a kind, with what it
declared it supports (``register(name, fn, kind=..., dtypes=..., ...)``; see ``Kind.declarations``)."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Target", "TargetError", "crash_category", "lacking_sentence"]


@dataclass(frozen=True)
class Target:
    name: str
    fn: Any  # a callable in the kind's convention; a TrainSpec for train_step
    kind: str
    origin: str = "register()"
    # what the target declared at registration, as the kind normalised it (Kind.declare)
    declared: dict = field(default_factory=dict, compare=False)
    where: str = field(default="", compare=False)  # the registration's file:line, where known

    def accepts(self, keyword: str) -> bool:
        """Whether the callable takes ``keyword`` (by name or through ``**kwargs``); True where its
        signature cannot be read (a builtin, a C extension): the call then says for itself."""
        try:
            params = inspect.signature(self.fn).parameters
        except (TypeError, ValueError):
            return True
        return keyword in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class TargetError(Exception):
    """A target raised or broke its kind's contract; the message names target, config and input.

    Where the inputs it raised on have features a target can declare it lacks (grouped-query heads,
    S_q != S_k), ``declarations`` holds each declaration that would skip them (any one of them
    explains the error) and ``features`` what the inputs had (``TensorKind.run`` sets them)."""

    declarations: tuple = ()  # kinds.declarations.Declaration, alternatives
    features: tuple = ()  # phrases: "this regime has 4 query heads over 2 key heads"
    from_target = False  # raised by the target's own call (not its peer's or its reference's)
    by_design = False  # ``features`` says what the target did (a float32 output), not what its inputs had
    needs: tuple = ()  # declarations its call showed it needs besides (an input written in place), all of them


def crash_category(error: BaseException) -> str:
    """A crashed case's category: ``contract`` where the target does by design what it can declare (a
    float32 output), ``unsupported`` where it raised on inputs of one feature it can declare it lacks,
    else ``crash``."""
    declarations = getattr(error, "declarations", ())
    if len(declarations) != 1:
        return "crash"
    return "contract" if getattr(error, "by_design", False) else "unsupported"


def lacking_sentence(error: TargetError) -> str | None:
    """For a target that raised on inputs with features it can declare it lacks: what the inputs had
    and the declaration (or the choice of declarations) that says it lacks them; else None."""
    if not error.declarations:
        return None
    phrases = list(dict.fromkeys(f.removeprefix("this regime has ") for f in error.features))
    had = phrases[0] if len(phrases) == 1 else f"{', '.join(phrases[:-1])} and {phrases[-1]}"
    spelled = [d.python() for d in error.declarations]
    if error.by_design:
        return f"{had}: if it does so by design, declare {' or '.join(spelled)}"
    if len(spelled) == 1:
        return f"on inputs with {had}: if the target does not support that, declare {spelled[0]}"
    return (f"on inputs with {had}: a target that does not support one of them declares "
            f"{', '.join(spelled[:-1])} or {spelled[-1]}")
