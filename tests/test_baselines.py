"""baselines: atomic round trip, and damaged files named, never silently trusted."""
import json

import numpy as np
import pytest
import torch

from pytest_precision.baselines import SCHEMA_VERSION, BaselineError, BaselineStore, checksum, sanitize_key


def test_roundtrip_and_no_leftovers(tmp_path):
    store = BaselineStore(tmp_path)
    ref = torch.randn(3, 5, dtype=torch.float64)
    npz, meta = store.write("softmax/my target/unit", "fp16", {"reference": ref, "dq": ref * 2}, {"seed": 3})
    assert npz == tmp_path / "softmax" / "my_target" / "unit" / "fp16.npz"
    b = store.load("softmax/my target/unit", "fp16")
    assert torch.equal(b.arrays["reference"], ref.float()) and torch.equal(b.arrays["dq"], (ref * 2).float())
    assert b.meta["seed"] == 3
    assert b.meta["schema_version"] == SCHEMA_VERSION
    assert sorted(p.name for p in npz.parent.iterdir()) == ["fp16.json", "fp16.npz"]
    assert store.load("softmax/other", "fp16") is None


def test_companion_missing(tmp_path):
    store = BaselineStore(tmp_path)
    npz, meta = store.write("k", "fp32", {"reference": torch.ones(2)}, {})
    meta.unlink()
    with pytest.raises(BaselineError, match="fp32.json: missing"):
        store.load("k", "fp32")


def test_wrong_dtype_and_pickle_refused(tmp_path):
    store = BaselineStore(tmp_path)
    npz, _ = store.write("k", "fp32", {"reference": torch.ones(2)}, {})
    np.savez(npz, reference=np.ones(2, dtype=np.float64))
    with pytest.raises(BaselineError, match="reference has dtype float64, expected float32"):
        store.load("k", "fp32")
    np.savez(npz, reference=np.array([{"a": 1}], dtype=object))
    with pytest.raises(BaselineError, match=r"reference holds Python objects \(a pickle\): never loaded"):
        store.load("k", "fp32")


def test_json_not_an_object(tmp_path):
    store = BaselineStore(tmp_path)
    _, meta = store.write("k", "fp32", {"reference": torch.ones(2)}, {})
    meta.write_text(json.dumps([1, 2]))
    with pytest.raises(BaselineError, match="not a JSON object"):
        store.load("k", "fp32")


def test_keys_cannot_escape_the_root():
    assert sanitize_key("../../etc/x y") == "etc/x_y"
    assert sanitize_key("tests/test_a::test_b[fp16-3]") == "tests/test_a/test_b_fp16-3_"


def test_checksum_sees_dtype_shape_and_bits():
    x = torch.arange(6, dtype=torch.float32)
    assert checksum(x) == checksum(x.clone())
    assert len({checksum(x), checksum(x.reshape(2, 3)), checksum(x.double()), checksum(x + 1e-6)}) == 4


def test_project_baselines_carry_no_speed_records():
    """Timings belong to the machine that runs a user's CI; a record made here could match a CI
    runner's fingerprint and gate it against this machine (regenerate with --precision-no-speed)."""
    import json
    from pathlib import Path
    with_speed = [p for p in (Path(__file__).parent.parent / "baselines").rglob("*.json")
                  if "speed" in json.loads(p.read_text())]
    assert with_speed == []
