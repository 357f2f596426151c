"""Damaged baselines: every unreadable file is a verdict naming it and the command that rewrites
it (never a traceback), the command line says so with exit status 2, and an update keeps what it
can still read, moves the rest aside and refuses a newer schema."""
import io
import json
import os
import stat
import tokenize
import zipfile
import zlib

import numpy as np
import pytest
import torch

from pytest_precision.__main__ import main
from pytest_precision.baselines.lifecycle import BaselineCheck
from pytest_precision.baselines.schema import BaselineError
from pytest_precision.baselines.store import BaselineStore

from sample_targets import CORRECT_SOFTMAX_CONFTEST as CONFTEST

pytest_plugins = ["pytester"]

ARGS = ("--precision-suite", "--precision-configs=fp32", "-p", "no:cacheprovider", "-k", "softmax and mine-fp32-unit")
UPDATE = "--precision-update-baselines"


def _accepted(pytester, *extra):
    """A project whose one case has its golden, with a budget of another machine and a speed
    record added by hand; returns the two files and what was added."""
    pytester.makeconftest(CONFTEST)
    pytester.runpytest(*ARGS, UPDATE, "--precision-no-speed").assert_outcomes(passed=1)
    d = pytester.path / "precision_baselines" / "softmax" / "mine" / "unit"
    npz, meta_path = d / "fp32.npz", d / "fp32.json"
    meta = json.loads(meta_path.read_text())
    other = json.loads(json.dumps(next(iter(meta["budgets"].values()))))
    other["machine"] = "another machine"
    meta["budgets"]["cpu-other"] = other
    meta["speed"] = {"another machine, timed on 1 thread": {"median_s": 1e-5, "samples": [1e-5] * 3,
                                                            "calibration": [], "peak_bytes": None}}
    meta_path.write_text(json.dumps(meta))
    return npz, meta_path, other, meta["speed"], npz.read_bytes()


def _first_flip(data: bytes, exception: type, from_end: bool = False) -> bytes:
    """``data`` with the first single-byte flip that makes np.load raise ``exception``, searched from
    the end with ``from_end`` (where a zip's central directory is)."""
    for offset in (reversed(range(len(data))) if from_end else range(len(data))):
        for mask in (0x01, 0x80, 0xFF):
            damaged = bytearray(data)
            damaged[offset] ^= mask
            try:
                with np.load(io.BytesIO(bytes(damaged)), allow_pickle=False) as z:
                    {n: np.array(z[n]) for n in z.files}
            except exception:
                return bytes(damaged)
            except Exception:
                pass
    raise AssertionError(f"no single-byte flip raises {exception.__name__}")


def _npy_bytes():
    buf = io.BytesIO()
    np.save(buf, np.ones((16, 256), dtype=np.float32))
    return buf.getvalue()


def _edit_budget(meta_path, change):
    meta = json.loads(meta_path.read_text())
    change(meta, next(iter(meta["budgets"].values()))["outputs"]["reference"]["budget"])
    meta_path.write_text(json.dumps(meta))
    return meta_path


def _write(path, data):
    path.write_bytes(data)
    return path


# how a file gets damaged: (npz, json) -> the damaged file
DAMAGE = {
    "zlib.error": lambda npz, js: _write(npz, _first_flip(npz.read_bytes(), zlib.error)),
    "tokenize.TokenError": lambda npz, js: _write(npz, _first_flip(npz.read_bytes(), tokenize.TokenError)),
    # an unknown compression method, which zipfile reads from the central directory: from the end
    # (from the start, 10 s of loads)
    "NotImplementedError": lambda npz, js: _write(npz, _first_flip(npz.read_bytes(), NotImplementedError, from_end=True)),
    "BadZipFile": lambda npz, js: _write(npz, npz.read_bytes()[: len(npz.read_bytes()) // 2]),
    "npy-as-npz": lambda npz, js: _write(npz, _npy_bytes()),
    "null-budgets": lambda npz, js: _edit_budget(js, lambda meta, budget: meta.update(budgets=None)),
    "string-max-ulp": lambda npz, js: _edit_budget(js, lambda meta, budget: budget.update(max_ulp="11.0")),
    "not-utf8": lambda npz, js: _write(js, b"\xff\xfe" + js.read_bytes()),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_unreadable_baseline_is_a_verdict_and_update_moves_it_aside(pytester, damage):
    npz, meta_path, other, speed, _ = _accepted(pytester)
    path = DAMAGE[damage](npz, meta_path)
    before = path.read_bytes()

    result = pytester.runpytest(*ARGS, "--precision-no-speed")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    result.stdout.fnmatch_lines([f"*softmax[[]mine-fp32-unit[]]: FAIL baseline ({path}: *",
                                 "*if this run is right, accept it with: pytest --precision-suite -k 'softmax[[]mine-fp32-unit[]]' "
                                 "--precision-configs=fp32 --precision-update-baselines*",
                                 "*precision summary (device cpu*", "*| mine *| fp32 *| FAIL 1/1: baseline*"])
    assert "Traceback" not in out and "baselines/store.py" not in out and "INTERNALERROR" not in out
    assert path.read_bytes() == before  # left as it is without the flag

    fixed = pytester.runpytest(*ARGS, UPDATE)
    fixed.assert_outcomes(passed=1)
    aside = path.with_name(path.name + ".unreadable")
    assert aside.read_bytes() == before  # kept, not overwritten blind
    fixed.stdout.fnmatch_lines([f"*moved the unreadable {path} aside to {aside}*"])
    meta = json.loads(meta_path.read_text())
    if path == npz:  # the JSON was readable: nothing of it is lost
        assert meta["budgets"]["cpu-other"] == other
        assert set(speed) <= set(meta["speed"])
    pytester.runpytest(*ARGS, "--precision-no-speed").assert_outcomes(passed=1)


def test_update_keeps_other_machines_budgets_and_speed_records(pytester):
    npz, meta_path, other, speed, _ = _accepted(pytester)
    result = pytester.runpytest(*ARGS, UPDATE)
    result.assert_outcomes(passed=1)
    meta = json.loads(meta_path.read_text())
    assert meta["budgets"]["cpu-other"] == other and set(speed) <= set(meta["speed"])
    result.stdout.fnmatch_lines(["*kept the budgets of cpu-other*"])


def test_a_newer_schema_is_refused_not_downgraded(pytester):
    npz, meta_path, *_ = _accepted(pytester)
    meta = json.loads(meta_path.read_text())
    meta["schema_version"] = 2
    meta_path.write_text(json.dumps(meta))
    before = (npz.read_bytes(), meta_path.read_bytes())
    for args in ((), (UPDATE,)):
        result = pytester.runpytest(*ARGS, "--precision-no-speed", *args)
        result.assert_outcomes(failed=1)
        result.stdout.fnmatch_lines([f"*{meta_path}: written by a newer pytest-precision (baseline schema 2, this one "
                                     "reads 1): upgrade pytest-precision*"])
        assert (npz.read_bytes(), meta_path.read_bytes()) == before


def test_a_mismatched_pair_is_reported(pytester):
    """An update killed between its two writes leaves a new .npz beside the old .json."""
    npz, meta_path, *_ = _accepted(pytester)
    with np.load(npz, allow_pickle=False) as z:
        ref = np.array(z["reference"])
    np.savez_compressed(npz, reference=ref * np.float32(1.5))
    result = pytester.runpytest(*ARGS, "--precision-no-speed")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"*FAIL baseline ({npz}: does not match the checksum {meta_path} recorded*"])
    pytester.runpytest(*ARGS, UPDATE, "--precision-no-speed").assert_outcomes(passed=1)
    pytester.runpytest(*ARGS, "--precision-no-speed").assert_outcomes(passed=1)


def test_leftover_temporary_files_are_cleaned_and_files_honour_the_umask(pytester):
    npz, meta_path, *_ = _accepted(pytester)
    leftovers = [npz.with_name(".fp32.npz.k2j4x.tmp"), npz.with_name(".fp32.json.a8b7c.tmp")]
    for p in leftovers:
        p.write_bytes(b"half a file")
    old = os.umask(0o022)
    try:
        pytester.runpytest(*ARGS, UPDATE, "--precision-no-speed").assert_outcomes(passed=1)
    finally:
        os.umask(old)
    assert not any(p.exists() for p in leftovers)
    assert sorted(p.name for p in npz.parent.iterdir()) == ["fp32.json", "fp32.npz"]
    assert {stat.S_IMODE(p.stat().st_mode) for p in (npz, meta_path)} == {0o644}


# ---- the fuzz test: bytes flipped at many offsets of both files --------------------------------

def _golden(tmp_path):
    """A small golden pair written through the store, and a check bound to it. Random logits: the
    reference does not compress, so deflate stores the .npy header as it is, where flipped bytes
    reach numpy's header parser (tokenize.TokenError, SyntaxError, ValueError)."""
    store = BaselineStore(tmp_path)
    x = 3 * torch.randn(16, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ref = torch.softmax(x, -1)
    check = BaselineCheck(store, "softmax/t/unit", "fp32", "cpu", True, "pytest ... --precision-update-baselines")
    check.check_output(ref.float(), ref, inputs=x.float())
    check.commit()
    return store, x, ref


def _verdict(store, x, ref, update=False):
    check = BaselineCheck(store, "softmax/t/unit", "fp32", "cpu", update, "pytest ... --precision-update-baselines")
    return check, check.check_output(ref.float(), ref, inputs=x.float())


def _offsets(size: int) -> list[int]:
    """Every offset of the first and last 256 bytes (zip headers, the .npy header, the central
    directory; the JSON's head and tail) and every 7th between: each write costs milliseconds on
    a journaled file system."""
    return sorted({*range(min(256, size)), *range(max(0, size - 256), size), *range(256, size, 7)})


def _causes(error: BaseException):
    out = set()
    while error is not None:
        out.add(type(error))
        error = error.__cause__
    return out


@pytest.mark.parametrize("which", ["npz", "npz-with-checksum", "json"])
def test_flipped_bytes_anywhere_give_a_verdict_never_a_traceback(tmp_path, which):
    """A flipped byte at every offset of a small golden: load raises BaselineError naming
    the file or returns the baseline, and the check always returns a verdict. Without the pair's
    checksum every exception class the tensor reader meets is among the causes; with it, no flip
    of the .npz goes unnoticed."""
    store, x, ref = _golden(tmp_path)
    npz, meta_path = store.paths("softmax/t/unit", "fp32")
    path = meta_path if which == "json" else npz
    if which == "npz":
        meta = json.loads(meta_path.read_text())
        meta.pop("npz_sha256")
        meta_path.write_text(json.dumps(meta))
    good = path.read_bytes()
    causes, loaded = set(), 0
    for offset in _offsets(len(good)):
        damaged = bytearray(good)
        damaged[offset] ^= (0x01, 0x80, 0xFF)[offset % 3]  # a low bit, a high bit, every bit
        path.write_bytes(bytes(damaged))
        try:
            store.load("softmax/t/unit", "fp32")
            loaded += 1
        except BaselineError as e:
            assert str(path) in str(e)
            causes |= _causes(e)
        _, result = _verdict(store, x, ref)  # never raises
        assert result.error is not None or result.comparisons
    if which == "npz":
        for expected in (zipfile.BadZipFile, zlib.error, tokenize.TokenError, NotImplementedError, ValueError):
            assert expected in causes, f"no flip raised {expected.__name__}: {causes}"
    elif which == "npz-with-checksum":
        assert loaded == 0
    else:
        assert {json.JSONDecodeError, UnicodeDecodeError} <= causes


def test_update_over_any_flipped_byte_rewrites_a_readable_pair(tmp_path):
    store, x, ref = _golden(tmp_path)
    npz, _ = store.paths("softmax/t/unit", "fp32")
    good = npz.read_bytes()
    for offset in range(0, len(good), 67):
        damaged = bytearray(good)
        damaged[offset] ^= 0xFF
        npz.write_bytes(bytes(damaged))
        check, result = _verdict(store, x, ref, update=True)
        assert result.error is None
        check.commit()
        assert store.load("softmax/t/unit", "fp32") is not None
        for p in npz.parent.glob("fp32.npz.unreadable*"):
            p.unlink()


# ---- the command line ------------------------------------------------------------------------

def _cli(*argv, cwd):
    out, err = io.StringIO(), io.StringIO()
    import contextlib
    with contextlib.redirect_stderr(err):
        code = main(list(argv), cwd=cwd, out=out)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("damage", ["flipped-npz", "npy-as-npz", "null-budgets", "string-max-ulp", "outputs-list"])
def test_the_command_line_exits_2_on_unreadable_input(tmp_path, damage):
    store, x, ref = _golden(tmp_path / "a")
    _golden(tmp_path / "b")
    npz, meta_path = (tmp_path / "b" / "softmax/t/unit/fp32.npz"), (tmp_path / "b" / "softmax/t/unit/fp32.json")
    meta = json.loads(meta_path.read_text())
    key = next(iter(meta["budgets"]))
    if damage == "flipped-npz":
        npz.write_bytes(_first_flip(npz.read_bytes(), zlib.error))
    elif damage == "npy-as-npz":
        npz.write_bytes(_npy_bytes())
    elif damage == "null-budgets":
        meta["budgets"] = None
    elif damage == "string-max-ulp":
        meta["budgets"][key]["outputs"]["reference"]["budget"]["max_ulp"] = "3"
    else:
        meta["budgets"][key]["outputs"] = ["reference"]
    if damage not in ("flipped-npz", "npy-as-npz"):
        meta_path.write_text(json.dumps(meta))
    bad = npz if damage in ("flipped-npz", "npy-as-npz") else meta_path
    for argv in (("baselines", "diff", str(tmp_path / "a"), str(tmp_path / "b")),
                 ("baselines", "show", "softmax/t/unit/fp32", "--dir", str(tmp_path / "b")),
                 ("baselines", "list", "--dir", str(tmp_path / "b"))):
        code, out, err = _cli(*argv, cwd=tmp_path)
        assert code == 2, (argv, out, err)
        assert str(bad) in err and "Traceback" not in err
    assert _cli("baselines", "diff", str(tmp_path / "a"), str(tmp_path / "a"), cwd=tmp_path)[0] == 0


def test_the_command_line_exits_1_on_differences_only(tmp_path):
    _golden(tmp_path / "a")
    _golden(tmp_path / "b")
    meta_path = tmp_path / "b" / "softmax/t/unit/fp32.json"
    meta = json.loads(meta_path.read_text())
    budget = next(iter(meta["budgets"].values()))["outputs"]["reference"]["budget"]
    budget["max_ulp"] = budget["max_ulp"] + 1
    meta_path.write_text(json.dumps(meta))
    code, out, err = _cli("baselines", "diff", str(tmp_path / "a"), str(tmp_path / "b"), cwd=tmp_path)
    assert code == 1 and "max_ulp" in out and err == ""
