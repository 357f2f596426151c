"""torch's global random generators at one moment, captured and replayed: a re-run of a target's
call or of a training step (the float64 run, the traced re-runs that locate a first fault) starts
from the state the run it explains had, so it draws the same dropout masks."""
from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass

import torch

__all__ = ["RngState", "cuda_index", "forked_rng"]


@dataclass(frozen=True)
class RngState:
    """torch's global generators at one moment: the CPU one and, for a run on a CUDA device, that
    device's."""

    cpu: torch.Tensor
    cuda: tuple[int, torch.Tensor] | None = None

    @classmethod
    def capture(cls, device: str) -> "RngState":
        cuda = None
        if torch.device(device).type == "cuda":
            index = cuda_index(device)
            cuda = (index, torch.cuda.get_rng_state(index))
        return cls(torch.get_rng_state(), cuda)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda[1], self.cuda[0])

    @property
    def digest(self) -> str:
        h = hashlib.sha256(self.cpu.numpy().tobytes())
        if self.cuda is not None:
            h.update(f"cuda{self.cuda[0]}".encode() + self.cuda[1].numpy().tobytes())
        return h.hexdigest()

    @contextlib.contextmanager
    def replayed(self):
        """Inside: torch's generators at this state; the caller's are back on exit."""
        with self.forked():
            self.restore()
            yield

    def forked(self) -> contextlib.AbstractContextManager:
        """``torch.random.fork_rng`` over the generators this state holds: what runs inside may
        draw, the caller's states are back on exit."""
        return torch.random.fork_rng(devices=[self.cuda[0]] if self.cuda is not None else [], device_type="cuda")


def cuda_index(device: str) -> int:
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def forked_rng(device: str) -> contextlib.AbstractContextManager:
    devices = [cuda_index(device)] if torch.device(device).type == "cuda" else []
    return torch.random.fork_rng(devices=devices, device_type="cuda")
