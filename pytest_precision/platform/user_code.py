"""Where the user's code is: a file outside torch, this package (its suites and kernels aside: the
built-in targets are code a trace points into), triton, numpy and pytest; and the user's innermost
line on the stack, which traces, the audit and the training watches name."""
from __future__ import annotations

import os
import traceback

import torch

__all__ = ["is_user_file", "user_frame"]

# torch and this package (not its suites and kernels: the built-in targets are code a trace points into)
_SKIP_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)


def is_user_file(filename: str) -> bool:
    return (not filename.startswith(_SKIP_DIRS) and "pluggy" not in filename and "_pytest" not in filename
            and f"{os.sep}triton{os.sep}" not in filename and f"{os.sep}numpy{os.sep}" not in filename)


def user_frame() -> str:
    """``file.py:12`` of the innermost frame outside torch, this package, triton, numpy and
    pytest (inside an interpreted Triton kernel: the line that launched it), or ``?``."""
    for fr in reversed(traceback.extract_stack()):
        if is_user_file(fr.filename):
            return f"{os.path.basename(fr.filename)}:{fr.lineno}"
    return "?"
