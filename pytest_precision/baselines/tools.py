"""Tools over a directory of golden baselines (``python -m pytest_precision baselines ...``):
list them, show one, diff two directories budget by budget, remove a list of them.

Pure functions of the files: a baseline is named by its path under the root without the suffix,
``<key>/<config>`` (``softmax/torch.softmax/len32768/fp32``), and is the pair ``.npz`` + ``.json``.
Both are read as the plugin reads them (``reading``: JSON as data with its structure and types
checked, tensors with ``allow_pickle=False``, the pair's checksum compared): nothing here runs code
from a file, and a file that cannot be read is named in ``errors``, never a traceback.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from .reading import StoredPair, outside, read_pair
from .schema import BaselineError, named, same_value, shown

__all__ = ["BUDGET_FIELDS", "baseline_names", "read_meta", "list_lines", "show_lines", "diff_lines", "remove"]

SUFFIXES = (".npz", ".json")
# compared by diff, in this order: the limits, then the counts allowed
BUDGET_FIELDS = ("max_ulp", "mean_ulp", "max_abs", "rms_abs", "overflow", "underflow", "nan", "missing_nan")  # numerics.budgets.Budget


def baseline_names(root: Path) -> list[str]:
    """Every ``<key>/<config>`` under ``root`` that has a .npz or a .json, sorted. Links to
    directories are not followed (a loop, or a tree elsewhere, is not this directory's);
    a FIFO or a device under a golden's name is listed (reading it names it)."""
    root = Path(root)
    if not root.is_dir():
        return []
    names = set()
    for directory, _, files in os.walk(root, followlinks=False):
        for file in files:
            path = Path(directory, file)
            if path.suffix in SUFFIXES and not file.startswith("."):
                names.add(path.relative_to(root).with_suffix("").as_posix())
    return sorted(names)


def _pair(root: Path, name: str) -> StoredPair:
    return read_pair(Path(root) / f"{name}.npz", Path(root) / f"{name}.json", root=Path(root))


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
        keys = [named(k) for k in sorted((meta.get("budgets") or {}))]
        outputs = [named(k) for k in sorted((meta.get("dtypes") or {}))]
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
             f"  written on {named(meta.get('written_on'))} with torch {named(meta.get('torch'))}, schema {meta.get('schema_version')}",
             f"  seed {meta.get('seed')}, input checksum {named(str(meta.get('input_checksum'))[:16])}",
             f"  input spec {named(json.dumps(meta.get('input_spec'), sort_keys=True), 400)}",
             f"  outputs {named(json.dumps(meta.get('dtypes'), sort_keys=True), 400)}"]
    if pair.arrays is not None:
        lines.append("  tensors " + ", ".join(f"{named(n)} {tuple(a.shape)}" for n, a in sorted(pair.arrays.items())))
    for key, entry in sorted((meta.get("budgets") or {}).items()):
        lines.append(f"  [{named(key)}] {named(entry.get('machine'))}, torch {named(entry.get('torch'))}")
        for output, rec in sorted((entry.get("outputs") or {}).items()):
            b = rec.get("budget") or {}
            acc = rec.get("accepted") or {}
            if set(b) <= set(BUDGET_FIELDS):  # an output tensor's budget
                limits = ", ".join(f"{f} {b[f]!r}" for f in BUDGET_FIELDS if b.get(f) is not None)
                lines.append(f"    {named(output)}: budget {limits}; accepted max ULP {shown(acc.get('max_ulp'))}, "
                             f"max abs {shown(acc.get('max_abs'))}")
            else:  # a training budget (training.budget): its own fields, all shown
                lines.append(f"    {named(output)}: budget " + ", ".join(f"{named(f)} {shown(v)}" for f, v in sorted(b.items())))
                lines.append(f"    {named(output)}: accepted " + ", ".join(f"{named(f)} {shown(v)}" for f, v in sorted(acc.items())))
            if rec.get("peer"):
                lines.append(f"    {named(output)}: peer " + ", ".join(f"{named(f)} {shown(v)}" for f, v in sorted(rec["peer"].items())))
    for fp in sorted(meta.get("speed") or {}):
        rec = meta["speed"][fp]
        lines.append(f"  speed [{named(fp)}] median {shown(rec.get('median_s'))} s")
    return lines


def diff_lines(a: Path, b: Path, errors: list[str] | None = None) -> list[str]:
    """Every difference between two baseline directories that can change a verdict: baselines on
    one side only, budgets present on one side only, every stored value that moved (``old -> new``:
    the budgets, the accepted errors and the peer's that borrowed budgets scale by, the speed and
    memory records, the seed, input spec and checksum; everything in the JSON but the ``.npz``'s
    checksum, whose tensors are compared instead), and reference tensors that changed. One line
    each, sorted by baseline. A baseline that cannot be read on either side is compared no further
    and named in ``errors``."""
    errors = [] if errors is None else errors
    a, b = Path(a), Path(b)
    names_a, names_b = set(baseline_names(a)), set(baseline_names(b))
    lines = []
    for name in sorted(names_a | names_b):
        if name not in names_b or name not in names_a:
            lines.append(f"{named(name, 300)} only in {a if name in names_a else b}")
            continue
        pa, pb = _pair(a, name), _pair(b, name)
        problems = _problems(pa) + _problems(pb)
        if problems:
            errors += [str(e) for e in problems]
            continue
        shown_name = named(name, 300)  # a file name from a pull request: no terminal escapes
        lines += _meta_changes(shown_name, a, b, pa.meta, pb.meta)
        lines += _tensor_changes(shown_name, a, b, pa.arrays, pb.arrays)
    return lines


def _flat(value, path: tuple = ()) -> dict[tuple, object]:
    """path -> leaf of a JSON value (a list is one leaf: samples are compared as a whole)."""
    if isinstance(value, dict) and value:
        out = {}
        for k, v in value.items():
            out.update(_flat(v, path + (k,)))
        return out
    return {path: value}


def _field_order(path: tuple) -> tuple:
    """Grouped by what holds the field; a tensor budget's fields in their usual order, then any others."""
    last = path[-1] if path else ""
    return (tuple(map(str, path[:-1])), BUDGET_FIELDS.index(last) if last in BUDGET_FIELDS else len(BUDGET_FIELDS),
            str(last))


def _meta_changes(name: str, a: Path, b: Path, ma: dict, mb: dict) -> list[str]:
    lines = []
    # a numerics key's budget, or a device's speed record, on one side only: said, then its values
    ba, bb = ma.get("budgets") or {}, mb.get("budgets") or {}
    for key in sorted(set(ba) | set(bb)):
        oa, ob = (ba.get(key) or {}).get("outputs") or {}, (bb.get(key) or {}).get("outputs") or {}
        for output in sorted(set(oa) ^ set(ob)):
            lines.append(f"{name} [{named(key)}] {named(output)} budget only in {a if output in oa else b}")
    sa, sb = ma.get("speed") or {}, mb.get("speed") or {}
    for fp in sorted(set(sa) ^ set(sb)):
        lines.append(f"{name} speed [{named(fp)}] only in {a if fp in sa else b}")
    fa = _flat({k: v for k, v in ma.items() if k != "npz_sha256"})
    fb = _flat({k: v for k, v in mb.items() if k != "npz_sha256"})
    for path in sorted(set(fa) | set(fb), key=_field_order):
        old, new = fa.get(path), fb.get(path)
        if same_value(old, new) or (old in (None, {}) and new in (None, {})):  # null, empty or absent: nothing
            continue
        lines.append(f"{_head(name, path)} {shown(old)} -> {shown(new)}")
    return lines


def _head(name: str, path: tuple) -> str:
    """How a changed value is named: ``<name> [<key>] <output> <field>`` for a budget (``accepted``
    and ``peer`` fields say so), ``<name> speed [<fp>] <field>``, else ``<name> <dotted path>``."""
    parts = [named(str(p), 60) for p in path]
    if path[0] == "budgets" and len(path) >= 3:
        if path[2] == "outputs" and len(path) >= 5:
            section = "" if path[4] == "budget" else f"{parts[4]} "
            return f"{name} [{parts[1]}] {parts[3]} {section}{'.'.join(parts[5:])}".rstrip()
        return f"{name} [{parts[1]}] {'.'.join(parts[2:])}"
    if path[0] == "speed" and len(path) >= 3:
        return f"{name} speed [{parts[1]}] {'.'.join(parts[2:])}"
    return f"{name} {'.'.join(parts)}"


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
    returns the files removed (or, with ``dry_run``, that would be). A baseline file that is a
    link is unlinked, never what it points to; a name that would leave ``root`` (``..``, an
    absolute path, a directory link leading elsewhere) is refused with BaselineError before
    anything is removed."""
    root = Path(os.path.realpath(root))
    files = []
    for name in sorted(set(names)):
        if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
            raise BaselineError(f"{shown(name)}: not a baseline name under {root}")
        for suffix in SUFFIXES:
            p = root / f"{name}{suffix}"
            # the directory holding the file must be inside root; the file itself may be a link
            # (removed as a link)
            leads = outside(p.parent, root)
            if leads is not None:
                raise BaselineError(f"{shown(name)}: its directory leads outside {root} (to {leads}): nothing removed")
            if p.is_symlink() or p.is_file():
                files.append(p)
    if dry_run:
        return files
    for p in files:
        p.unlink()  # a link: the link alone
        d = p.parent
        while d != root and d.is_dir() and not d.is_symlink() and not any(d.iterdir()):
            d.rmdir()
            d = d.parent
    return files
