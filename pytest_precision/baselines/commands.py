"""The command that (re)writes a golden, and the one sentence that offers it.

Every message that says how to write a missing golden, accept a changed result or record this
machine's budget ends with the command :func:`update_command` spells: the test's node id (a
user's test) or the suite case's ``-k`` expression with the flags that selected it, the config,
the device when it is not the default, and ``UPDATE_OPTION``.
"""
from __future__ import annotations

import shlex

__all__ = ["UPDATE_OPTION", "update_command", "accept_sentence"]

UPDATE_OPTION = "--precision-update-baselines"


def update_command(options, *, nodeid: str | None = None, suite_item: str | None = None, config_id: str = "") -> str:
    """The exact command that (re)writes one baseline. ``options``: the run's (its ``device`` and
    ``default_device``; ``builtins`` and ``compile``, the flags a suite case was selected under)."""
    parts = ["pytest"]
    if nodeid is not None:
        parts.append(nodeid)
    else:
        parts += ["--precision-suite", "-k", suite_item or ""]
        if options.builtins:
            parts.append("--precision-builtins")
        if options.compile:
            parts.append("--precision-compile")
    if config_id:
        parts.append(f"--precision-configs={config_id}")
    if options.device != options.default_device:
        parts.append(f"--precision-device={options.device}")
    parts.append(UPDATE_OPTION)
    return " ".join(shlex.quote(p) for p in parts)


def accept_sentence(command: str) -> str:
    """How a failure offers to take its new results as the golden."""
    return f"if the new results are intended, accept them as the golden with: {command}"
