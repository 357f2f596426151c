"""Suite inputs have the same bits on every CPU: a golden's input checksum must not change with
the CI runner's vector ISA (torch's float32 randn does, see pytest_precision.numerics.inputs)."""
import json
import os
import subprocess
import sys

import torch

from pytest_precision.baselines import checksum
from pytest_precision.numerics.inputs import seeded_normal

_CHECKSUMS = """
import json
from pytest_precision.baselines import checksum
from pytest_precision.suites import attention, softmax
sums = {f"softmax/{n}": checksum(r.inputs()) for n, r in softmax.REGIMES.items()}
for n, r in attention.REGIMES.items():
    a = r.inputs()
    sums.update({f"attention/{n}/{part}": checksum(getattr(a, part)) for part in ("q", "k", "v")})
print(json.dumps(sums))
"""


def _suite_input_checksums(capability: str) -> dict:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    r = subprocess.run([sys.executable, "-c", _CHECKSUMS], env=env, capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_suite_inputs_do_not_depend_on_the_cpu_vector_isa():
    native = torch.backends.cpu.get_cpu_capability().lower()
    scalar = _suite_input_checksums("default")
    assert scalar == _suite_input_checksums(native)
    assert len(scalar) > 20


def test_seeded_normal_is_one_rounding_of_the_float64_draw():
    g = torch.Generator().manual_seed(7)
    x = seeded_normal(g, 4, 33, scale=5.0, shift=-1000.0)
    ref = torch.randn(4, 33, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * 5.0 - 1000.0
    assert x.dtype == torch.float32 and torch.equal(x, ref.float())
    assert checksum(x) == checksum(seeded_normal(torch.Generator().manual_seed(7), 4, 33, scale=5.0, shift=-1000.0))
