"""A target's variants, decided at collection without letting the target touch the session.

Which variants apply to a target can depend on the target's own code: the attention kind calls it
once to see whether it reaches ``scaled_dot_product_attention`` (only then are the SDPA backends
forced around it). That call is a user's code running before any case, inside pytest's collection:
a ``pytest.skip`` there skipped the whole session (every target of the repository gone, exit 5), an
exception or ``pytest.exit`` ended it, a hang never ended it, and a target that answers differently
in two xdist workers made them collect different items, which xdist refuses. So the call is
contained, and what it does concerns that target's cases alone:

- it runs under the case time limit, with every exception caught (``KeyboardInterrupt`` aside),
  and ``os._exit``/``os.abort`` refused (``runner.exits``);
- when it raises, skips or exits, every variant is kept and each case of the target says why;
- when it runs past the limit, the target's cases fail at once with where it was, unrun (each
  would only hang again, a full time limit apiece);
- under xdist the run has one decision per target, in a directory the controller made for the
  run: the first worker to claim the target (a file created exclusively, holding its pid) decides
  and writes the decision there; the others wait for it while the claimant lives (up to the time
  limit and a margin) and read it. A worker that waited in vain decides itself, and the first
  decision written (an atomic link, refused when one is there) is still every worker's.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from ..kinds.cases import NO_VARIANT, Variant
from ..kinds.kind import Kind
from ..kinds.target import Target, TargetError
from ..platform.processes import process_alive
from .exits import TargetEnded, refuse_process_exits
from .timelimit import DEFAULT_TIMEOUT, CaseTimeout, time_limit

__all__ = ["VariantDecision", "decide_variants", "SharedDecisions", "shared_dir"]

# xdist workerinput key: the directory where the run's variant decisions are shared
SHARED_DIR_KEY = "precision_variant_decisions"
# how long past the time limit a worker waits for another's decision before deciding itself
_WAIT_MARGIN = 30.0


@dataclass(frozen=True)
class VariantDecision:
    """The variants that apply to one target, by suffix, and what the cases must say about it."""

    suffixes: tuple[str, ...]
    note: str | None = None  # the decision is not the target's answer: every variant was kept, and why
    problem: str | None = None  # the decision ran past its time limit: the target's cases fail with this

    def variants(self, kind: Kind, device: str) -> list[Variant]:
        known = {v.suffix: v for v in (NO_VARIANT, *kind.variants(device))}
        return [known[s] for s in self.suffixes if s in known] or [NO_VARIANT]

    def to_json(self) -> str:
        return json.dumps({"suffixes": list(self.suffixes), "note": self.note, "problem": self.problem})

    @classmethod
    def from_json(cls, text: str) -> "VariantDecision":
        data = json.loads(text)
        return cls(tuple(data["suffixes"]), data.get("note"), data.get("problem"))


def _decide(kind: Kind, target: Target, device: str, seconds: float, source: str,
            before_exit: Callable[[], None] | None = None) -> VariantDecision:
    every = tuple(v.suffix for v in kind.variants(device))
    how = (f"kept every variant of the {kind.name} kind ({', '.join(s for s in every if s) or 'none'}); declare "
           f"at registration what the probe asks to skip it" + (" (sdpa=True or sdpa=False)" if kind.name == "attention"
                                                                else ""))
    try:
        with time_limit(seconds, source, f"the probe call of target {target.name!r} at collection", before_exit), \
                refuse_process_exits(f"target {target.name!r}", system_exit=False):
            chosen = kind.target_variants(target, device)
        return VariantDecision(tuple(v.suffix for v in chosen))
    except KeyboardInterrupt:
        raise
    except CaseTimeout as e:
        where = "".join(e.stack[-6:]).rstrip()
        return VariantDecision(every, problem=(
            f"the call that decides its variants at collection ran past {e.seconds:g} s ({e.source}), so its cases "
            f"are not run (each would hang again); where it was:\n{where}"))
    except BaseException as e:  # a skip, an exception, pytest.exit or SystemExit: this target's business only
        what = getattr(e, "msg", None) or str(e)
        if isinstance(e, pytest.skip.Exception):
            what = f"the probe call skipped: {what}"
        elif isinstance(e, TargetEnded):
            what = f"the probe call: {what}"
        elif not isinstance(e, TargetError):
            what = f"the probe call raised {type(e).__name__}" + (f": {what}" if what else "")
        return VariantDecision(every, note=f"its variants were not decided at collection ({what.splitlines()[0]}): {how}")


def decide_variants(kind: Kind, target: Target, device: str, seconds: float, source: str,
                    shared_dir: str | None = None, before_exit: Callable[[], None] | None = None) -> VariantDecision:
    """The variants of ``target`` (``kind.target_variants``, contained; see the module docstring),
    the same in every xdist worker of the run when ``shared_dir`` is given. ``before_exit``: called
    before the time limit ends a process whose probe call swallowed it (``runner.timelimit``)."""
    if shared_dir is None or not os.path.isdir(shared_dir):  # no xdist, or a remote worker: its own decision
        return _decide(kind, target, device, seconds, source, before_exit)
    # hashed: a target's name may hold ':' (an ini target, pkg.mod:fn), which not every file system takes
    key = hashlib.sha256(f"{kind.name}\0{target.name}\0{device}".encode()).hexdigest()[:32]
    path = Path(shared_dir) / f"{key}.json"
    claim = path.with_suffix(".claim")
    try:
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(str(os.getpid()))
    except FileExistsError:  # another worker is deciding: wait for its decision while it lives
        waited = _wait_for(path, claim, seconds)
        if waited is not None:
            return waited
    try:
        decision = _decide(kind, target, device, seconds, source, before_exit)
        return _publish(path, decision)
    except BaseException:  # no decision published: a waiting worker must not wait for this one
        if not path.exists():
            with contextlib.suppress(OSError):
                claim.unlink()
        raise


def _wait_for(path: Path, claim: Path, seconds: float) -> VariantDecision | None:
    """The decision another worker publishes at ``path``; None when its claim is gone or its process
    died without one, or past the time limit and a margin (this worker then decides itself)."""
    deadline = time.monotonic() + (seconds if seconds > 0 else DEFAULT_TIMEOUT) + _WAIT_MARGIN
    while time.monotonic() < deadline:
        try:
            return VariantDecision.from_json(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            pass
        if not _claimant_alive(claim):
            with contextlib.suppress(FileNotFoundError):  # it may have published just now
                return VariantDecision.from_json(path.read_text(encoding="utf-8"))
            return None
        time.sleep(0.05)
    return None


def _claimant_alive(claim: Path) -> bool:
    try:
        pid = int(claim.read_text(encoding="ascii") or "0")
    except FileNotFoundError:
        return False
    except ValueError:  # created, its pid not written yet
        return True
    return pid <= 0 or process_alive(pid)


def _publish(path: Path, decision: VariantDecision) -> VariantDecision:
    """Write ``decision`` at ``path`` unless a decision is there already; the one there is every worker's."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(decision.to_json())
        os.link(tmp, path)  # atomic, and refused when another worker decided first
    except FileExistsError:
        return VariantDecision.from_json(path.read_text(encoding="utf-8"))
    finally:
        os.unlink(tmp)
    return decision


class SharedDecisions:
    """The xdist controller's side: one fresh directory for the run's decisions, handed to each
    worker in its workerinput, removed when the run ends."""

    def __init__(self):
        self.path: str | None = None

    def hand_to(self, workerinput: dict) -> None:
        self.path = self.path or tempfile.mkdtemp(prefix="pytest-precision-variants-")
        workerinput[SHARED_DIR_KEY] = self.path

    def remove(self) -> None:
        if self.path:
            shutil.rmtree(self.path, ignore_errors=True)


def shared_dir(config: pytest.Config) -> str | None:
    """A worker's directory of shared decisions (None outside xdist, or when the controller gave none)."""
    return getattr(config, "workerinput", {}).get(SHARED_DIR_KEY)
