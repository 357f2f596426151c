"""Golden baselines on disk: where they live, and the store every read and write goes through.

One baseline per test key and config: ``<root>/<key>/<config>.npz`` holds the float32 references,
one array per named output ("reference" when there is one; "out", "dq", "dk", "dv" for attention;
no pickle: loaded with ``allow_pickle=False``), ``<config>.json`` beside it holds the metadata
(schema version, torch version, device, config, seed, input spec and checksum, the sha256 of the
``.npz`` it was written with) and the accepted error budgets, keyed by numerics key.

Reading never trusts a file (``reading``, against the documented structure in ``schema``); writing
is atomic and locked (``writing``). The store adds where files live: a write stays inside the
baseline directory (a directory link that leaves it is refused, named with where it leads), and
a file that could not be read is moved aside, never overwritten: ``fp32.npz`` becomes
``fp32.npz.unreadable`` (``.unreadable-2``, ... when that is taken).
"""
from __future__ import annotations

import errno
import hashlib
import os
import re
from pathlib import Path

import torch

from .reading import Baseline, StoredPair, outside, read_meta, read_pair
from .schema import SCHEMA_VERSION, shown
from .writing import atomic_write, json_bytes, locked, npz_bytes, remove_leftovers, within_caps

__all__ = ["MOVED_ASIDE", "NAME_RULE", "BaselineStore", "checksum", "sanitize_key", "name_problem", "file_component"]

MOVED_ASIDE = ".unreadable"  # the suffix a file that could not be read is moved aside with

# target, regime and config names: what a baseline directory and pytest's -k expression both take
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")
NAME_RULE = ("1 to 100 characters: ASCII letters (A-Z, a-z), digits and _ . + -, not starting with . + or -, not ending with ., "
             "and not a name Windows reserves for a device (CON, PRN, AUX, NUL, COM1-9, LPT1-9, with any extension)")
NAME_MAX = 100
# names Windows gives to devices in every directory, whatever the extension ("nul.txt" is NUL)
_RESERVED = re.compile(r"(con|prn|aux|nul|com[0-9¹²³]|lpt[0-9¹²³]|conin\$|conout\$)(\..*)?", re.IGNORECASE)


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
        data = npz_bytes({n: t.detach().to(torch.float32).cpu().numpy() for n, t in arrays.items()})
        meta = {**meta, "schema_version": SCHEMA_VERSION, "npz_sha256": hashlib.sha256(data).hexdigest()}
        within_caps(npz, arrays, data)
        with locked(npz.parent):
            remove_leftovers(npz, meta_path)
            atomic_write(npz, data)
            atomic_write(meta_path, json_bytes(meta))
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
        with locked(meta_path.parent):
            atomic_write(meta_path, json_bytes({**meta, "schema_version": SCHEMA_VERSION}))
        return meta_path
