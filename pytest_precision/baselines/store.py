"""Golden baselines on disk: where they live, how they are read safely and written
atomically.

One baseline per test key and config: ``<root>/<key>/<config>.npz`` holds the float32 references,
one array per named output ("reference" when there is one; "out", "dq", "dk", "dv" for attention;
no pickle: loaded with ``allow_pickle=False``), ``<config>.json`` beside it holds the metadata
(schema version, torch version, device, config, seed, input spec and checksum) and the accepted
error budgets, keyed by device type so a CPU acceptance never vouches for a GPU.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

__all__ = ["SCHEMA_VERSION", "BaselineError", "Baseline", "BaselineStore", "checksum", "sanitize_key"]

SCHEMA_VERSION = 1
UPDATE_OPTION = "--precision-update-baselines"


class BaselineError(Exception):
    """A baseline file that cannot be trusted: corrupt, truncated, wrong schema or inconsistent."""


def checksum(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (dtype and shape included), to notice a generator change."""
    a = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{a.dtype}{tuple(a.shape)}".encode())
    h.update(a.view(torch.uint8).numpy().tobytes() if a.numel() else b"")
    return h.hexdigest()


def sanitize_key(key: str) -> str:
    """A relative path from a test key: '/'-separated parts, unsafe characters replaced by '_'."""
    parts = [re.sub(r"[^A-Za-z0-9._+-]", "_", p) for p in key.replace("::", "/").split("/") if p]
    parts = [p for p in parts if p not in (".", "..")]
    if not parts:
        raise ValueError(f"empty baseline key {key!r}")
    return "/".join(parts)


@dataclass
class Baseline:
    arrays: dict[str, torch.Tensor]  # float32 references by output name
    meta: dict = field(default_factory=dict)
    npz_path: Path | None = None
    json_path: Path | None = None


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

    def load(self, key: str, config_id: str) -> Baseline | None:
        """The baseline, or None when neither file exists; BaselineError naming the file otherwise."""
        npz, meta_path = self.paths(key, config_id)
        if not npz.exists() and not meta_path.exists():
            return None
        for p in (npz, meta_path):
            if not p.exists():
                raise BaselineError(f"{p}: missing (its companion {npz if p is meta_path else meta_path} exists)")
        meta = self._read_meta(meta_path)
        try:
            with np.load(npz, allow_pickle=False) as data:
                arrays = {name: np.array(data[name]) for name in data.files}
        except (zipfile.BadZipFile, ValueError, OSError, KeyError, EOFError) as e:
            raise BaselineError(f"{npz}: corrupt or truncated baseline tensors ({type(e).__name__}: {e})") from e
        for name, a in arrays.items():
            if a.dtype != np.float32:
                raise BaselineError(f"{npz}: {name} has dtype {a.dtype}, expected float32")
        return Baseline({n: torch.from_numpy(a) for n, a in arrays.items()}, meta, npz, meta_path)

    def load_meta(self, key: str, config_id: str) -> dict | None:
        """The JSON half alone (speed records), or None when it does not exist."""
        _, meta_path = self.paths(key, config_id)
        return self._read_meta(meta_path) if meta_path.exists() else None

    @staticmethod
    def _read_meta(meta_path: Path) -> dict:
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BaselineError(f"{meta_path}: corrupt baseline metadata ({e})") from e
        if not isinstance(meta, dict):
            raise BaselineError(f"{meta_path}: corrupt baseline metadata (not a JSON object)")
        version = meta.get("schema_version")
        if version != SCHEMA_VERSION:
            raise BaselineError(
                f"{meta_path}: baseline schema version {version!r}, this pytest-precision reads version "
                f"{SCHEMA_VERSION}; rewrite it with {UPDATE_OPTION} after checking the results"
            )
        return meta

    def write(self, key: str, config_id: str, arrays: dict[str, torch.Tensor], meta: dict) -> tuple[Path, Path]:
        """Write both files atomically (temp file + rename): readers and other xdist workers see
        the old file or the new one, never half of one."""
        npz, meta_path = self.paths(key, config_id)
        npz.parent.mkdir(parents=True, exist_ok=True)
        np_arrays = {n: t.detach().to(torch.float32).cpu().numpy() for n, t in arrays.items()}
        _atomic_write(npz, lambda f: np.savez_compressed(f, **np_arrays))
        body = json.dumps({"schema_version": SCHEMA_VERSION, **meta}, indent=2, sort_keys=True, allow_nan=True)
        _atomic_write(meta_path, lambda f: f.write((body + "\n").encode("utf-8")))
        return npz, meta_path


    def write_meta(self, key: str, config_id: str, meta: dict) -> Path:
        """Rewrite the JSON beside an existing baseline (speed records), atomically."""
        _, meta_path = self.paths(key, config_id)
        body = json.dumps({**meta, "schema_version": SCHEMA_VERSION}, indent=2, sort_keys=True, allow_nan=True)
        _atomic_write(meta_path, lambda f: f.write((body + "\n").encode("utf-8")))
        return meta_path


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
