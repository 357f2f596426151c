"""Writing a golden: atomic per file (temp file, fsync, rename), the umask honoured, the same
bytes for the same arrays, a lock on the pair's directory while both files are written (two
update processes never interleave the halves of one pair), and the temporary files an interrupted
write left removed first (those of processes no longer alive: temporary names carry the
writer's pid).

The lock covers the two writes, not the read that prepared them: two updates of one pair at once keep
the later one's budgets. On a file system without directory locks (NFS) the writes are unlocked."""
from __future__ import annotations

import contextlib
import errno
import glob
import io
import json
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch

from ..platform.processes import process_alive
from .reading import MAX_ARRAY_BYTES, MAX_FILE_BYTES, MAX_MEMBERS

__all__ = ["npz_bytes", "json_bytes", "within_caps", "locked", "atomic_write", "remove_leftovers"]


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
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


def json_bytes(meta: dict) -> bytes:
    return (json.dumps(meta, indent=2, sort_keys=True, allow_nan=True) + "\n").encode("utf-8")


_UMASK: list[int] = []


def _file_mode() -> int:
    """0666 less the process umask, as open() would create the file (mkstemp creates 0600)."""
    if not _UMASK:
        mask = os.umask(0)
        os.umask(mask)
        _UMASK.append(mask)
    return 0o666 & ~_UMASK[0]


def within_caps(npz: Path, arrays: dict[str, torch.Tensor], data: bytes) -> None:
    """OSError (EFBIG) for a golden every later read would refuse: more members, bytes or inflated
    bytes than a read takes."""
    inflated = sum(t.numel() * 4 for t in arrays.values())
    if len(arrays) > MAX_MEMBERS or len(data) > MAX_FILE_BYTES or inflated > MAX_ARRAY_BYTES:
        raise OSError(errno.EFBIG, f"{len(arrays)} arrays of {inflated} bytes: more than a golden may hold "
                      f"({MAX_MEMBERS} arrays, {MAX_ARRAY_BYTES} bytes); give the case smaller shapes", str(npz))


@contextlib.contextmanager
def locked(directory: Path):
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


def atomic_write(path: Path, data: bytes) -> None:
    # the temporary name carries this process's pid: another writer removes it only once this
    # process is gone (``remove_leftovers``)
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

def remove_leftovers(*paths: Path) -> None:
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
