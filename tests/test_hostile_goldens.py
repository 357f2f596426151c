"""A golden in a pull request is untrusted input: what a hostile file can no longer do.

Each test is one scenario of a trial of bad inputs (issue 24): a golden that would exhaust memory
(a deflate bomb, a link to /dev/zero, a FIFO, a 9 MB string), fields that would switch the gate off
without ``baselines diff`` showing them (peer errors, speed records, a NaN or infinite limit),
writes and deletes that would leave the baseline directory (a target directory linked to another
project, prune of links), duplicate members and keys, two update processes on one directory,
hostile links and cache entries given to the command line, and names Windows reserves."""
import io
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from pytest_precision.__main__ import main
from pytest_precision.baselines.reading import MAX_JSON_BYTES, read_arrays, read_meta
from pytest_precision.baselines.schema import BaselineError
from pytest_precision.baselines.store import BaselineStore, name_problem
from pytest_precision.baselines.tensors import MAX_PEER_SCALE, TensorOutput, TensorOutputs
from pytest_precision.numerics.metrics import ComparisonSpec
from pytest_precision.baselines.tools import baseline_names, diff_lines, remove
from pytest_precision.numerics.budgets import Budget
from pytest_precision.numerics.metrics import compare

from sample_targets import CORRECT_SOFTMAX_CONFTEST as CONFTEST

pytest_plugins = ["pytester"]

ARGS = ("--precision-suite", "--precision-configs=fp32", "--precision-no-speed", "-p", "no:cacheprovider",
        "-k", "softmax and mine-fp32-unit")
UPDATE = "--precision-update-baselines"


def _accepted(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.runpytest(*ARGS, UPDATE).assert_outcomes(passed=1)
    d = pytester.path / "precision_baselines" / "softmax" / "mine" / "unit"
    return d / "fp32.npz", d / "fp32.json"


def _cli(*argv, cwd):
    out = io.StringIO()
    code = main(list(argv), cwd=cwd, out=out)
    return code, out.getvalue()


def _bomb(path: Path, elements: int = 1 << 28, name: str = "reference") -> Path:
    """An .npz of ~1 MiB whose one member declares ``elements`` float32 zeros (1 GiB), consistent
    in every header: what a reader that trusts them inflates."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (elements,)})
    chunk = bytes(1 << 22)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        info = zipfile.ZipInfo(f"{name}.npy")
        info.compress_type = zipfile.ZIP_DEFLATED
        with archive.open(info, "w", force_zip64=True) as f:
            f.write(header.getvalue())
            for _ in range(elements * 4 // len(chunk)):
                f.write(chunk)
    return path


@pytest.fixture(scope="module")
def bomb(tmp_path_factory) -> bytes:
    path = _bomb(tmp_path_factory.mktemp("bomb") / "bomb.npz")
    assert path.stat().st_size < 2 << 20
    return path.read_bytes()


# ---- resource exhaustion -----------------------------------------------------------------------

_MEASURE = """
import json, resource, sys, time
from pathlib import Path
from pytest_precision.baselines.schema import BaselineError
from pytest_precision.baselines.store import BaselineStore
from pytest_precision.baselines.tools import list_lines, show_lines, diff_lines
root = Path(sys.argv[1])
start = time.monotonic()
errors = []
try:
    BaselineStore(root).load("softmax/mine/unit", "fp32", {"reference": (2, 8)})
except BaselineError as e:
    errors.append(str(e))
for call in (lambda: list_lines(root, errors), lambda: show_lines(root, "softmax/mine/unit/fp32", errors),
             lambda: diff_lines(root, root, errors)):
    try:
        call()
    except BaselineError as e:
        errors.append(str(e))
print(json.dumps({"rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "seconds": time.monotonic() - start, "errors": errors}))
"""


def _capped():
    # a safety net: a regression that reads without bound fails here instead of taking the machine
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


def _measured(root: Path) -> dict:
    """Reading ``root``'s golden in a fresh process under a 3 GiB address-space cap: its peak
    memory, time and errors."""
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(root)], capture_output=True, text=True, timeout=120,
                          preexec_fn=_capped)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def _baseline_rss() -> float:
    code = "import resource, torch, numpy; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def _one_golden(tmp_path: Path) -> tuple[Path, Path]:
    store = BaselineStore(tmp_path / "gold")
    return store.write("softmax/mine/unit", "fp32", {"reference": torch.ones(2, 8)}, {})


def _plant(npz: Path, meta: Path, how: str, bomb: bytes) -> str:
    """Make the golden hostile; returns what every error must say."""
    if how == "deflate bomb":  # 1 MiB declaring 1 GiB
        npz.write_bytes(bomb)
        return "not read"
    if how == "link to /dev/zero":
        npz.unlink()
        npz.symlink_to("/dev/zero")
        return "a link that leads outside the baseline directory"
    if how == "FIFO":  # no writer: a blocking open would wait for ever
        npz.unlink()
        os.mkfifo(npz)
        return "a FIFO, not a regular file"
    meta.write_text(json.dumps({"schema_version": 1, "torch": "x" * (MAX_JSON_BYTES + 1)}))  # a 9 MB JSON
    return "more than the"


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not os.path.exists("/dev/zero"), reason="POSIX files")
@pytest.mark.parametrize("how", ["deflate bomb", "link to /dev/zero", "FIFO", "9 MB string"])
def test_a_hostile_golden_costs_bounded_memory_and_time_in_a_check_list_show_and_diff(tmp_path, bomb, how):
    npz, meta = _one_golden(tmp_path)
    said = _plant(npz, meta, how, bomb)
    got = _measured(tmp_path / "gold")
    # a reader that trusted the bomb's headers held 1 GiB (2.3 GB peak measured before); one that
    # read /dev/zero, until memory ran out; here only what importing torch costs
    assert got["rss_mib"] < _baseline_rss() + 200, got
    assert got["seconds"] < 30
    assert got["errors"] and all(said in e and len(e) < 1000 for e in got["errors"]), got["errors"]
    if how == "deflate bomb":
        assert any("larger than this case's output (2, 8)" in e for e in got["errors"])  # the check: the case's shape
        assert any("a golden may inflate to" in e for e in got["errors"])  # the tools: the overall cap


def test_a_deflate_bomb_in_a_check_fails_the_case_naming_the_file(pytester, bomb):
    npz, _ = _accepted(pytester)
    npz.write_bytes(bomb)
    start = time.monotonic()
    result = pytester.runpytest(*ARGS)
    assert time.monotonic() - start < 60
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"*FAIL baseline ({npz}: reference is (268435456,), larger than this case's output*"])


def test_a_directory_under_a_goldens_name_is_refused_not_read(tmp_path):
    npz, meta = _one_golden(tmp_path)
    npz.unlink()
    npz.mkdir()
    with pytest.raises(BaselineError, match="a directory, not a regular file"):
        BaselineStore(tmp_path / "gold").load("softmax/mine/unit", "fp32")
    code, out = _cli("baselines", "list", "--dir", str(tmp_path / "gold"), cwd=tmp_path)
    assert code == 2 and "unreadable" in out


def test_a_link_inside_the_directory_is_followed(tmp_path):
    npz, meta = _one_golden(tmp_path)
    moved = npz.with_name("elsewhere.npz.data")
    npz.rename(moved)
    npz.symlink_to(moved.name)
    assert BaselineStore(tmp_path / "gold").load("softmax/mine/unit", "fp32").arrays["reference"].shape == (2, 8)


def test_a_huge_string_or_file_is_refused_and_never_echoed_in_full(tmp_path, pytester):
    npz, meta_path = _accepted(pytester)
    meta = json.loads(meta_path.read_text())
    meta["torch"] = "x" * 100_000  # under the size cap, over the string cap
    meta_path.write_text(json.dumps(meta))
    result = pytester.runpytest(*ARGS)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*torch is a string of 100000 characters, more than the 4096 a golden holds*"])
    assert "x" * 200 not in result.stdout.str()
    assert max(map(len, result.stdout.lines)) < 2000

    meta["torch"] = "y" * (MAX_JSON_BYTES + 1)  # over the size cap: not even parsed
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(BaselineError, match=f"bytes, more than the {MAX_JSON_BYTES} a golden may be"):
        read_meta(meta_path)
    code, out = _cli("baselines", "show", "softmax/mine/unit/fp32", "--dir", "precision_baselines", cwd=pytester.path)
    assert code == 2 and len(out) < 2000


def test_a_hostile_value_is_shortened_where_it_is_shown(tmp_path):
    npz, meta_path = _one_golden(tmp_path)
    meta = json.loads(meta_path.read_text())
    meta["written_on"] = "w" * 4000  # within the string cap: shown, shortened
    meta_path.write_text(json.dumps(meta))
    code, out = _cli("baselines", "show", "softmax/mine/unit/fp32", "--dir", str(tmp_path / "gold"), cwd=tmp_path)
    assert code == 0 and "(4000 characters)" in out and "w" * 200 not in out


# ---- the gate cannot be switched off unseen ------------------------------------------------------

def _edit(path: Path, change) -> None:
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta, indent=2, sort_keys=True))


def _two_copies(pytester) -> tuple[Path, Path, str]:
    _accepted(pytester)
    a, b = pytester.path / "a", pytester.path / "b"
    shutil.copytree(pytester.path / "precision_baselines", a)
    shutil.copytree(pytester.path / "precision_baselines", b)
    key = next(iter(json.loads((a / "softmax/mine/unit/fp32.json").read_text())["budgets"]))
    return a, b, key


def test_diff_shows_the_peer_errors_a_borrowed_budget_is_scaled_by(pytester):
    a, b, key = _two_copies(pytester)

    def tiny_peer(meta):
        for f in ("max_ulp", "mean_ulp", "max_abs", "rms_abs"):
            meta["budgets"][key]["outputs"]["reference"]["peer"][f] = 1e-300
    _edit(b / "softmax/mine/unit/fp32.json", tiny_peer)
    code, out = _cli("baselines", "diff", str(a), str(b), cwd=pytester.path)
    assert code == 1
    assert f"softmax/mine/unit/fp32 [{key}] reference peer max_ulp " in out and "-> 1e-300" in out
    assert out.count("-> 1e-300") == 4


def test_a_stored_peer_error_cannot_scale_a_borrowed_budget_past_what_machines_differ_by():
    out = torch.tensor([0.25, 0.75])
    ref = out.double()
    peer = compare(out + 1e-7, ref, torch.float32)
    entry = TensorOutputs({"reference": TensorOutput(out, ref, ComparisonSpec(torch.float32), peer=peer)})
    record = {"budget": Budget(max_ulp=4.0, mean_ulp=1.0).as_dict(), "peer": {"max_ulp": 1e-300, "mean_ulp": 1e-300}}
    budget = entry.budget_from("reference", [record], borrowed=True)
    cap = MAX_PEER_SCALE["same device type"]
    assert budget.max_ulp <= 4.0 * cap and budget.mean_ulp <= 1.0 * cap
    assert f"at most {cap:g} x" in entry.borrowed_clause() and "edited golden" in entry.borrowed_clause()


def test_diff_shows_speed_records_and_every_other_stored_field(pytester):
    a, b, key = _two_copies(pytester)
    fp = "this machine, timed on 1 thread"
    record = {"median_s": 1e-4, "spread": 0.01, "samples": [1e-4] * 3, "calibration": [], "peak_bytes": None}
    _edit(a / "softmax/mine/unit/fp32.json", lambda m: m.update(speed={fp: record}))

    def slower(meta):
        meta["speed"] = {fp: {**record, "median_s": 0.1, "samples": [0.1] * 3}}
        meta["seed"] = 12345
        meta["budgets"][key]["outputs"]["reference"]["accepted"]["max_ulp"] = 0.0
    _edit(b / "softmax/mine/unit/fp32.json", slower)
    code, out = _cli("baselines", "diff", str(a), str(b), cwd=pytester.path)
    assert code == 1
    lines = out.splitlines()
    assert f"softmax/mine/unit/fp32 speed [{fp}] median_s 0.0001 -> 0.1" in lines
    assert f"softmax/mine/unit/fp32 speed [{fp}] samples [0.0001, 0.0001, 0.0001] -> [0.1, 0.1, 0.1]" in lines
    assert any(line.startswith("softmax/mine/unit/fp32 seed ") and line.endswith("-> 12345") for line in lines)
    assert any(f"[{key}] reference accepted max_ulp " in line for line in lines)


@pytest.mark.parametrize("field, value, said", [
    ("max_ulp", "NaN", "is NaN: a NaN limit judges nothing"),
    ("max_ulp", "Infinity", "is inf: a limit that lets every result pass"),
    ("overflow", "Infinity", "is inf: a limit that lets every result pass"),
])
def test_a_nan_or_infinite_limit_is_refused_not_read_as_no_limit(pytester, field, value, said):
    npz, meta_path = _accepted(pytester)
    text = meta_path.read_text()
    meta = json.loads(text)
    meta["budgets"][next(iter(meta["budgets"]))]["outputs"]["reference"]["budget"][field] = "__X__"
    meta_path.write_text(json.dumps(meta).replace('"__X__"', value))
    result = pytester.runpytest(*ARGS)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"*FAIL baseline ({meta_path}: corrupt baseline metadata (budgets.*.outputs."
                                 f"reference.budget.{field} {said}*"])


def test_the_infinities_pytest_precision_writes_are_read():
    """A training golden's ``min_*`` SQNR limits are +Infinity where fp32 was exact: the project's
    own goldens all read."""
    root = Path(__file__).resolve().parents[1] / "baselines"
    for name in baseline_names(root):
        read_meta(root / f"{name}.json", root)


# ---- writes and deletes stay where they say ----------------------------------------------------

def test_update_through_a_directory_link_to_another_project_writes_nothing_there(pytester):
    npz, meta_path = _accepted(pytester)
    other = pytester.path / "other_project" / "precision_baselines" / "softmax"
    other.mkdir(parents=True)
    target_dir = pytester.path / "precision_baselines" / "softmax" / "mine"
    shutil.move(str(target_dir), str(other / "mine"))
    target_dir.symlink_to(other / "mine", target_is_directory=True)
    theirs = {p: p.read_bytes() for p in (other / "mine").rglob("*") if p.is_file()}

    checked = pytester.runpytest(*ARGS)
    checked.assert_outcomes(failed=1)
    checked.stdout.fnmatch_lines(["*a link that leads outside the baseline directory*not read*"])
    result = pytester.runpytest(*ARGS, UPDATE)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"*cannot write the golden baseline: {npz.parent}: a link that leads outside the "
                                 f"baseline directory * (to {other / 'mine' / 'unit'}); nothing written*"])
    assert {p: p.read_bytes() for p in (other / "mine").rglob("*") if p.is_file()} == theirs


def test_prune_of_links_removes_the_links_not_the_golden_they_point_to(tmp_path):
    root = tmp_path / "gold"
    store = BaselineStore(root)
    npz, meta = store.write("softmax/mine/unit", "fp32", {"reference": torch.ones(2, 8)}, {})
    kept = {p: p.read_bytes() for p in (npz, meta)}
    stale = root / "softmax" / "mine" / "old"
    stale.mkdir()
    for p in (npz, meta):
        (stale / p.name).symlink_to(p)
    removed = remove(root, ["softmax/mine/old/fp32"])
    assert sorted(p.name for p in removed) == ["fp32.json", "fp32.npz"]
    assert not stale.exists()
    assert {p: p.read_bytes() for p in (npz, meta)} == kept


def test_prune_refuses_a_name_through_a_directory_link_leaving_the_root(tmp_path):
    root = tmp_path / "gold"
    elsewhere = BaselineStore(tmp_path / "elsewhere")
    npz, _ = elsewhere.write("x", "fp32", {"reference": torch.ones(2)}, {})
    root.mkdir()
    (root / "x").symlink_to(npz.parent, target_is_directory=True)
    with pytest.raises(BaselineError, match="leads outside"):
        remove(root, ["x/fp32"])
    assert npz.exists()


_WRITER = """
import sys, torch
from pytest_precision.baselines.store import BaselineStore
store = BaselineStore(sys.argv[1])
for round in range(3):
    for i in range(60):
        store.write(f"k{i % 3}", f"c{i}", {"reference": torch.full((4,), float(round))}, {"writer": sys.argv[2]})
"""


def test_two_update_processes_on_one_directory_lose_nothing_and_report_nothing_false(tmp_path):
    root = tmp_path / "gold"
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(root), w], stderr=subprocess.PIPE, text=True)
             for w in ("a", "b")]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    store = BaselineStore(root)
    for i in range(60):
        base = store.load(f"k{i % 3}", f"c{i}")  # every pair whole: one writer's two halves
        assert base.arrays["reference"].tolist() == [2.0] * 4
    assert not list(root.rglob("*.tmp"))


def test_a_leftover_of_a_live_writer_is_kept_and_of_a_dead_one_removed(tmp_path):
    store = BaselineStore(tmp_path)
    npz, _ = store.write("k", "fp32", {"reference": torch.ones(2)}, {})
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = npz.parent / f".fp32.npz.{sleeper.pid}.abc.tmp"
        dead = npz.parent / ".fp32.npz.999999999.abc.tmp"
        live.write_bytes(b"x")
        dead.write_bytes(b"x")
        store.write("k", "fp32", {"reference": torch.ones(2)}, {})
        assert live.exists() and not dead.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


# ---- confusing before, clear now -----------------------------------------------------------------

def test_duplicate_npz_members_are_refused(tmp_path):
    npz, _ = _one_golden(tmp_path)
    buf = io.BytesIO()
    np.save(buf, np.ones((2, 8), dtype=np.float32))
    with zipfile.ZipFile(npz, "a") as archive:
        with pytest.warns(UserWarning, match="Duplicate name"):
            archive.writestr("reference.npy", buf.getvalue())
    with pytest.raises(BaselineError, match="the member reference.npy appears 2 times"):
        read_arrays(npz)


def test_duplicate_json_keys_are_refused(tmp_path):
    _, meta_path = _one_golden(tmp_path)
    text = meta_path.read_text()
    meta_path.write_text(text.replace('"schema_version": 1', '"schema_version": 1, "schema_version": 1', 1))
    with pytest.raises(BaselineError, match="the key 'schema_version' appears 2 times"):
        read_meta(meta_path)


def test_hostile_links_and_cache_entries_are_input_errors_not_internal_ones(tmp_path):
    root = tmp_path / "precision_baselines"
    BaselineStore(root).write("k", "fp32", {"reference": torch.ones(2)}, {})
    (root / "loop").symlink_to(root, target_is_directory=True)  # a directory loop
    (root / "k" / "dangling.json").symlink_to(tmp_path / "nowhere.json")
    code, out = _cli("baselines", "list", cwd=tmp_path)
    assert code == 2 and "k/fp32  outputs" in out
    cache = tmp_path / ".pytest_cache" / "v" / "pytest_precision" / "unused_baselines"
    cache.parent.mkdir(parents=True)
    for saved in ([1, 2], {"root": str(root), "unused": [1]}, {"root": 5, "unused": []}, "[not json"):
        cache.write_text(saved if isinstance(saved, str) else json.dumps(saved))
        assert _cli("baselines", "prune", cwd=tmp_path)[0] == 2
    cache.write_text(json.dumps({"root": str(root), "unused": ["../../outside"]}))
    assert _cli("baselines", "prune", cwd=tmp_path)[0] == 2
    cache.unlink()
    cache.symlink_to("/dev/zero")
    assert _cli("baselines", "prune", cwd=tmp_path)[0] == 2
    assert (root / "k" / "fp32.npz").exists()


@pytest.mark.parametrize("name", ["CON", "nul", "com1.txt", "LPT9", "aux.tar.gz", "trailing."])
def test_names_windows_cannot_hold_are_refused(pytester, name):
    assert name_problem(name) is not None
    pytester.makeconftest(CONFTEST.replace('"mine"', repr(name)))
    result = pytester.runpytest(*ARGS[:-2])
    assert result.ret != 0
    said = result.stdout.str() + result.stderr.str()
    assert f"target name {name!r}" in said and ("names a device on Windows" in said or "not ending with ." in said)


def test_names_near_the_reserved_ones_are_names():
    assert [name_problem(n) for n in ("console", "nullable", "com10", "aux_", "lpt")] == [None] * 5


def test_an_update_line_names_a_moved_peer_error():
    out = torch.tensor([0.25, 0.75])
    entry = TensorOutputs({"reference": TensorOutput(out, out.double(), ComparisonSpec(torch.float32))})
    budget = Budget(max_ulp=4.0).as_dict()
    old = {"reference": {"budget": budget, "peer": {"max_ulp": 1e-300, "mean_ulp": 0.5, "max_abs": math.nan}}}
    new = {"reference": {"budget": budget, "peer": {"max_ulp": 5.0, "mean_ulp": 0.5, "max_abs": math.nan}}}
    assert entry.changes(old, new) == ["peer max_ulp 1e-300 -> 5.0"]  # NaN to NaN is no change


@pytest.mark.parametrize("accepted_ratio, refused", [(math.inf, False), (0.0, False), (1.5, True)])
def test_an_unlimited_training_limit_is_read_only_where_what_was_accepted_was_not_finite(tmp_path, accepted_ratio,
                                                                                         refused):
    """A training golden accepted with a gradient norm that overflowed has no finite limit on it, as
    pytest-precision writes it; the same Infinity beside a finite accepted ratio is an edit."""
    from pytest_precision.baselines.schema import unlimited
    from pytest_precision.reporting.summary import case_lines

    _, meta_path = _one_golden(tmp_path)
    entry = {"budget": {"max_grad_norm_log_ratio": math.inf, "max_loss_deviation": 0.1},
             "accepted": {"grad_norm_ratio": accepted_ratio, "max_loss_deviation": 0.05}}
    _edit(meta_path, lambda m: m.update(budgets={"cpu-x": {"outputs": {"trajectory": entry}}}))
    if refused:
        with pytest.raises(BaselineError, match="max_grad_norm_log_ratio is inf: a limit that lets every result pass"):
            read_meta(meta_path)
        return
    read_meta(meta_path)
    assert unlimited(entry) == [f"max_grad_norm_log_ratio (accepted grad_norm_ratio {accepted_ratio!r})"]
    line = case_lines([{"target": "t", "nodeid": "suite::train_step[t-amp-fp16-noscale]",
                        "unjudged_limits": "not judged on ..."}])
    assert line == ["1 case(s) judged by goldens holding an unlimited limit (what they accepted was not finite, so "
                    "that metric is not judged): suite::train_step[t-amp-fp16-noscale]"]


def test_a_comment_after_the_baseline_directory_in_the_ini_is_a_usage_error(pytester):
    """pytest's ini files take the rest of the line as the value: the README's example once put
    goldens in a directory named 'precision_baselines   ; the default, relative to the rootdir'."""
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nprecision_baseline_dir = precision_baselines   ; the default\n")
    result = pytester.runpytest(*ARGS, UPDATE)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "a comment after the value would name the directory" in result.stderr.str()
    assert not [p for p in pytester.path.iterdir() if p.name.startswith("precision_baselines")]


# ---- what a review found a hostile golden could still do ----------------------------------------

def _npz_with(path: Path, members: list[tuple[str, bytes, int]]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data, method in members:
            info = zipfile.ZipInfo(name)
            info.compress_type = method
            archive.writestr(info, data)
    return path


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def test_a_member_compressed_with_bzip2_or_lzma_is_refused_before_a_byte_is_inflated(tmp_path):
    for method in (zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA):
        npz = _npz_with(tmp_path / f"m{method}.npz", [("reference.npy", _npy(np.ones(4, np.float32)), method)])
        with pytest.raises(BaselineError, match=f"compressed with method {method}, not stored or deflated"):
            read_arrays(npz)


def test_an_npy_header_declaring_gigabytes_is_refused_from_its_length(tmp_path):
    data = b"\x93NUMPY\x02\x00" + ((1 << 32) - 1).to_bytes(4, "little") + b" " * 64
    npz = _npz_with(tmp_path / "h.npz", [("reference.npy", data, zipfile.ZIP_DEFLATED)])
    with pytest.raises(BaselineError, match="declares a header of 4294967295 bytes"):
        read_arrays(npz)


def test_an_archive_declaring_more_members_than_a_golden_holds_is_refused_before_parsing(tmp_path):
    npz = _npz_with(tmp_path / "many.npz", [(f"a{i}.npy", b"", zipfile.ZIP_STORED) for i in range(100)])
    with pytest.raises(BaselineError, match="declares 100 members, more than the 64"):
        read_arrays(npz)


@pytest.mark.parametrize("text, said", [
    ('{"schema_version": 1, ' + ", ".join(['"k": 1'] * 20000) + "}", "the key 'k' appears 20000 times"),
    ('{"schema_version": 1, "seed": ' + "9" * 400 + "}", "an integer of 400 digits"),
    ('{"schema_version": 1, "input_spec": {"a": ' + "[" * 400 + "]" * 400 + "}}", "levels deep, more than the 12"),
])
def test_json_that_would_cost_time_or_crash_is_refused_quickly(tmp_path, text, said):
    _, meta_path = _one_golden(tmp_path)
    meta_path.write_text(text)
    start = time.monotonic()
    with pytest.raises(BaselineError, match=re.escape(said)):
        read_meta(meta_path)
    assert time.monotonic() - start < 2


def test_a_speed_record_with_a_null_sample_is_refused(tmp_path):
    _, meta_path = _one_golden(tmp_path)
    _edit(meta_path, lambda m: m.update(speed={"fp": {"median_s": 1e-4, "samples": [1e-4, None]}}))
    with pytest.raises(BaselineError, match="speed.fp.samples is not a list of numbers"):
        read_meta(meta_path)


def test_an_update_creates_nothing_outside_through_a_link_before_refusing(tmp_path):
    root = tmp_path / "gold"
    root.mkdir()
    (root / "softmax").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(OSError, match="leads outside the baseline directory"):
        BaselineStore(root).write("softmax/mine/unit", "fp32", {"reference": torch.ones(2)}, {})
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_names_from_a_golden_reach_the_terminal_without_their_escapes(tmp_path):
    a = tmp_path / "a"
    b = tmp_path / "b"
    for side in (a, b):
        BaselineStore(side).write("k", "fp32", {"reference": torch.ones(2)},
                                  {"budgets": {"cpu-x": {"outputs": {"reference": {"budget": {"max_ulp": 2.0}}}}}})
    _edit(b / "k" / "fp32.json", lambda m: m["budgets"]["cpu-x"]["outputs"]["reference"]["budget"].update(
        {"\x1b[1A\x1b[2K\r": 1.0}))
    out = "\n".join(diff_lines(a, b))
    assert "\x1b" not in out and "\\x1b[1A" in out


def test_a_training_golden_accepted_with_a_non_finite_sqnr_reads_and_says_so(tmp_path):
    from pytest_precision.baselines.schema import unlimited

    _, meta_path = _one_golden(tmp_path)
    entry = {"budget": {"min_param_sqnr_db": -math.inf, "min_grad_sqnr_db": {"w": -math.inf, "b": 40.0}},
             "accepted": {"param_sqnr_db": math.nan, "grad_sqnr_db": {"w": -math.inf, "b": 50.0}}}
    _edit(meta_path, lambda m: m.update(budgets={"cpu-x": {"outputs": {"trajectory": entry}}}))
    read_meta(meta_path)
    assert unlimited(entry) == ["min_param_sqnr_db (accepted param_sqnr_db nan)",
                                "min_grad_sqnr_db.w (accepted grad_sqnr_db -inf)"]
    entry["accepted"]["grad_sqnr_db"]["w"] = 30.0  # a finite accepted SQNR: the -Infinity is an edit
    _edit(meta_path, lambda m: m.update(budgets={"cpu-x": {"outputs": {"trajectory": entry}}}))
    with pytest.raises(BaselineError, match="min_grad_sqnr_db.w is -inf: a limit that lets every result pass"):
        read_meta(meta_path)
