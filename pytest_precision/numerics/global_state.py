"""torch's process-wide state a target can leave changed, snapshotted around each call of it.

A target that sets ``torch.set_default_dtype(torch.float64)``, leaves an autocast entered or grad
mode off, or flips a math flag changes every later case in the process: under an update, goldens
were recorded under that state (the next clean run then failed as "the inputs changed"), and in a
check other targets' cases crashed with a wrong cause. So ``TensorKind.call`` (``kinds/tensor/template.py``) takes a snapshot before the
target runs and compares after: a change is restored at once and fails that target's case, naming
what changed (a failed case writes no golden). The training kind does the same around each call
of a ``TrainSpec``'s code (``training.run.judged_state``). Both go through :func:`guarded` and
say what changed with :func:`leak_message`.

The working directory and the environment are process-wide too: a target that changes directory,
or removes or changes an environment variable (``os.environ.clear()``), would leave its change to
every later test. They are judged and restored the same way; a variable a target adds is neither
(libraries set their own on first use, and rely on them).

The random generators are restored too but not judged: a target drawing dropout masks advances
them by design, and every case seeds its own draws (a training run's generators are the
harness's to seed and replay, and ``judged_state`` snapshots without them).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from .configs import _precision_api, _tf32_settings
from .rng import RngState

__all__ = ["GlobalState", "snapshot", "Guard", "guarded", "leak_message"]

WORKING_DIRECTORY, ENVIRONMENT = "working directory", "environment"
_DENORMAL = 2.0 ** -140  # a float32 subnormal: flush-denormal mode makes a product of it zero


def _flushes_denormals() -> bool:
    # in numpy, out of the op tracer's and the audit's sight (torch.set_flush_denormal sets the
    # thread's FTZ/DAZ flags, which numpy's float32 arithmetic obeys as torch's does)
    return float(np.multiply(np.array([_DENORMAL], dtype=np.float32), np.float32(1.0))[0]) == 0.0


def _autocast_nesting() -> int:
    """How many autocast regions are entered now (torch has no getter: up one and back)."""
    level = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return level


def _autocast_devices() -> tuple[str, ...]:
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


@dataclass
class GlobalState:
    values: dict[str, Any]  # what is judged: name -> value
    rng: RngState | None  # the CPU generator's state (restored, not judged); None: not taken

    def changes(self, after: "GlobalState") -> list[str]:
        """``name was -> now`` for each judged value that differs in ``after``."""
        out = [f"{name} {_show(was)} -> {_show(after.values[name])}"
               for name, was in self.values.items() if name != ENVIRONMENT and after.values.get(name) != was]
        env, now = self.values.get(ENVIRONMENT, {}), after.values.get(ENVIRONMENT, {})
        removed = sorted(k for k in env if k not in now)
        changed = sorted(k for k in env if k in now and now[k] != env[k])
        if removed or changed:
            parts = ([f"{len(removed)} removed ({', '.join(removed[:3])}{', ...' if len(removed) > 3 else ''})"]
                     if removed else []) + ([f"changed: {', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}"]
                                            if changed else [])
            out.append(f"{ENVIRONMENT} variables {'; '.join(parts)}")
        return out

    def restore(self) -> None:
        """Put back every value of this snapshot (those unchanged are set to what they are)."""
        v = self.values
        torch.set_default_dtype(v["default dtype"])
        torch.set_grad_enabled(v["grad mode"])
        torch.set_flush_denormal(v["flush-denormal"])
        torch.use_deterministic_algorithms(v["deterministic algorithms"],
                                           warn_only=v["deterministic algorithms (warn only)"])
        for device in _autocast_devices():
            torch.set_autocast_enabled(device, v[f"autocast on {device}"])
            torch.set_autocast_dtype(device, v[f"autocast dtype on {device}"])
        # an autocast entered and never exited keeps its nesting level: autocast's cache of casted
        # weights is cleared only when the outermost region ends, so every later region would reuse
        # stale casts of weights an optimizer has since updated
        nesting = _autocast_nesting()
        while nesting > v["autocast nesting"]:
            nesting = torch.autocast_decrement_nesting()
            if nesting == 0:
                torch.clear_autocast_cache()
        if _precision_api():
            for node, setting in _tf32_settings().items():
                name = f"fp32 precision ({node[0]}, {node[1]})"
                if setting.fp32_precision != v[name]:
                    setting.fp32_precision = v[name]
        else:
            torch.backends.cuda.matmul.allow_tf32 = v["TF32 matmuls"]
            torch.backends.cudnn.allow_tf32 = v["TF32 cuDNN"]
            torch.set_float32_matmul_precision(v["float32 matmul precision"])
        if os.getcwd() != v[WORKING_DIRECTORY] and os.path.isdir(v[WORKING_DIRECTORY]):
            os.chdir(v[WORKING_DIRECTORY])
        env = v[ENVIRONMENT]
        for name, value in env.items():  # removed or changed ones back; those added stay (the module docstring)
            if os.environ.get(name) != value:
                os.environ[name] = value
        if self.rng is not None:
            self.rng.restore()


def snapshot(rng: bool = True) -> GlobalState:
    """The state now; ``rng=False`` leaves the generator's state out (a snapshot only compared with)."""
    values: dict[str, Any] = {
        "default dtype": torch.get_default_dtype(),
        "grad mode": torch.is_grad_enabled(),
        "flush-denormal": _flushes_denormals(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic algorithms (warn only)": torch.is_deterministic_algorithms_warn_only_enabled(),
    }
    for device in _autocast_devices():
        values[f"autocast on {device}"] = torch.is_autocast_enabled(device)
        values[f"autocast dtype on {device}"] = torch.get_autocast_dtype(device)
    values["autocast nesting"] = _autocast_nesting()
    values[WORKING_DIRECTORY] = os.getcwd()
    # pytest's own (PYTEST_CURRENT_TEST names the phase running) move under every call
    values[ENVIRONMENT] = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    if _precision_api():  # read through the new API only: the legacy flags raise when the two disagree
        for node, setting in _tf32_settings().items():
            values[f"fp32 precision ({node[0]}, {node[1]})"] = setting.fp32_precision
    else:
        values["TF32 matmuls"] = torch.backends.cuda.matmul.allow_tf32
        values["TF32 cuDNN"] = torch.backends.cudnn.allow_tf32
        values["float32 matmul precision"] = torch.get_float32_matmul_precision()
    return GlobalState(values, RngState.capture("cpu") if rng else None)


def _show(value: Any) -> str:
    return str(value).removeprefix("torch.")


@dataclass
class Guard:
    """What :func:`guarded` found: the changes once the body returned (None when it raised)."""

    changed: list[str] | None = None


@contextlib.contextmanager
def guarded(rng: bool) -> Iterator[Guard]:
    """Around one call of the code under test: the state before, compared after (``Guard.changed``),
    and restored whenever it changed or the body raised, so the next case starts as this one did.
    ``rng``: the CPU generator is put back too (a tensor target's call; a training run's generators
    are the harness's to seed and replay)."""
    before = snapshot(rng=rng)
    guard = Guard()
    try:
        yield guard
        guard.changed = before.changes(snapshot(rng=False))
    finally:
        if guard.changed == []:
            if before.rng is not None:
                before.rng.restore()  # the settings are as they were: only the generator moved
        else:
            before.restore()


def leak_message(who: str, changed: list[str], later: str, owner: str) -> str:
    """The sentence a leaked change fails a case with: ``who`` left it, ``later`` would have run so."""
    return (f"{who} left process-wide state changed: {'; '.join(changed)} (restored; every later {later} "
            f"in the process would have run so, and a golden been recorded so): restore what {owner} changes "
            "before it returns")
