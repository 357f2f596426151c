"""Golden baselines on disk: where they live, how they are read safely and written atomically.

One baseline per test key and config: ``<root>/<key>/<config>.npz`` holds the float32 references,
one array per named output ("reference" when there is one; "out", "dq", "dk", "dv" for attention;
no pickle: loaded with ``allow_pickle=False``), ``<config>.json`` beside it holds the metadata
(schema version, torch version, device, config, seed, input spec and checksum, the sha256 of the
``.npz`` it was written with) and the accepted error budgets, keyed by numerics key.

Reading never trusts a file (a golden arrives in a pull request): any exception while reading
either half, a JSON whose structure or types are not the documented ones, another schema, or a
``.npz`` that is not the one its JSON was written with, is a :class:`BaselineError` naming the
file. Each half is also read on its own (:meth:`BaselineStore.read_pair`), so that an update keeps
what it can still read. Every read is bounded before it costs anything (:func:`read_bounded`,
:func:`npz_members`): regular files only, never through a link that leaves the baseline
directory, at most ``MAX_FILE_BYTES``; an ``.npz``'s members are judged from their headers (names
unique, float32, at most ``MAX_MEMBERS``, the declared size the stored size, the total at most
``MAX_ARRAY_BYTES``, each no larger than the case's output when a case reads it) before anything
is inflated; a JSON may not repeat a key, hold a string longer than ``MAX_STRING``, or a NaN or
loosening infinite limit; strings from a file are shortened (:func:`shown`) in every message.

Writing is atomic per file (temp file, fsync, rename), honours the umask, stays inside the
baseline directory (a directory link that leaves it is refused, named with where it leads), holds
a lock on the pair's directory while it writes both files (two update processes never interleave
the halves of one pair), first removes the temporary files an interrupted write left (those of
processes no longer alive: temporary names carry the writer's pid), and moves aside (never
overwrites) a file that could not be read: ``fp32.npz`` becomes ``fp32.npz.unreadable``
(``.unreadable-2``, ... when that is taken).
"""
from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import io
import json
import math
import os
import re
import stat
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

__all__ = ["SCHEMA_VERSION", "UPDATE_OPTION", "MOVED_ASIDE", "BaselineError", "Baseline", "StoredPair", "BaselineStore",
           "checksum", "sanitize_key", "name_problem", "file_component", "read_meta", "read_arrays", "read_pair",
           "read_bounded", "shown", "named", "outside", "unlimited", "process_alive", "same_value", "is_number"]

SCHEMA_VERSION = 1
UPDATE_OPTION = "--precision-update-baselines"
MOVED_ASIDE = ".unreadable"  # the suffix a file that could not be read is moved aside with

# target, regime and config names: what a baseline directory and pytest's -k expression both take
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")
NAME_RULE = ("1 to 100 characters: letters, digits and _ . + -, not starting with . + or -, not ending with ., "
             "and not a name Windows reserves for a device (CON, PRN, AUX, NUL, COM1-9, LPT1-9, with any extension)")
NAME_MAX = 100
# names Windows gives to devices in every directory, whatever the extension ("nul.txt" is NUL)
_RESERVED = re.compile(r"(con|prn|aux|nul|com[0-9¹²³]|lpt[0-9¹²³]|conin\$|conout\$)(\..*)?", re.IGNORECASE)


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
    if not 0 < len(name) <= NAME_MAX or not _NAME.fullmatch(name) or name.endswith("."):
        return f"{shown(name, 60)} is not {NAME_RULE}"
    if _RESERVED.fullmatch(name):
        return f"{name!r} names a device on Windows (CON, PRN, AUX, NUL, COM1-9 and LPT1-9 do, whatever the extension)"
    return None


def file_component(name: str) -> str:
    """The file-system spelling two names must not share: what ``sanitize_key`` makes of the name,
    case-folded (macOS and Windows file systems ignore case, and so does pytest's ``-k``)."""
    return sanitize_key(name).casefold()


def sanitize_key(key: str) -> str:
    """A relative path from a test key: '/'-separated parts, unsafe characters replaced by '_'."""
    parts = [re.sub(r"[^A-Za-z0-9._+-]", "_", p) for p in key.replace("::", "/").split("/") if p]
    parts = [p for p in parts if p not in (".", "..")]
    # a part Windows reserves ("con", "nul.py") or ends with "." would not be one directory there
    parts = [f"_{p}" if _RESERVED.fullmatch(p) else p for p in parts]
    parts = [p[:-1] + "_" if p.endswith(".") else p for p in parts]
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

    def read_pair(self, key: str, config_id: str, expected: dict[str, tuple[int, ...]] | None = None) -> StoredPair:
        """Each file of the baseline read on its own, errors kept (nothing raised); ``expected``:
        the case's output shapes (no larger stored array is inflated)."""
        return read_pair(*self.paths(key, config_id), root=self.root, expected=expected)

    def load(self, key: str, config_id: str, expected: dict[str, tuple[int, ...]] | None = None) -> Baseline | None:
        """The baseline, or None when neither file exists; BaselineError naming the file otherwise."""
        return self.read_pair(key, config_id, expected).baseline()

    def load_meta(self, key: str, config_id: str) -> dict | None:
        """The JSON half alone (speed records), or None when it does not exist."""
        _, meta_path = self.paths(key, config_id)
        return read_meta(meta_path, self.root) if meta_path.exists() else None

    def write(self, key: str, config_id: str, arrays: dict[str, torch.Tensor], meta: dict) -> tuple[Path, Path]:
        """Write both files, each atomically (temp file + rename), the .npz first: readers and other
        xdist workers see the old file or the new one, never half of one, and the JSON records the
        .npz's sha256, so a pair torn by a kill between the two renames is reported as such.
        Another process writing the same pair waits for this one (a lock on the directory).
        OSError when the directory cannot be written or leads outside the baseline directory."""
        npz, meta_path = self.paths(key, config_id)
        self._make_dir(npz.parent)
        data = _npz_bytes({n: t.detach().to(torch.float32).cpu().numpy() for n, t in arrays.items()})
        meta = {**meta, "schema_version": SCHEMA_VERSION, "npz_sha256": hashlib.sha256(data).hexdigest()}
        _within_caps(npz, arrays, data)
        with _locked(npz.parent):
            _remove_leftovers(npz, meta_path)
            _atomic_write(npz, data)
            _atomic_write(meta_path, _json_bytes(meta))
        return npz, meta_path

    def _make_dir(self, directory: Path) -> None:
        """``directory`` and its parents, refused (OSError naming where it leads) when a link on
        the way leaves the baseline directory: an update writes only where it says it does. The
        nearest existing ancestor is judged before anything is created."""
        existing = directory
        while not existing.exists() and existing != existing.parent and existing != self.root:
            existing = existing.parent
        leads = outside(existing, self.root)
        if leads is None:
            directory.mkdir(parents=True, exist_ok=True)
            leads = outside(directory, self.root)  # a link made meanwhile
        if leads is not None:
            raise OSError(errno.EXDEV, f"a link that leads outside the baseline directory {self.root} (to {leads}); "
                          "nothing written", str(directory))

    def move_aside(self, paths: list[Path]) -> list[tuple[Path, Path]]:
        """Rename each existing file to a free ``<name>.unreadable[-N]`` beside it (kept, never
        overwritten); returns (from, to) of each. OSError, nothing moved, when a directory holding
        one leads outside the baseline directory."""
        for path in paths:
            self._make_dir(path.parent)
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
        self._make_dir(meta_path.parent)
        with _locked(meta_path.parent):
            _atomic_write(meta_path, _json_bytes({**meta, "schema_version": SCHEMA_VERSION}))
        return meta_path


# ---- reading -----------------------------------------------------------------------------------

# Bounds on what one golden may cost to read. The project's largest golden is 250 KB (36 KB of JSON);
# an attention golden of dq, dk, dv at 4 x 16 x 2048 x 128 is 768 MiB of float32 and would be refused:
# goldens are float32 references of test-sized inputs, not activations of a training run.
MAX_FILE_BYTES = 256 << 20  # either file as stored
MAX_ARRAY_BYTES = 256 << 20  # an .npz's arrays once inflated, all together
MAX_MEMBERS = 64  # arrays in one .npz
MAX_JSON_BYTES = 8 << 20
MAX_STRING = 4096  # characters of any string in a JSON
SHOWN = 120  # characters of a value from a file that a message repeats


def shown(value, limit: int = SHOWN) -> str:
    """``repr(value)`` cut to ``limit`` characters, saying how long it was: a value from a file is
    repeated in messages, and a file may hold a string of 500 MB."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def named(name: str, limit: int = 60) -> str:
    """A name from a file as a message shows it: as it is when short and printable, else ``shown``."""
    return name if isinstance(name, str) and len(name) <= limit and name.isprintable() else shown(name, limit)


def _kind_of_file(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def outside(path: Path, root: Path | None) -> Path | None:
    """Where ``path`` really leads when that is outside ``root`` (a link on the way leaves the
    baseline directory), else None."""
    if root is None:
        return None
    real, base = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    return None if real == base or base in real.parents else real


def read_bounded(path: Path, limit: int, root: Path | None = None) -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes inside ``root`` (links
    followed only while they stay inside it); BaselineError naming the path otherwise. Opened
    non-blocking, so a FIFO under a golden's name is refused, not waited on."""
    leads = outside(path, root)
    if leads is not None:
        raise BaselineError(f"{path}: a link that leads outside the baseline directory {root} (to {leads}): not read")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as e:
        raise BaselineError(f"{path}: cannot be read ({e.strerror or e})") from e
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BaselineError(f"{path}: {_kind_of_file(info.st_mode)}, not a regular file: not read")
        if info.st_size > limit:
            raise BaselineError(f"{path}: {info.st_size} bytes, more than the {limit} a golden may be: not read")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:  # grew while read
        raise BaselineError(f"{path}: more than the {limit} bytes a golden may be: not read")
    return data


def read_pair(npz: Path, meta_path: Path, root: Path | None = None,
              expected: dict[str, tuple[int, ...]] | None = None) -> StoredPair:
    """The two files of a baseline, each read on its own, errors kept (nothing raised). ``root``:
    the baseline directory no read may leave; ``expected``: the shapes of the case's outputs, no
    stored array larger than which is inflated."""
    pair = StoredPair(npz, meta_path)
    if meta_path.exists():
        try:
            pair.meta = read_meta(meta_path, root)
        except BaselineError as e:
            pair.json_error = e
    if npz.exists():
        try:
            pair.arrays, pair.npz_sha256 = read_arrays(npz, root, expected)
        except BaselineError as e:
            pair.npz_error = e
    return pair


@dataclass(frozen=True)
class NpzMember:
    """One array of an .npz as its header declares it (nothing inflated)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    fortran_order: bool
    stored_bytes: int  # the member's uncompressed size as the archive declares it

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def npz_members(path: Path, archive: zipfile.ZipFile,
                expected: dict[str, tuple[int, ...]] | None = None) -> list[NpzMember]:
    """The members of an .npz from their headers, checked before any array is inflated: unique
    ``.npy`` names, at most ``MAX_MEMBERS``, float32 C-order arrays whose declared size is the
    stored size, at most ``MAX_ARRAY_BYTES`` together. BaselineError naming what is wrong."""
    infos = archive.infolist()
    if len(infos) > MAX_MEMBERS:
        raise BaselineError(f"{path}: {len(infos)} members, more than the {MAX_MEMBERS} a golden may hold: not read")
    names = [i.filename for i in infos]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise BaselineError(f"{path}: the member {named(repeated[0])} appears {names.count(repeated[0])} times "
                            "(which one judges would be the reader's choice): not read")
    members, total = [], 0
    for info in infos:
        if not info.filename.endswith(".npy"):
            raise BaselineError(f"{path}: member {named(info.filename)} is not an .npy array: not read")
        # bzip2 and LZMA inflate a whole block at the first read, with no bound on its output; an
        # encrypted member asks for a password
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED) or info.flag_bits & 0x1:
            raise BaselineError(f"{path}: member {named(info.filename)} is compressed with method "
                                f"{info.compress_type}{' and encrypted' if info.flag_bits & 0x1 else ''}, not stored or "
                                "deflated as goldens are written: not read")
        name = info.filename[:-4]
        with archive.open(info) as f:
            shape, fortran, dtype, header = _npy_header(path, name, f)
        if dtype.hasobject:
            raise BaselineError(f"{path}: {named(name)} holds Python objects (a pickle): never loaded")
        if dtype != np.float32:
            raise BaselineError(f"{path}: {named(name)} has dtype {dtype}, expected float32")
        if fortran:
            raise BaselineError(f"{path}: {named(name)} is stored in Fortran order, not as written: not read")
        member = NpzMember(name, tuple(shape), dtype, fortran, info.file_size)
        if header + member.nbytes != info.file_size:
            raise BaselineError(f"{path}: {named(name)} declares {shape} ({member.nbytes} bytes) but the archive "
                                f"stores {info.file_size - header}: not read")
        if expected is not None:
            _check_expected(path, member, expected)
        total += member.nbytes
        if total > MAX_ARRAY_BYTES:
            raise BaselineError(f"{path}: its arrays declare more than the {MAX_ARRAY_BYTES} bytes a golden may "
                                f"inflate to ({named(name)} {shape}): not read")
        members.append(member)
    return members


_NPY_HEADER_MAX = 10_000  # characters: what numpy itself allows an .npy header, before reading it


def _npy_header(path: Path, name: str, f) -> tuple[tuple, bool, np.dtype, int]:
    """(shape, fortran order, dtype, header length) of an .npy stream, its declared header length
    checked before the header is read (a 2.0 header may declare 4 GiB)."""
    start = f.read(10)
    if len(start) < 10 or start[:6] != b"\x93NUMPY":
        raise BaselineError(f"{path}: {named(name)} is not an .npy array: not read")
    version = (start[6], start[7])
    if version == (1, 0):
        size, head = int.from_bytes(start[8:10], "little"), start
    elif version == (2, 0):
        head = start + f.read(2)
        size = int.from_bytes(head[8:12], "little")
    else:
        raise BaselineError(f"{path}: {named(name)} has .npy format {version}, not 1.0 or 2.0: not read")
    if size > _NPY_HEADER_MAX:
        raise BaselineError(f"{path}: {named(name)} declares a header of {size} bytes: not read")
    stream = io.BytesIO(head + f.read(size))
    np.lib.format.read_magic(stream)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read(stream)
    return shape, fortran, dtype, len(head) + size


def _zip_entries(path: Path, data: bytes) -> None:
    """Refuse an archive whose end record declares more members than a golden holds, before its
    central directory is parsed (5.6 million entries cost 2.8 GB to parse). A golden never needs
    the zip64 end record (no 65535 members, no 4 GiB), so one that asks for it is refused too."""
    end = data.rfind(b"PK\x05\x06", max(0, len(data) - (1 << 16) - 22))
    if end < 0 or len(data) < end + 22:
        return  # not a zip: zipfile says so
    entries = int.from_bytes(data[end + 10:end + 12], "little")
    if entries > MAX_MEMBERS:
        raise BaselineError(f"{path}: declares {entries} members, more than the {MAX_MEMBERS} a golden may hold: not read")


def read_arrays(path: Path, root: Path | None = None,
                expected: dict[str, tuple[int, ...]] | None = None) -> tuple[dict[str, torch.Tensor], str]:
    """The float32 arrays of an .npz and the sha256 of its bytes; BaselineError for anything else.
    With ``expected`` (the case's output shapes), an array declared larger than the case's output
    of that name, or one the case has no output for and larger than a small one, is not inflated.

    Any exception counts: a damaged archive raises what the layer that meets the damage raises
    (zipfile.BadZipFile, zlib.error, NotImplementedError for an unknown compression method,
    tokenize.TokenError or SyntaxError from a garbled .npy header, ValueError, EOFError, ...)."""
    data = read_bounded(path, MAX_FILE_BYTES, root)
    if data[:6] == b"\x93NUMPY":
        raise BaselineError(f"{path}: a single array (an .npy saved under the .npz name), "
                            "not an .npz archive of named arrays")
    _zip_entries(path, data)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = npz_members(path, archive, expected)
            arrays = {}
            for m in members:
                with archive.open(m.name + ".npy") as f:
                    arrays[m.name] = np.lib.format.read_array(f, allow_pickle=False)
    except BaselineError:
        raise
    except Exception as e:
        raise BaselineError(f"{path}: corrupt or truncated baseline tensors ({type(e).__name__}: {shown(str(e))})") from e
    return {n: torch.from_numpy(a) for n, a in arrays.items()}, hashlib.sha256(data).hexdigest()


_SMALL_ARRAY = 1 << 20  # bytes: a stored array the case has no output for, read to name it


def _check_expected(path: Path, m: NpzMember, expected: dict[str, tuple[int, ...]]) -> None:
    want = expected.get(m.name)
    if want is None and m.nbytes > _SMALL_ARRAY:
        raise BaselineError(f"{path}: holds {named(m.name)} {m.shape}, an output this case does not have "
                            f"(it has {sorted(expected)}): not read")
    if want is not None and math.prod(m.shape) > math.prod(want):
        raise BaselineError(f"{path}: {named(m.name)} is {m.shape}, larger than this case's output {tuple(want)}: "
                            "not read (a changed shape is re-accepted, not compared)")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        repeated = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"the key {shown(repeated)} appears {sum(k == repeated for k, _ in pairs)} times in one "
                         "object (which one judges would be the reader's choice)")
    return out


_INT_DIGITS = 30  # an integer in a golden is a count or a seed; longer ones overflow float()


def _bounded_int(text: str) -> int:
    if len(text) > _INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def read_meta(path: Path, root: Path | None = None) -> dict:
    """A baseline's JSON, bounded (``read_bounded``, no key repeated), its structure and types
    checked (``_meta_problem``)."""
    data = read_bounded(path, MAX_JSON_BYTES, root)
    try:
        meta = json.loads(data.decode("utf-8"), object_pairs_hook=_unique_keys, parse_int=_bounded_int)
    except Exception as e:  # UnicodeDecodeError, JSONDecodeError, RecursionError, a repeated key, ...
        raise BaselineError(f"{path}: corrupt baseline metadata ({type(e).__name__}: {shown(str(e))})") from e
    if not isinstance(meta, dict):
        raise BaselineError(f"{path}: corrupt baseline metadata (not a JSON object)")
    version = meta.get("schema_version")
    if type(version) is int and version > SCHEMA_VERSION:
        raise BaselineError(f"{path}: written by a newer pytest-precision (baseline schema {version}, this one reads "
                            f"{SCHEMA_VERSION}): upgrade pytest-precision", newer_schema=version)
    if version != SCHEMA_VERSION or type(version) is not int:
        raise BaselineError(f"{path}: baseline schema version {shown(version)}, this pytest-precision reads version "
                            f"{SCHEMA_VERSION}")
    problem = _long_string(meta) or _meta_problem(meta)
    if problem:
        raise BaselineError(f"{path}: corrupt baseline metadata ({problem})")
    return meta


MAX_DEPTH = 12  # nesting of a golden's JSON (budgets.<key>.outputs.<name>.budget.<field>.<parameter> is 6)


def _long_string(meta: dict) -> str | None:
    """The first string (key or value) longer than MAX_STRING, or nesting deeper than MAX_DEPTH,
    as a sentence (iterative: a deep file is not a deep recursion)."""
    stack = [(meta, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            return f"{where} is nested {depth} levels deep, more than the {MAX_DEPTH} a golden has"
        if isinstance(value, str):
            if len(value) > MAX_STRING:
                return f"{where or 'a value'} is a string of {len(value)} characters, more than the {MAX_STRING} a golden holds"
            continue
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for k, v in items:
            if isinstance(k, str) and len(k) > MAX_STRING:
                return (f"a key under {where or 'the top level'} is {len(k)} characters, more than the {MAX_STRING} a "
                        "golden holds")
            stack.append((v, f"{where}.{named(str(k), 40)}" if where else named(str(k), 40), depth + 1))
    return None


def is_number(v) -> bool:
    """A JSON number (a bool is not one)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)



def same_value(a, b) -> bool:
    """Two values read from goldens are the same: equal, a NaN the same as a NaN (a stored NaN
    rewritten is no change), lists element by element."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if is_number(a) and is_number(b):
        return a == b
    return type(a) is type(b) and a == b


def _kind(v) -> str:
    return "null" if v is None else {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(v), "a number" if is_number(v) else type(v).__name__)


def _scalar(v) -> bool:
    return v is None or isinstance(v, (str, bool)) or is_number(v)


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
            for fp, rec in speed.items():
                checks.append(_object_of(f"speed.{named(fp)}", rec, lambda v: _scalar(v) or _numbers(v),
                                         "plain values or lists of numbers"))
                if isinstance(rec, dict):
                    checks.append(_speed_problem(f"speed.{named(fp)}", rec))
    return next((c for c in checks if c), None)


# the speed record's fields the gate reads: times and bytes, finite and not negative
_SPEED_FIELDS = ("median_s", "samples", "calibration", "peak_bytes")


def _speed_problem(where: str, record: dict) -> str | None:
    for name in _SPEED_FIELDS:
        values = record.get(name)
        if name in ("samples", "calibration") and values is not None and not (
                isinstance(values, list) and all(is_number(v) for v in values)):
            return f"{where}.{name} is not a list of numbers"
        for v in values if isinstance(values, list) else [values]:
            if is_number(v) and not (math.isfinite(v) and v >= 0):
                return f"{where}.{name} holds {v!r}: a time or a size is finite and not negative"
    return None


# The limits pytest-precision itself writes as infinite, and the accepted value that makes them so
# (training.baseline.budget_for): a training golden accepted with a gradient-norm or update ratio
# that was not finite (or zero), or a loss deviation that was not finite, has an upper limit of
# +Infinity on it; one accepted with an SQNR of -Infinity or NaN (a non-finite gradient or
# parameter), a lower limit of -Infinity. Such a limit is read, and the check says the metric is
# not judged; any other loosening infinity is refused.
UNLIMITED_WHEN = {"max_grad_norm_log_ratio": "grad_norm_ratio", "max_update_log_ratio": "update_ratio",
                  "max_loss_deviation": "max_loss_deviation", "min_grad_sqnr_db": "grad_sqnr_db",
                  "min_worst_grad_sqnr_db": "worst_grad_sqnr_db", "min_param_sqnr_db": "param_sqnr_db"}


def _loosening(field: str, v) -> bool:
    """Whether ``v`` is the infinity that lets every result pass (``min_*`` are lower bounds)."""
    return is_number(v) and v == (-math.inf if field.startswith("min_") else math.inf)


def _accepted_value(field: str, accepted, name: str | None):
    source = UNLIMITED_WHEN.get(field)
    v = accepted.get(source) if source and isinstance(accepted, dict) else None
    return v.get(name) if isinstance(v, dict) and name is not None else v


def _unlimited_by_acceptance(field: str, accepted, name: str | None = None) -> bool:
    v = _accepted_value(field, accepted, name)
    if not is_number(v):
        return False
    if field.startswith("min_"):
        return math.isnan(v) or v == -math.inf
    return not math.isfinite(v) or (field.endswith("_log_ratio") and v <= 0)


def unlimited(entry: dict) -> list[str]:
    """The limits of one stored output (``{"budget", "accepted"}``) that are infinite because
    what was accepted was not finite, as "field (accepted source value)"."""
    budget, accepted = entry.get("budget") or {}, entry.get("accepted") or {}
    out = []
    for f, value in budget.items():
        for name, v in (value.items() if isinstance(value, dict) else [(None, value)]):
            if _loosening(f, v) and _unlimited_by_acceptance(f, accepted, name):
                at = f"{f}.{named(name)}" if name is not None else f
                out.append(f"{at} (accepted {UNLIMITED_WHEN[f]} {_accepted_value(f, accepted, name)!r})")
    return out


def _limit_problem(where: str, field: str, value, accepted=None) -> str | None:
    """Why a stored limit cannot judge: NaN, or infinite in the direction that lets everything
    pass, unless pytest-precision wrote it so (``UNLIMITED_WHEN``)."""
    for name, v in (value.items() if isinstance(value, dict) else [(None, value)]):
        if not is_number(v):
            continue
        at = f"{where}.{field}" + (f".{named(name)}" if name is not None else "")
        if math.isnan(v):
            return f"{at} is NaN: a NaN limit judges nothing (rewrite the golden)"
        if _loosening(field, v) and not _unlimited_by_acceptance(field, accepted, name):
            return (f"{at} is {v!r}: a limit that lets every result pass (pytest-precision writes one only where "
                    "what it accepted was not finite)")
    return None


def _plain_list(v) -> bool:
    return isinstance(v, list) and all(_scalar(x) or _plain_list(x) for x in v)


def _numbers(v) -> bool:
    return isinstance(v, list) and all(is_number(x) or x is None for x in v)


def _object_of(where: str, value, ok, what: str) -> str | None:
    if not isinstance(value, dict):
        return f"{where} is {_kind(value)}, expected an object"
    bad = next((k for k, v in value.items() if not ok(v)), None)
    if bad is None:
        return None
    return f"{where}.{shown(bad, 60) if len(str(bad)) > 60 else bad} is {_kind(value[bad])}, expected one of {what}"


def _limit(v) -> bool:
    return v is None or is_number(v) or (isinstance(v, dict) and all(is_number(x) for x in v.values()))


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
        where = f"budgets.{named(key)}"
        if not isinstance(record, dict):
            return f"{where} is {_kind(record)}, expected an object"
        outputs = record.get("outputs")
        if not isinstance(outputs, dict):
            return f"{where}.outputs is {_kind(outputs)}, expected an object"
        for name, entry in outputs.items():
            name = named(name)
            if not isinstance(entry, dict):
                return f"{where}.outputs.{name} is {_kind(entry)}, expected an object"
            # a training budget holds some limits per parameter: objects of numbers
            budget = entry.get("budget")
            problem = (_object_of(f"{where}.outputs.{name}.budget", budget, _limit,
                                  "numbers, null or objects of numbers")
                       or next((p for f, v in budget.items()
                                if (p := _limit_problem(f"{where}.outputs.{name}.budget", f, v,
                                                        entry.get("accepted")))), None)
                       or _object_of(f"{where}.outputs.{name}.accepted", entry.get("accepted", {}), _plain_value,
                                     "numbers, strings, null, or lists and objects of them")
                       or _object_of(f"{where}.outputs.{name}.peer", entry.get("peer", {}),
                                     lambda v: v is None or is_number(v), "numbers or null"))
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


def _within_caps(npz: Path, arrays: dict[str, torch.Tensor], data: bytes) -> None:
    """OSError (EFBIG) for a golden every later read would refuse: more members, bytes or inflated
    bytes than a read takes."""
    inflated = sum(t.numel() * 4 for t in arrays.values())
    if len(arrays) > MAX_MEMBERS or len(data) > MAX_FILE_BYTES or inflated > MAX_ARRAY_BYTES:
        raise OSError(errno.EFBIG, f"{len(arrays)} arrays of {inflated} bytes: more than a golden may hold "
                      f"({MAX_MEMBERS} arrays, {MAX_ARRAY_BYTES} bytes); give the case smaller shapes", str(npz))


@contextlib.contextmanager
def _locked(directory: Path):
    """An exclusive lock on ``directory`` (POSIX ``flock``; elsewhere none) while a pair is written
    in it: two update processes on one baseline directory write a pair one after the other."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:  # a file system without flock on directories (NFS: EBADF): unlocked
            if e.errno not in (errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
        yield
    finally:
        os.close(fd)  # releases the lock


def _atomic_write(path: Path, data: bytes) -> None:
    # the temporary name carries this process's pid: another writer removes it only once this
    # process is gone (``_remove_leftovers``)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
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


def process_alive(pid: int) -> bool:
    """Whether a process of this machine with ``pid`` may be running (True where it cannot be
    told: another user's process; Windows, where signal 0 is CTRL_C_EVENT, not a probe)."""
    if os.name == "nt":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # EPERM: another user's; a pid out of range
        return True
    return True


def _remove_leftovers(*paths: Path) -> None:
    """Temporary files of these paths that an interrupted write left (``.fp32.npz.<pid>.x1y2.tmp``),
    of processes no longer alive (a concurrent writer's are its own). A name without a pid (an
    older version's) is removed."""
    for path in paths:
        for leftover in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
            pid = leftover.name[len(path.name) + 2:].split(".", 1)[0]
            # this process writes one pair at a time: a leftover of its own is an interrupted write
            if pid.isdigit() and int(pid) != os.getpid() and process_alive(int(pid)):
                continue
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
