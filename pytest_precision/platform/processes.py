"""Facts about this machine's processes: whether one is still running (the writers of leftover
temporary files, the workers that hold a variant)."""
from __future__ import annotations

import os

__all__ = ["process_alive"]


def process_alive(pid: int) -> bool:
    """Whether a process of this machine with ``pid`` may be running (True where it cannot be
    told: another user's process; Windows, where signal 0 is CTRL_C_EVENT, not a probe)."""
    if os.name == "nt":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # EPERM: another user's; a pid out of range
        return True
    return True
