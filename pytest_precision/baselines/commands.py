"""The command that (re)writes a golden, and the one sentence that offers it.

Every message that says how to write a missing golden, accept a changed result or record this
machine's budget ends with :func:`offer`: one wording (``OFFER``), then the command
:func:`update_command` spells: the test's node id (a
user's test) or the suite case's ``-k`` expression with the flags that selected it, the config,
the device when it is not the default, and ``UPDATE_OPTION``.
"""
from __future__ import annotations

import shlex

__all__ = ["UPDATE_OPTION", "OFFER", "update_command", "offer", "offer_rerun"]

UPDATE_OPTION = "--precision-update-baselines"
# the one lead-in of the command, whether the golden is missing, changed, unreadable or lacks this
# machine's budget: writing it from this run is right only once the run is
OFFER = "if this run is right, accept it with: "


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


def offer(command: str) -> str:
    """The sentence that offers ``command`` (``update_command``'s)."""
    return OFFER + command


def offer_rerun(condition: str = "") -> str:
    """The same sentence for many cases at once (a session's summary): this run's command again with
    ``UPDATE_OPTION``, ``condition`` added (" in a serial run")."""
    return f"{OFFER}this run's command with {UPDATE_OPTION}{condition}"
