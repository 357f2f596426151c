"""python -m pytest_precision baselines list | show | diff | prune, on copies of the project's goldens."""
import io
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from pytest_precision.__main__ import default_dir, main
from pytest_precision.baselines.schema import BaselineError
from pytest_precision.baselines.tools import baseline_names, diff_lines, remove

GOLDENS = Path(__file__).resolve().parents[1] / "baselines"
SMALL = "softmax/torch.softmax/len32768"  # a few configs of one regime


def _copy(dst: Path) -> Path:
    shutil.copytree(GOLDENS / SMALL, dst / SMALL)
    return dst


def _cli(*argv, cwd):
    out = io.StringIO()
    code = main(list(argv), cwd=cwd, out=out)
    return code, out.getvalue()


def test_diff_prints_exactly_the_budget_that_moved(tmp_path):
    a, b = _copy(tmp_path / "a"), _copy(tmp_path / "b")
    meta_path = b / SMALL / "fp32.json"
    meta = json.loads(meta_path.read_text())
    old = meta["budgets"]["cpu-avx2"]["outputs"]["reference"]["budget"]["max_ulp"]
    meta["budgets"]["cpu-avx2"]["outputs"]["reference"]["budget"]["max_ulp"] = 240.0
    meta_path.write_text(json.dumps(meta, indent=2, sort_keys=True))

    code, out = _cli("baselines", "diff", str(a), str(b), cwd=tmp_path)
    assert out == f"{SMALL}/fp32 [cpu-avx2] reference max_ulp {old!r} -> 240.0\n"
    assert code == 1
    assert _cli("baselines", "diff", str(a), str(a), cwd=tmp_path) == (0, "")


def test_diff_names_files_budgets_and_tensors_on_one_side(tmp_path):
    a, b = _copy(tmp_path / "a"), _copy(tmp_path / "b")
    for suffix in (".npz", ".json"):
        (b / SMALL / f"bf16{suffix}").unlink()
    meta_path = b / SMALL / "fp16.json"
    meta = json.loads(meta_path.read_text())
    del meta["budgets"]["cpu-default"]
    meta_path.write_text(json.dumps(meta))
    with np.load(a / SMALL / "fp32.npz", allow_pickle=False) as z:
        ref = np.array(z["reference"])
    ref[0, 0] += 1e-3
    np.savez_compressed(b / SMALL / "fp32.npz", reference=ref)
    # as an update writes it: the JSON carries the checksum of its .npz (a pair written apart is an error)
    meta_path = b / SMALL / "fp32.json"
    meta = json.loads(meta_path.read_text())
    meta["npz_sha256"] = hashlib.sha256((b / SMALL / "fp32.npz").read_bytes()).hexdigest()
    meta_path.write_text(json.dumps(meta))

    lines = diff_lines(a, b)
    assert lines[:2] == [f"{SMALL}/bf16 only in {a}", f"{SMALL}/fp16 [cpu-default] reference budget only in {a}"]
    assert lines[-1] == f"{SMALL}/fp32 tensor reference changed in 1 of {ref.size} elements, max abs 0.001"
    # the values of a budget on one side only are shown too: a key added with a loose budget would
    # loosen every machine that borrows from it
    gone = [line for line in lines[2:-1] if line.startswith(f"{SMALL}/fp16 [cpu-default] ")]
    assert gone == lines[2:-1] and all(line.endswith(" -> None") for line in gone)
    assert any(line.startswith(f"{SMALL}/fp16 [cpu-default] reference max_ulp ") for line in gone)


def test_list_and_show(tmp_path):
    root = _copy(tmp_path / "gold")
    code, out = _cli("baselines", "list", "--dir", str(root), cwd=tmp_path)
    lines = out.splitlines()
    assert code == 0 and len(lines) == len(baseline_names(root)) == 6  # the configs a CPU runs (no tf32)
    assert lines[0].startswith(f"{SMALL}/amp-bf16  outputs reference; budgets for cpu-avx2,cpu-avx512,cpu-default")
    code, out = _cli("baselines", "show", f"{SMALL}/fp32", "--dir", str(root), cwd=tmp_path)
    assert code == 0 and "  tensors reference (2, 32768)" in out and "  [cpu-avx512] " in out
    assert "    reference: budget max_ulp " in out
    assert _cli("baselines", "show", f"{SMALL}/nope", "--dir", str(root), cwd=tmp_path)[0] == 2


def test_list_and_show_of_a_directory_that_is_not_there_exit_2_naming_it(tmp_path, capsys):
    """Before, `baselines list --dir nope_dir` (or a file) exited 0 printing nothing."""
    (tmp_path / "afile").write_text("")
    for name, said in (("nope_dir", "no such directory"), ("afile", "not a directory")):
        for action in (("list",), ("show", "softmax/x/unit/fp32")):
            code, out = _cli("baselines", *action, "--dir", name, cwd=tmp_path)
            assert (code, out) == (2, ""), (action, name)
            assert f"{tmp_path / name}: {said}" in capsys.readouterr().err


def test_default_dir_comes_from_pyproject(tmp_path):
    assert default_dir(tmp_path) == tmp_path / "precision_baselines"
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\nprecision_baseline_dir = "goldens"\n')
    assert default_dir(tmp_path) == tmp_path / "goldens"


def _save_unused(cwd: Path, root: Path, unused, reason=None):
    cache = cwd / ".pytest_cache" / "v" / "pytest_precision" / "unused_baselines"
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"root": str(root), "unused": unused, **({"reason": reason} if reason else {})}))


def test_prune_removes_what_the_last_run_listed(tmp_path):
    root = _copy(tmp_path / "precision_baselines")
    _save_unused(tmp_path, root, [f"{SMALL}/fp16", f"{SMALL}/bf16"])
    code, out = _cli("baselines", "prune", "--dry-run", cwd=tmp_path)
    assert code == 0 and f"would remove {SMALL}/bf16.json" in out and "would remove 4 file(s)" in out
    assert len(baseline_names(root)) == 6
    code, out = _cli("baselines", "prune", cwd=tmp_path)
    assert code == 0 and "removed 4 file(s) of 2 unused baseline(s)" in out
    assert [n.rsplit("/", 1)[1] for n in baseline_names(root)] == ["amp-bf16", "amp-fp16", "fp32", "fp8-e4m3"]


def test_prune_refuses_without_a_complete_list(tmp_path):
    root = _copy(tmp_path / "precision_baselines")
    assert _cli("baselines", "prune", cwd=tmp_path)[0] == 2  # no run yet
    _save_unused(tmp_path, root, None, reason="the run stopped at the first failures (-x, --maxfail)")
    assert _cli("baselines", "prune", cwd=tmp_path)[0] == 2
    _save_unused(tmp_path, tmp_path / "elsewhere", [f"{SMALL}/fp16"])
    assert _cli("baselines", "prune", cwd=tmp_path)[0] == 2
    assert len(baseline_names(root)) == 6


def test_remove_stays_under_the_root(tmp_path):
    root = _copy(tmp_path / "gold")
    (tmp_path / "outside.json").write_text("{}")
    with pytest.raises(BaselineError):
        remove(root, ["../outside"])
    remove(root, [f"{SMALL}/{c}" for c in ("amp-bf16", "amp-fp16", "bf16", "fp16", "fp32", "fp8-e4m3")])
    assert not (root / "softmax").exists() and root.exists()  # emptied directories go too


def test_training_baselines_show_and_diff(tmp_path):
    """Training goldens file their own budget fields under the output 'trajectory'."""
    name = "train_step/tiny_gpt/trajectory"
    for side in ("a", "b"):
        shutil.copytree(GOLDENS / name, tmp_path / side / name)
    code, out = _cli("baselines", "show", f"{name}/amp-fp16", "--dir", str(tmp_path / "a"), cwd=tmp_path)
    assert code == 0, out
    assert "    trajectory: budget first_nonfinite_step None, max_grad_norm_log_ratio " in out
    assert "    trajectory: accepted first_nonfinite_step None, grad_norm_ratio " in out
    meta_path = tmp_path / "b" / name / "amp-fp16.json"
    meta = json.loads(meta_path.read_text())
    old = meta["budgets"]["cpu-avx2"]["outputs"]["trajectory"]["budget"]["max_loss_deviation"]
    meta["budgets"]["cpu-avx2"]["outputs"]["trajectory"]["budget"]["max_loss_deviation"] = 0.5
    meta_path.write_text(json.dumps(meta, indent=2, sort_keys=True))
    code, out = _cli("baselines", "diff", str(tmp_path / "a"), str(tmp_path / "b"), cwd=tmp_path)
    assert out == f"{name}/amp-fp16 [cpu-avx2] trajectory max_loss_deviation {old!r} -> 0.5\n" and code == 1


def test_budget_fields_are_the_budgets():
    """``show`` and ``diff`` tell a tensor budget from a training one by its fields: all of Budget's."""
    import dataclasses

    from pytest_precision.baselines.tools import BUDGET_FIELDS
    from pytest_precision.numerics.budgets import Budget

    assert set(BUDGET_FIELDS) == {f.name for f in dataclasses.fields(Budget)}
