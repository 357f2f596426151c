"""Golden baselines.

- ``store``: where goldens live (a directory per test key, a pair of files per config), the names
  a target, regime or config may take, and :class:`BaselineStore`, which every read and write
  goes through;
- ``reading``: reading a golden, never trusted, bounded before it costs anything;
- ``schema``: what a golden's JSON may hold, the limits written as unlimited, and
  :class:`BaselineError`;
- ``writing``: atomic, locked, reproducible writes;
- ``commands``: the command that (re)writes a golden, and the sentence that offers it;
- ``entry``: what one check stores and how it is judged (:class:`BaselineEntry`), and what it
  found (:class:`BaselineResult`);
- ``tensors``: the entry of tensor outputs (float32 references, budgets in ULPs or max abs);
- ``lifecycle``: the one life of a golden (:class:`BaselineCheck`: find, judge, prepare, commit);
- ``usage``: which baselines a run used; ``tools``: list, show, diff and prune a directory of them.
"""
from .commands import UPDATE_OPTION
from .reading import Baseline
from .schema import SCHEMA_VERSION, BaselineError
from .store import BaselineStore, checksum, sanitize_key

__all__ = ["SCHEMA_VERSION", "UPDATE_OPTION", "Baseline", "BaselineError", "BaselineStore", "checksum", "sanitize_key"]
