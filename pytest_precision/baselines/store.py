"""Golden baselines on disk: where they live, how they are read safely and written atomically.

One baseline per test key and config: ``<root>/<key>/<config>.npz`` holds the float32 references,
one array per named output ("reference" when there is one; "out", "dq", "dk", "dv" for attention;
no pickle: loaded with ``allow_pickle=False``), ``<config>.json`` beside it holds the metadata
(schema version, torch version, device, config, seed, input spec and checksum, the sha256 of the
``.npz`` it was written with) and the accepted error budgets, keyed by numerics key.

Reading never trusts a file: any exception while reading either half, a JSON whose structure or
types are not the documented ones, another schema, or a ``.npz`` that is not the one its JSON was
written with, is a :class:`BaselineError` naming the file. Each half is also read on its own
(:meth:`BaselineStore.read_pair`), so that an update keeps what it can still read.

Writing is atomic per file (temp file, fsync, rename), honours the umask, first removes the
temporary files an interrupted write of the same pair left, and moves aside (never overwrites)
a file that could not be read: ``fp32.npz`` becomes ``fp32.npz.unreadable`` (``.unreadable-2``,
... when that is taken).
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import json
import os
import re
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

__all__ = ["SCHEMA_VERSION", "UPDATE_OPTION", "MOVED_ASIDE", "BaselineError", "Baseline", "StoredPair", "BaselineStore",
           "checksum", "sanitize_key", "name_problem", "file_component", "read_meta", "read_arrays", "read_pair"]

SCHEMA_VERSION = 1
UPDATE_OPTION = "--precision-update-baselines"
MOVED_ASIDE = ".unreadable"  # the suffix a file that could not be read is moved aside with

# target, regime and config names: what a baseline directory and pytest's -k expression both take
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")
NAME_RULE = "1 to 100 characters: letters, digits and _ . + -, not starting with . + or -"
NAME_MAX = 100


class BaselineError(Exception):
    """A baseline file that cannot be trusted: corrupt, truncated, of another schema, with fields of
    the wrong type, or not the pair it was written as. ``newer_schema``: the version, when the
    file was written by a newer pytest-precision (upgrading is the fix, not rewriting)."""

    def __init__(self, message: str, *, newer_schema: int | None = None):
        super().__init__(message)
        self.newer_schema = newer_schema


def checksum(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (dtype and shape included), to notice a generator change."""
    a = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{a.dtype}{tuple(a.shape)}".encode())
    h.update(a.view(torch.uint8).numpy().tobytes() if a.numel() else b"")
    return h.hexdigest()


def name_problem(name: object) -> str | None:
    """Why ``name`` cannot name a target, regime or config (None when it can). The character set
    keeps one name one directory on every file system and makes the name one token of pytest's
    ``-k`` expressions, so the commands the suite prints work when pasted."""
    if not isinstance(name, str):
        return f"{name!r} is a {type(name).__name__}, not a string"
    if not 0 < len(name) <= NAME_MAX or not _NAME.fullmatch(name):
        return f"{name!r} is not {NAME_RULE}"
    return None


def file_component(name: str) -> str:
    """The file-system spelling two names must not share: what ``sanitize_key`` makes of the name,
    case-folded (macOS and Windows file systems ignore case, and so does pytest's ``-k``)."""
    return sanitize_key(name).casefold()


def sanitize_key(key: str) -> str:
    """A relative path from a test key: '/'-separated parts, unsafe characters replaced by '_'."""
    parts = [re.sub(r"[^A-Za-z0-9._+-]", "_", p) for p in key.replace("::", "/").split("/") if p]
    parts = [p for p in parts if p not in (".", "..")]
    if not parts:
        raise ValueError(f"empty baseline key {key!r}")
    return "/".join(parts)


@dataclass
class Baseline:
    arrays: dict[str, torch.Tensor] | None  # float32 references by output name; None: not readable
    meta: dict = field(default_factory=dict)
    npz_path: Path | None = None
    json_path: Path | None = None


@dataclass
class StoredPair:
    """The two files of one baseline, each read on its own: what is there, what could be read,
    and why the rest could not."""

    npz_path: Path
    json_path: Path
    arrays: dict[str, torch.Tensor] | None = None
    meta: dict | None = None
    npz_error: BaselineError | None = None
    json_error: BaselineError | None = None
    npz_sha256: str | None = None

    @property
    def exists(self) -> bool:
        return self.npz_path.exists() or self.json_path.exists()

    @property
    def newer_schema(self) -> int | None:
        return self.json_error.newer_schema if self.json_error is not None else None

    def unreadable(self) -> list[Path]:
        """The files that exist and could not be read (what an update moves aside)."""
        return [p for p, e in ((self.npz_path, self.npz_error), (self.json_path, self.json_error))
                if e is not None and p.exists()]

    def mismatch(self) -> BaselineError | None:
        """The pair is not what was written together (an update interrupted between its writes)."""
        recorded = (self.meta or {}).get("npz_sha256")
        if recorded is None or self.npz_sha256 is None or recorded == self.npz_sha256:
            return None
        return BaselineError(f"{self.npz_path}: does not match the checksum {self.json_path} recorded for it "
                             f"({self.npz_sha256[:12]} vs {recorded[:12]}): written apart (an update interrupted "
                             "between its two writes, or a file replaced by hand)")

    def baseline(self) -> Baseline | None:
        """Both halves, trusted; None when neither exists; BaselineError naming what is wrong."""
        if not self.exists:
            return None
        for p, other in ((self.npz_path, self.json_path), (self.json_path, self.npz_path)):
            if not p.exists():
                raise BaselineError(f"{p}: missing (its companion {other} exists)")
        for error in (self.json_error, self.npz_error, self.mismatch()):
            if error is not None:
                raise error
        return Baseline(self.arrays, self.meta, self.npz_path, self.json_path)


class BaselineStore:
    """Baselines under one root directory."""

    def __init__(self, root: Path):
        self.root = Path(root)
        # "<key>/<config>" of every baseline this run looked up or wrote (unused_baselines reports
        # the others); every read and write goes through paths()
        self.used: set[str] = set()

    def paths(self, key: str, config_id: str) -> tuple[Path, Path]:
        d = self.root / sanitize_key(key)
        self.used.add(f"{sanitize_key(key)}/{config_id}")
        return d / f"{config_id}.npz", d / f"{config_id}.json"

    def read_pair(self, key: str, config_id: str) -> StoredPair:
        """Each file of the baseline read on its own, errors kept (nothing raised)."""
        return read_pair(*self.paths(key, config_id))

    def load(self, key: str, config_id: str) -> Baseline | None:
        """The baseline, or None when neither file exists; BaselineError naming the file otherwise."""
        return self.read_pair(key, config_id).baseline()

    def load_meta(self, key: str, config_id: str) -> dict | None:
        """The JSON half alone (speed records), or None when it does not exist."""
        _, meta_path = self.paths(key, config_id)
        return read_meta(meta_path) if meta_path.exists() else None

    def write(self, key: str, config_id: str, arrays: dict[str, torch.Tensor], meta: dict) -> tuple[Path, Path]:
        """Write both files, each atomically (temp file + rename), the .npz first: readers and other
        xdist workers see the old file or the new one, never half of one, and the JSON records the
        .npz's sha256, so a pair torn by a kill between the two renames is reported as such.
        Temporary files an interrupted write of this pair left are removed first. OSError when
        the directory cannot be written."""
        npz, meta_path = self.paths(key, config_id)
        npz.parent.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(npz, meta_path)
        data = _npz_bytes({n: t.detach().to(torch.float32).cpu().numpy() for n, t in arrays.items()})
        _atomic_write(npz, data)
        meta = {**meta, "schema_version": SCHEMA_VERSION, "npz_sha256": hashlib.sha256(data).hexdigest()}
        _atomic_write(meta_path, _json_bytes(meta))
        return npz, meta_path

    @staticmethod
    def move_aside(paths: list[Path]) -> list[tuple[Path, Path]]:
        """Rename each existing file to a free ``<name>.unreadable[-N]`` beside it (kept, never
        overwritten); returns (from, to) of each."""
        moved = []
        for path in paths:
            if path.exists():
                target, n = path.with_name(path.name + MOVED_ASIDE), 1
                while target.exists():
                    n += 1
                    target = path.with_name(f"{path.name}{MOVED_ASIDE}-{n}")
                os.replace(path, target)
                moved.append((path, target))
        return moved

    def write_meta(self, key: str, config_id: str, meta: dict) -> Path:
        """Rewrite the JSON beside an existing baseline (speed records), atomically."""
        _, meta_path = self.paths(key, config_id)
        _atomic_write(meta_path, _json_bytes({**meta, "schema_version": SCHEMA_VERSION}))
        return meta_path


# ---- reading -----------------------------------------------------------------------------------

def read_pair(npz: Path, meta_path: Path) -> StoredPair:
    """The two files of a baseline, each read on its own, errors kept (nothing raised)."""
    pair = StoredPair(npz, meta_path)
    if meta_path.exists():
        try:
            pair.meta = read_meta(meta_path)
        except BaselineError as e:
            pair.json_error = e
    if npz.exists():
        try:
            pair.arrays, pair.npz_sha256 = read_arrays(npz)
        except BaselineError as e:
            pair.npz_error = e
    return pair


def read_arrays(path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """The float32 arrays of an .npz and the sha256 of its bytes; BaselineError for anything else.

    Any exception counts: a damaged archive raises what the layer that meets the damage raises
    (zipfile.BadZipFile, zlib.error, NotImplementedError for an unknown compression method,
    tokenize.TokenError or SyntaxError from a garbled .npy header, ValueError, EOFError,
    MemoryError for an absurd shape, ...)."""
    try:
        data = path.read_bytes()
        with contextlib.ExitStack() as stack:
            loaded = np.load(io.BytesIO(data), allow_pickle=False)
            if not isinstance(loaded, np.lib.npyio.NpzFile):
                raise BaselineError(f"{path}: a single {type(loaded).__name__} (an .npy saved under the .npz name), "
                                    "not an .npz archive of named arrays")
            stack.enter_context(loaded)
            arrays = {name: np.array(loaded[name]) for name in loaded.files}
    except BaselineError:
        raise
    except Exception as e:
        raise BaselineError(f"{path}: corrupt or truncated baseline tensors ({type(e).__name__}: {e})") from e
    for name, a in arrays.items():
        if a.dtype != np.float32:
            raise BaselineError(f"{path}: {name} has dtype {a.dtype}, expected float32")
    return {n: torch.from_numpy(a) for n, a in arrays.items()}, hashlib.sha256(data).hexdigest()


def read_meta(path: Path) -> dict:
    """A baseline's JSON, its structure and types checked (``validate_meta``)."""
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except Exception as e:  # OSError, UnicodeDecodeError, JSONDecodeError, RecursionError, ...
        raise BaselineError(f"{path}: corrupt baseline metadata ({type(e).__name__}: {e})") from e
    if not isinstance(meta, dict):
        raise BaselineError(f"{path}: corrupt baseline metadata (not a JSON object)")
    version = meta.get("schema_version")
    if type(version) is int and version > SCHEMA_VERSION:
        raise BaselineError(f"{path}: written by a newer pytest-precision (baseline schema {version}, this one reads "
                            f"{SCHEMA_VERSION}): upgrade pytest-precision", newer_schema=version)
    if version != SCHEMA_VERSION or type(version) is not int:
        raise BaselineError(f"{path}: baseline schema version {version!r}, this pytest-precision reads version "
                            f"{SCHEMA_VERSION}")
    problem = _meta_problem(meta)
    if problem:
        raise BaselineError(f"{path}: corrupt baseline metadata ({problem})")
    return meta


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _kind(v) -> str:
    return "null" if v is None else {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(v), "a number" if _is_number(v) else type(v).__name__)


def _scalar(v) -> bool:
    return v is None or isinstance(v, (str, bool)) or _is_number(v)


def _meta_problem(meta: dict) -> str | None:
    """The first field of ``meta`` that is not of its documented type, as a sentence, or None.

    Top level: strings (key, config, torch, written_on, input_checksum, npz_sha256), an integer
    or null seed, an object or null input_spec of plain values, ``dtypes`` {output: string},
    ``budgets`` {numerics key: {"outputs": {output: {"budget": {field: number or null},
    "accepted": {field: number, string or null}}}, other fields plain values or lists of
    numbers}}, ``speed`` {fingerprint: {field: plain value or list of numbers}}."""
    def expect(where, value, ok, what):
        return None if ok(value) else f"{where} is {_kind(value)}, expected {what}"

    checks = [expect(k, meta[k], lambda v: isinstance(v, str), "a string")
              for k in ("key", "config", "torch", "written_on", "npz_sha256") if k in meta]
    checks += [expect(k, meta[k], lambda v: v is None or isinstance(v, str), "a string or null")
               for k in ("input_checksum",) if k in meta]
    if "seed" in meta:
        checks.append(expect("seed", meta["seed"], lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)),
                             "an integer or null"))
    if meta.get("input_spec") is not None:
        checks.append(_object_of("input_spec", meta["input_spec"], lambda v: _scalar(v) or _plain_list(v), "plain values"))
    if "dtypes" in meta:
        checks.append(_object_of("dtypes", meta["dtypes"], lambda v: isinstance(v, str), "strings"))
    if "budgets" in meta:
        checks.append(_budgets_problem(meta["budgets"]))
    if "speed" in meta:
        speed = meta["speed"]
        checks.append(expect("speed", speed, lambda v: isinstance(v, dict), "an object"))
        if isinstance(speed, dict):
            checks += [_object_of(f"speed.{fp}", rec, lambda v: _scalar(v) or _numbers(v), "plain values or lists of numbers")
                       for fp, rec in speed.items()]
    return next((c for c in checks if c), None)


def _plain_list(v) -> bool:
    return isinstance(v, list) and all(_scalar(x) or _plain_list(x) for x in v)


def _numbers(v) -> bool:
    return isinstance(v, list) and all(_is_number(x) or x is None for x in v)


def _object_of(where: str, value, ok, what: str) -> str | None:
    if not isinstance(value, dict):
        return f"{where} is {_kind(value)}, expected an object"
    bad = next((k for k, v in value.items() if not ok(v)), None)
    return None if bad is None else f"{where}.{bad} is {_kind(value[bad])}, expected one of {what}"


def _limit(v) -> bool:
    return v is None or _is_number(v) or (isinstance(v, dict) and all(_is_number(x) for x in v.values()))


def _plain_value(v, depth: int = 3) -> bool:
    if _scalar(v):
        return True
    if depth == 0:
        return False
    if isinstance(v, list):
        return all(_plain_value(x, depth - 1) for x in v)
    return isinstance(v, dict) and all(isinstance(k, str) and _plain_value(x, depth - 1) for k, x in v.items())


def _budgets_problem(budgets) -> str | None:
    if not isinstance(budgets, dict):
        return f"budgets is {_kind(budgets)}, expected an object"
    for key, record in budgets.items():
        where = f"budgets.{key}"
        if not isinstance(record, dict):
            return f"{where} is {_kind(record)}, expected an object"
        outputs = record.get("outputs")
        if not isinstance(outputs, dict):
            return f"{where}.outputs is {_kind(outputs)}, expected an object"
        for name, entry in outputs.items():
            if not isinstance(entry, dict):
                return f"{where}.outputs.{name} is {_kind(entry)}, expected an object"
            # a training budget holds some limits per parameter: objects of numbers
            problem = (_object_of(f"{where}.outputs.{name}.budget", entry.get("budget"), _limit,
                                  "numbers, null or objects of numbers")
                       or _object_of(f"{where}.outputs.{name}.accepted", entry.get("accepted", {}), _plain_value,
                                     "numbers, strings, null, or lists and objects of them"))
            if problem:
                return problem
        extra = {k: v for k, v in record.items() if k != "outputs"}
        problem = _object_of(where, extra, _plain_value, "numbers, strings, null, or lists and objects of them")
        if problem:
            return problem
    return None


# ---- writing -----------------------------------------------------------------------------------

def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """An .npz as ``np.savez_compressed`` writes it, but the same bytes for the same arrays: every
    member dated 1980-01-01 (savez stamps the time of writing), so an unchanged golden rewritten
    is unchanged in version control, and so is the checksum its JSON records."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, array in arrays.items():
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            with archive.open(info, "w", force_zip64=True) as f:
                # asarray, not ascontiguousarray: that makes a 0-dim array (a loss) 1-dim
                np.lib.format.write_array(f, np.asarray(array, order="C"), allow_pickle=False)
    return buf.getvalue()


def _json_bytes(meta: dict) -> bytes:
    return (json.dumps(meta, indent=2, sort_keys=True, allow_nan=True) + "\n").encode("utf-8")


_UMASK: list[int] = []


def _file_mode() -> int:
    """0666 less the process umask, as open() would create the file (mkstemp creates 0600)."""
    if not _UMASK:
        mask = os.umask(0)
        os.umask(mask)
        _UMASK.append(mask)
    return 0o666 & ~_UMASK[0]


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if hasattr(os, "fchmod"):
                os.fchmod(f.fileno(), _file_mode())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _remove_leftovers(*paths: Path) -> None:
    """Temporary files of these paths that an interrupted write left (``.fp32.npz.x1y2.tmp``)."""
    for path in paths:
        for leftover in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()

