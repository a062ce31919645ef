"""The hierarchical cache's storage tier (--hicache-storage-backend): KV pages below the host
tier, keyed by their block hash.

The radix cache decides every store, fetch and drop (rust/engine/src/radix_storage.rs) and the
host tier runs them in plan order (host_kv_cache.py): a page the host tier lets go is stored
from its host slot, a prefix hit in storage is fetched into a host slot and loaded to the device
from there. A backend only moves one page's bytes (every layer's K and V) by key.

Backends: `file` (LocalFileStorage), one file per page. The radix cache's index of the tier
starts empty and lives as long as the server, so each rank of each server run writes a
directory of its own (under one per model and KV layout), removed when the worker exits: no
server ever reads or deletes another's pages.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

DEFAULT_PATH = "/tmp/tokenspeed-hicache"
DEFAULT_CAPACITY_GB = 16.0


class KVStorage(Protocol):
    """Pages of KV by key: `put` stores one, `get` fills `out` with one (False if absent),
    `delete` forgets one."""

    def put(self, key: int, page: np.ndarray) -> None: ...

    def get(self, key: int, out: np.ndarray) -> bool: ...

    def delete(self, key: int) -> None: ...


@dataclass(frozen=True)
class StorageSettings:
    """--hicache-storage-backend and its extra config."""

    backend: str
    path: str = DEFAULT_PATH
    capacity_gb: float = DEFAULT_CAPACITY_GB

    @classmethod
    def parse(cls, backend: str, extra: str | None) -> StorageSettings:
        """The settings, or ValueError naming what is wrong with the extra config."""
        raw: dict[str, Any] = {}
        if extra:
            try:
                raw = json.loads(extra)
            except json.JSONDecodeError as e:
                raise ValueError(f"--hicache-storage-backend-extra-config is not JSON: {e}") from e
            if not isinstance(raw, dict):
                raise ValueError("--hicache-storage-backend-extra-config must be a JSON object")
        unknown = sorted(set(raw) - {"path", "capacity_gb"})
        if unknown:
            raise ValueError(f"--hicache-storage-backend-extra-config: unknown keys {unknown} "
                             "(the file backend reads path and capacity_gb)")
        capacity = raw.get("capacity_gb", DEFAULT_CAPACITY_GB)
        if isinstance(capacity, bool) or not isinstance(capacity, (int, float)) or capacity <= 0:
            raise ValueError("--hicache-storage-backend-extra-config: capacity_gb must be a "
                             f"positive number, not {capacity!r}")
        path = raw.get("path", DEFAULT_PATH)
        if not isinstance(path, str) or not path:
            raise ValueError("--hicache-storage-backend-extra-config: path must be a directory")
        return cls(backend, path, float(capacity))

    def pages(self, bytes_per_page: int) -> int:
        """Pages the tier may hold."""
        return int(self.capacity_gb * 1e9) // bytes_per_page


class LocalFileStorage:
    """One file per page, `<dir>/<key as 16 hex digits>.kv`, written whole then renamed into
    place (a reader never sees half a page)."""

    def __init__(self, directory: Path, page_bytes: int, remove_at_exit: bool = False) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.dir = directory
        self.page_bytes = page_bytes
        if remove_at_exit:
            weakref.finalize(self, shutil.rmtree, directory, ignore_errors=True)

    def _path(self, key: int) -> Path:
        return self.dir / f"{key & (2**64 - 1):016x}.kv"

    def put(self, key: int, page: np.ndarray) -> None:
        path = self._path(key)
        tmp = path.with_suffix(".tmp")
        page.tofile(tmp)
        os.replace(tmp, path)

    def get(self, key: int, out: np.ndarray) -> bool:
        try:
            with open(self._path(key), "rb") as f:
                n = f.readinto(memoryview(out).cast("B"))
        except FileNotFoundError:
            return False
        if n != out.nbytes:
            raise OSError(f"storage page {key:#x}: {n} of {out.nbytes} bytes")
        return True

    def delete(self, key: int) -> None:
        self._path(key).unlink(missing_ok=True)


def open_storage(settings: StorageSettings, identity: dict[str, Any], page_bytes: int) -> KVStorage:
    """The backend `settings` names: a fresh directory of this run under one for `identity`
    (what makes a page's bytes mean the same KV: model, dtypes, page size, layers, heads,
    rank)."""
    if settings.backend != "file":
        raise ValueError(f"--hicache-storage-backend {settings.backend} is not built")
    tag = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    parent = Path(settings.path) / tag
    parent.mkdir(parents=True, exist_ok=True)
    run = Path(tempfile.mkdtemp(prefix="run-", dir=parent))
    return LocalFileStorage(run, page_bytes, remove_at_exit=True)
