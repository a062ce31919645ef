"""The hierarchical cache's storage tier (--hicache-storage-backend): KV pages below the host
tier, keyed by their block hash.

The radix cache decides every store, fetch and drop (rust/engine/src/radix_storage.rs) and the
host tier runs them in plan order (host_kv_cache.py): a page the host tier lets go is stored
from its host slot, a prefix hit in storage is fetched into a host slot and loaded to the device
from there. A backend only moves one page's bytes (every layer's K and V) by key.

Backends: `file` (LocalFileStorage), one raw file per page, written by background threads and
read straight into the host slots. The radix cache's index of the tier starts empty and lives
as long as the server, so each rank of each server run writes a directory of its own (under one
per model and KV layout), removed when the worker exits: no server ever reads or deletes
another's pages.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import shutil
import tempfile
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

DEFAULT_PATH = "/tmp/tokenspeed-hicache"
DEFAULT_CAPACITY_GB = 16.0
# Host memory of the file backend's pages waiting to be written (64 pages of an 8B model).
STAGING_BYTES = 128 << 20


class KVStorage(Protocol):
    """Pages of KV by key. A page is given as `parts`, 1-D byte arrays whose concatenation is
    the page (every layer's K and V, views of its host slot).

    `put` stores one (it may return before the bytes are written, but has copied them: the
    caller may overwrite `parts` at once); `get` fills each `outs[i]` with page `keys[i]` and
    says which were found, seeing every `put` made before it; `delete` forgets one; `flush`
    returns once every earlier `put` and `delete` is done (and raises what failed)."""

    def put(self, key: int, parts: Sequence[np.ndarray]) -> None: ...

    def get(self, keys: Sequence[int], outs: Sequence[Sequence[np.ndarray]]) -> list[bool]: ...

    def delete(self, key: int) -> None: ...

    def flush(self) -> None: ...


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
    """One file per page, `<dir>/<key as 16 hex digits>.kv`: the page's bytes, raw.

    Stores leave the caller's thread: `put` copies the page into a staging buffer and one of
    `threads` writer threads writes it (to a temporary name, then renamed into place: a reader
    never sees half a page; a key's puts and deletes all go to one thread, in order). At most
    `queue_pages` pages wait (default: STAGING_BYTES of them); one more `put` waits for a
    buffer, so a disk slower than the stores slows them down rather than filling memory. A
    `get` of a page still waiting is served from its buffer; others are read straight into
    `outs` (`preadv`, no staging copy), on `threads` threads when several are asked at once.
    `put`, `get` and `delete` are called from one thread (the worker's)."""

    def __init__(self, directory: Path, page_bytes: int, remove_at_exit: bool = False, *,
                 queue_pages: int | None = None, threads: int | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        # Default: up to 4 readers and 4 writers, leaving half the cores to the worker's step.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = threads or min(4, max(1, (cores or 2) // 2))
        self.dir = directory
        self.page_bytes = page_bytes
        depth = queue_pages or max(2, min(64, STAGING_BYTES // max(page_bytes, 1)))
        self._writer = _Writer(directory, page_bytes, depth, threads)
        self._readers = ThreadPoolExecutor(threads, thread_name_prefix="kv-storage-read")
        # Not a method of self: the finalizer must not keep self alive.
        self._close = weakref.finalize(self, _shut_down, self._writer, self._readers,
                                       directory if remove_at_exit else None)

    def put(self, key: int, parts: Sequence[np.ndarray]) -> None:
        self._writer.put(key, parts)

    def get(self, keys: Sequence[int], outs: Sequence[Sequence[np.ndarray]]) -> list[bool]:
        self._writer.check()
        found = [self._writer.read_pending(k, o) for k, o in zip(keys, outs)]
        todo = [i for i, f in enumerate(found) if not f]
        if len(todo) > 1:
            for i, ok in zip(todo, self._readers.map(lambda i: self._read(keys[i], outs[i]), todo)):
                found[i] = ok
        elif todo:
            found[todo[0]] = self._read(keys[todo[0]], outs[todo[0]])
        return found

    def delete(self, key: int) -> None:
        self._writer.delete(key)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        """Writes what waits and stops the threads; a directory made to be removed at exit is
        removed instead of written (its pages are discarded)."""
        self._close()

    def _read(self, key: int, out: Sequence[np.ndarray]) -> bool:
        try:
            fd = os.open(_page_path(self.dir, key), os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            n = os.preadv(fd, list(out), 0)
        finally:
            os.close(fd)
        if n != self.page_bytes:
            raise OSError(f"storage page {key & (2**64 - 1):#x}: {n} of {self.page_bytes} bytes")
        return True


def _page_path(directory: Path, key: int) -> str:
    return os.path.join(directory, f"{key & (2**64 - 1):016x}.kv")


class _Writer:
    """LocalFileStorage's writer threads: each key's puts and deletes in the order they were
    made (on the thread of key % threads), the pages that wait (by key) and the staging buffers
    they wait in."""

    def __init__(self, directory: Path, page_bytes: int, depth: int, threads: int) -> None:
        self.dir = directory
        self.page_bytes = page_bytes
        self.queues: list[queue.SimpleQueue[tuple[str, Any, Any]]] = [
            queue.SimpleQueue() for _ in range(max(1, threads))]
        self.free: queue.Queue[np.ndarray] = queue.Queue()
        self.made = 0  # staging buffers allocated, at most `depth`
        self.depth = depth
        self.lock = threading.Lock()
        self.pending: dict[int, np.ndarray] = {}  # the latest unwritten put of each key
        self.error: Exception | None = None
        self.discard = False  # closing a directory about to be removed: skip the writes
        self.threads = [threading.Thread(target=self._loop, args=(q,), name="kv-storage-write",
                                         daemon=True) for q in self.queues]
        for t in self.threads:
            t.start()

    def _queue(self, key: int) -> queue.SimpleQueue[tuple[str, Any, Any]]:
        return self.queues[key % len(self.queues)]

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the storage tier's writer failed: {self.error}") from self.error

    def put(self, key: int, parts: Sequence[np.ndarray]) -> None:
        self.check()
        buf = self._buffer()
        np.concatenate(parts, out=buf)
        with self.lock:
            self.pending[key] = buf
        self._queue(key).put(("put", key, buf))

    def _buffer(self) -> np.ndarray:
        try:
            return self.free.get_nowait()
        except queue.Empty:
            pass
        if self.made < self.depth:
            self.made += 1
            return np.empty(self.page_bytes, np.uint8)
        return self.free.get()  # every buffer waits to be written: wait for the disk

    def delete(self, key: int) -> None:
        self.check()
        with self.lock:
            self.pending.pop(key, None)
        self._queue(key).put(("delete", key, None))

    def read_pending(self, key: int, out: Sequence[np.ndarray]) -> bool:
        with self.lock:  # held while copying: the writer hands the buffer back under it
            buf = self.pending.get(key)
            if buf is None:
                return False
            at = 0
            for o in out:
                o.reshape(-1)[:] = buf[at:at + o.nbytes]
                at += o.nbytes
        return True

    def flush(self) -> None:
        done = [threading.Event() for _ in self.queues]
        for q, e in zip(self.queues, done):
            q.put(("flush", e, None))
        for e in done:
            e.wait()
        self.check()

    def stop(self, discard: bool) -> None:
        self.discard = discard
        for q in self.queues:
            q.put(("stop", None, None))
        for t in self.threads:
            t.join()

    def _loop(self, ops: queue.SimpleQueue[tuple[str, Any, Any]]) -> None:
        while True:
            op, arg, buf = ops.get()
            if op == "stop":
                return
            if op == "flush":
                arg.set()
                continue
            try:
                if self.error is None and not self.discard:
                    self._apply(op, arg, buf)
            except Exception as e:  # noqa: BLE001  (raised on the worker's thread next call)
                self.error = e
            finally:
                if buf is not None:
                    with self.lock:
                        if self.pending.get(arg) is buf:
                            del self.pending[arg]
                    self.free.put(buf)

    def _apply(self, op: str, key: int, buf: np.ndarray | None) -> None:
        path = _page_path(self.dir, key)
        if op == "delete":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
        assert buf is not None
        tmp = path[:-3] + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view, at = memoryview(buf), 0
            while at < len(view):  # a write may be short
                at += os.write(fd, view[at:])
        finally:
            os.close(fd)
        os.replace(tmp, path)


def _shut_down(writer: _Writer, readers: ThreadPoolExecutor, remove: Path | None) -> None:
    writer.stop(discard=remove is not None)
    readers.shutdown(wait=True)
    if remove is not None:
        shutil.rmtree(remove, ignore_errors=True)


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
