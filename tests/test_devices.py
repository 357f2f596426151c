"""Which device a result came from: xdist workers pinned to their own GPU, and the fingerprint
speed records are keyed by naming the GPU a worker ran on. CUDA is faked where a test needs it:
the logic is a function of the worker id and the device count."""
import pytest
import torch

from pytest_precision.platform import devices
from pytest_precision.platform.devices import fingerprint, pin_xdist_worker, xdist_worker_device


@pytest.mark.parametrize("worker,count,expected", [
    (None, 4, None), ("", 4, None),          # not an xdist worker
    ("gw0", 0, None),                         # no GPU
    ("gw0", 4, 0), ("gw3", 4, 3),             # one GPU each
    ("gw4", 4, 0), ("gw7", 4, 3),             # more workers than GPUs: shared evenly
    ("gw5", 1, 0),
])
def test_worker_n_runs_on_device_n_mod_count(worker, count, expected):
    assert xdist_worker_device(worker, count) == expected


def test_an_unknown_worker_id_is_an_error_naming_it():
    with pytest.raises(ValueError, match="PYTEST_XDIST_WORKER='node-a'"):
        xdist_worker_device("node-a", 2)


class FakeCuda:
    """torch.cuda as a machine with ``names`` GPUs; remembers the current device."""

    def __init__(self, monkeypatch, names):
        self.names, self.current, self.set_calls = names, 0, []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "get_device_name", self.get_device_name)

    def set_device(self, index):
        self.set_calls.append(index)
        self.current = index

    def get_device_name(self, device=None):
        index = self.current if device in (None, "cuda") else torch.device(device).index
        return self.names[index]


def test_a_worker_is_pinned_to_its_gpu_and_its_speed_records_name_that_gpu(monkeypatch):
    cuda = FakeCuda(monkeypatch, ["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"])
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    assert pin_xdist_worker("cuda") == 1
    assert cuda.set_calls == [1]
    assert fingerprint("cuda").startswith("NVIDIA H100 80GB HBM3, CUDA")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
    assert pin_xdist_worker("cuda") == 0
    assert fingerprint("cuda").startswith("NVIDIA A100-SXM4-80GB, CUDA")


def test_nothing_is_pinned_on_the_cpu_or_outside_xdist(monkeypatch):
    cuda = FakeCuda(monkeypatch, ["gpu0", "gpu1"])
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    assert pin_xdist_worker("cpu") is None
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert pin_xdist_worker("cuda") is None
    assert cuda.set_calls == []
    monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    assert pin_xdist_worker("cuda") is None and cuda.set_calls == []
