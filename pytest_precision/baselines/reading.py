"""Reading a golden, which is never trusted (a golden arrives in a pull request).

Any exception while reading either half, a JSON whose structure or types are not the documented
ones (``schema``), another schema, or a ``.npz`` that is not the one its JSON was written with, is
a :class:`BaselineError` naming the file. Each half is also read on its own (:func:`read_pair`),
so that an update keeps what it can still read. Every read is bounded before it costs anything
(:func:`read_bounded`, :func:`npz_members`): regular files only, never through a link that leaves
the baseline directory, at most ``MAX_FILE_BYTES``; an ``.npz``'s members are judged from their
headers (names unique, float32, at most ``MAX_MEMBERS``, the declared size the stored size, the
total at most ``MAX_ARRAY_BYTES``, each no larger than the case's output when a case reads it)
before anything is inflated; a JSON may not repeat a key, hold a string longer than ``MAX_STRING``,
nest deeper than ``MAX_DEPTH``, or hold a NaN or loosening infinite limit.

The limits (``MAX_*``): a file at most 256 MiB, a JSON at most 8 MiB; an ``.npz`` of at most 64
members (counted from the archive's end record, before its directory is parsed), stored or deflated
(bzip2 and LZMA inflate a whole block unbounded at the first read), not encrypted, an ``.npy`` header
of at most 10,000 bytes, float32 in C order, 256 MiB inflated in all (a 1 MiB deflate bomb declaring
1 GiB of zeros is refused in milliseconds); a JSON nested at most 12 levels, no integer of more than
30 digits, no string of more than 4096 characters. An update refuses to write a golden past them.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import stat
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .schema import SCHEMA_VERSION, BaselineError, meta_problem, named, shown

__all__ = ["MAX_FILE_BYTES", "MAX_ARRAY_BYTES", "MAX_MEMBERS", "MAX_JSON_BYTES", "MAX_STRING", "MAX_DEPTH", "Baseline",
           "StoredPair", "NpzMember", "outside", "read_bounded", "read_pair", "npz_members", "read_arrays", "read_meta"]

# Bounds on what one golden may cost to read. The project's largest golden is 250 KB (36 KB of JSON);
# an attention golden of dq, dk, dv at 4 x 16 x 2048 x 128 is 768 MiB of float32 and would be refused:
# goldens are float32 references of test-sized inputs, not activations of a training run.
MAX_FILE_BYTES = 256 << 20  # either file as stored
MAX_ARRAY_BYTES = 256 << 20  # an .npz's arrays once inflated, all together
MAX_MEMBERS = 64  # arrays in one .npz
MAX_JSON_BYTES = 8 << 20
MAX_STRING = 4096  # characters of any string in a JSON


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
    checked (``meta_problem``)."""
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
    problem = _long_string(meta) or meta_problem(meta)
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

