"""Tools over a directory of golden baselines (``python -m pytest_precision baselines ...``):
list them, show one, diff two directories budget by budget, remove a list of them.

Pure functions of the files: a baseline is named by its path under the root without the suffix,
``<key>/<config>`` (``softmax/torch.softmax/len32768/fp32``), and is the pair ``.npz`` + ``.json``.
Both are read as the plugin reads them (``store``: JSON as data with its structure and types
checked, tensors with ``allow_pickle=False``, the pair's checksum compared): nothing here runs code
from a file, and a file that cannot be read is named in ``errors``, never a traceback.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .store import BaselineError, StoredPair, read_pair

__all__ = ["BUDGET_FIELDS", "baseline_names", "read_meta", "list_lines", "show_lines", "diff_lines", "remove"]

SUFFIXES = (".npz", ".json")
# compared by diff, in this order: the limits, then the counts allowed
BUDGET_FIELDS = ("max_ulp", "mean_ulp", "max_abs", "rms_abs", "overflow", "underflow", "nan", "missing_nan")  # numerics.budgets.Budget


def baseline_names(root: Path) -> list[str]:
    """Every ``<key>/<config>`` under ``root`` that has a .npz or a .json, sorted."""
    root = Path(root)
    if not root.is_dir():
        return []
    names = {p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*")
             if p.suffix in SUFFIXES and p.is_file() and not p.name.startswith(".")}
    return sorted(names)


def _pair(root: Path, name: str) -> StoredPair:
    return read_pair(Path(root) / f"{name}.npz", Path(root) / f"{name}.json")


def _problems(pair: StoredPair) -> list[BaselineError]:
    """Why the baseline cannot be trusted: a missing half, an unreadable file, a torn pair."""
    out = [BaselineError(f"{p}: missing (its companion {other} exists)")
           for p, other in ((pair.npz_path, pair.json_path), (pair.json_path, pair.npz_path)) if not p.exists()]
    out += [e for e in (pair.json_error, pair.npz_error, pair.mismatch()) if e is not None]
    return out


def read_meta(root: Path, name: str, errors: list[str] | None = None) -> dict | None:
    """The baseline's JSON, or None when it has none or it cannot be read (the reason added to
    ``errors``)."""
    pair = _pair(root, name)
    if pair.json_error is not None and errors is not None:
        errors.append(str(pair.json_error))
    return pair.meta


def _budgets(meta: dict | None) -> dict[tuple[str, str], dict]:
    """(numerics key, output) -> budget dict."""
    out = {}
    for key, entry in sorted(((meta or {}).get("budgets") or {}).items()):
        for output, rec in sorted(((entry or {}).get("outputs") or {}).items()):
            out[(key, output)] = (rec or {}).get("budget") or {}
    return out


def list_lines(root: Path, errors: list[str] | None = None) -> list[str]:
    """One line per baseline: name, outputs, the numerics keys with budgets, and problems (each
    also added to ``errors``)."""
    errors = [] if errors is None else errors
    lines = []
    for name in baseline_names(root):
        pair = _pair(root, name)
        problems = _problems(pair)
        errors += [str(e) for e in problems]
        if problems:
            lines.append(f"{name}  (unreadable: {problems[0]})")
            continue
        meta = pair.meta
        keys = sorted((meta.get("budgets") or {}))
        outputs = sorted((meta.get("dtypes") or {}))
        speed = len(meta.get("speed") or {})
        lines.append(f"{name}  outputs {','.join(outputs) or '-'}; budgets for {','.join(keys) or 'none'}"
                     + (f"; speed records for {speed} device(s)" if speed else ""))
    return lines


def show_lines(root: Path, name: str, errors: list[str] | None = None) -> list[str]:
    """A readable account of one baseline: where it came from and every budget. FileNotFoundError
    when there is none; what cannot be read is added to ``errors`` (BaselineError without a
    readable JSON)."""
    errors = [] if errors is None else errors
    name = name.removesuffix(".json").removesuffix(".npz")
    pair = _pair(root, name)
    if not pair.exists:
        raise FileNotFoundError(f"no baseline {name} under {root}")
    problems = _problems(pair)
    errors += [str(e) for e in problems]
    meta = pair.meta
    if meta is None:
        raise BaselineError(str(problems[0]))
    lines = [f"{name}",
             f"  written on {meta.get('written_on')} with torch {meta.get('torch')}, schema {meta.get('schema_version')}",
             f"  seed {meta.get('seed')}, input checksum {str(meta.get('input_checksum'))[:16]}",
             f"  input spec {json.dumps(meta.get('input_spec'), sort_keys=True)}",
             f"  outputs {json.dumps(meta.get('dtypes'), sort_keys=True)}"]
    if pair.arrays is not None:
        lines.append("  tensors " + ", ".join(f"{n} {tuple(a.shape)}" for n, a in sorted(pair.arrays.items())))
    for key, entry in sorted((meta.get("budgets") or {}).items()):
        lines.append(f"  [{key}] {entry.get('machine')}, torch {entry.get('torch')}")
        for output, rec in sorted((entry.get("outputs") or {}).items()):
            b = rec.get("budget") or {}
            acc = rec.get("accepted") or {}
            if set(b) <= set(BUDGET_FIELDS):  # an output tensor's budget
                limits = ", ".join(f"{f} {b[f]!r}" for f in BUDGET_FIELDS if b.get(f) is not None)
                lines.append(f"    {output}: budget {limits}; accepted max ULP {acc.get('max_ulp')!r}, "
                             f"max abs {acc.get('max_abs')!r}")
            else:  # a training budget (training.baseline): its own fields, all shown
                lines.append(f"    {output}: budget " + ", ".join(f"{f} {v!r}" for f, v in sorted(b.items())))
                lines.append(f"    {output}: accepted " + ", ".join(f"{f} {v!r}" for f, v in sorted(acc.items())))
    for fp in sorted(meta.get("speed") or {}):
        rec = meta["speed"][fp]
        lines.append(f"  speed [{fp}] median {rec.get('median_s')!r} s")
    return lines


def diff_lines(a: Path, b: Path, errors: list[str] | None = None) -> list[str]:
    """Every difference between two baseline directories that a reviewer needs: baselines on one
    side only, budgets present on one side only, every budget field that moved (``old -> new``),
    and reference tensors that changed. One line each, sorted by baseline. A baseline that cannot
    be read on either side is compared no further and named in ``errors``."""
    errors = [] if errors is None else errors
    a, b = Path(a), Path(b)
    names_a, names_b = set(baseline_names(a)), set(baseline_names(b))
    lines = []
    for name in sorted(names_a | names_b):
        if name not in names_b:
            lines.append(f"{name} only in {a}")
            continue
        if name not in names_a:
            lines.append(f"{name} only in {b}")
            continue
        pa, pb = _pair(a, name), _pair(b, name)
        problems = _problems(pa) + _problems(pb)
        if problems:
            errors += [str(e) for e in problems]
            continue
        ba, bb = _budgets(pa.meta), _budgets(pb.meta)
        for key, output in sorted(set(ba) | set(bb)):
            head = f"{name} [{key}] {output}"
            if (key, output) not in bb:
                lines.append(f"{head} budget only in {a}")
            elif (key, output) not in ba:
                lines.append(f"{head} budget only in {b}")
            else:
                old, new = ba[(key, output)], bb[(key, output)]
                # the tensor budgets' fields in their usual order, then any others (training budgets)
                fields = [f for f in BUDGET_FIELDS if f in old or f in new] + sorted((set(old) | set(new)) - set(BUDGET_FIELDS))
                lines += [f"{head} {f} {old.get(f)!r} -> {new.get(f)!r}" for f in fields if old.get(f) != new.get(f)]
        lines += _tensor_changes(name, a, b, pa.arrays, pb.arrays)
    return lines


def _tensor_changes(name: str, a: Path, b: Path, ta: dict, tb: dict) -> list[str]:
    out = []
    for n in sorted(set(ta) | set(tb)):
        if n not in ta or n not in tb:
            out.append(f"{name} tensor {n} only in {a if n in ta else b}")
            continue
        x, y = ta[n].numpy(), tb[n].numpy()
        if x.shape != y.shape:
            out.append(f"{name} tensor {n} shape {x.shape} -> {y.shape}")
        elif not np.array_equal(x, y, equal_nan=True):
            diff = np.abs(x.astype(np.float64) - y.astype(np.float64))
            finite = diff[np.isfinite(diff)]
            n_diff = int(np.count_nonzero(~((x == y) | (np.isnan(x) & np.isnan(y)))))
            out.append(f"{name} tensor {n} changed in {n_diff} of {x.size} elements"
                       + (f", max abs {float(finite.max()):.4g}" if finite.size else ""))
    return out


def remove(root: Path, names: list[str], *, dry_run: bool = False) -> list[Path]:
    """Delete the files of each named baseline under ``root`` (and directories left empty);
    returns the files removed (or, with ``dry_run``, that would be). Names that would leave
    ``root`` are refused."""
    root = Path(root).resolve()
    files = []
    for name in sorted(set(names)):
        for suffix in SUFFIXES:
            p = (root / f"{name}{suffix}").resolve()
            if root not in p.parents:
                raise ValueError(f"{name}: not a baseline under {root}")
            if p.is_file():
                files.append(p)
    if dry_run:
        return files
    for p in files:
        p.unlink()
        d = p.parent
        while d != root and d.is_dir() and not any(d.iterdir()):
            d.rmdir()
            d = d.parent
    return files
