"""Releasing and resuming a worker's memory (`/release_memory_occupation`,
`/resume_memory_occupation`; worker/ops.py runs them). Release keeps a host copy of the weights
and frees the device storage of every weight, buffer and KV page (each storage resized to zero
bytes, so the tensors and every view of them stay valid objects), drops the CUDA graphs and
returns the freed memory to the device. Resume gives each storage its bytes back, restores the
weights, zeroes the KV pages (the engine dropped its prefix cache: their contents meant nothing
any more) and captures the graphs again, since the storages now live at new addresses."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger("tokenspeed.worker.memory_ops")


@dataclass
class Released:
    """A released storage: its size, and (weights only) the host copy of its bytes."""

    storage: torch.UntypedStorage
    nbytes: int
    host: torch.UntypedStorage | None


def _storages(tensors: list[torch.Tensor]) -> list[torch.UntypedStorage]:
    """Each distinct storage behind `tensors` once (tied weights share one)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen[s.data_ptr()] = s
    return list(seen.values())


def release(runner: Any) -> str:
    """Frees the weights, the KV cache and the CUDA graphs of `runner`; returns a summary."""
    if getattr(runner, "released", None):
        raise RuntimeError("memory is already released")
    model = runner.model
    weights = _storages([*model.parameters(), *model.buffers()])
    kv = [s for s in _storages([*runner.kv_cache.k, *runner.kv_cache.v])
          if all(s.data_ptr() != w.data_ptr() for w in weights)]
    out: list[Released] = []
    for s in weights:
        host = torch.UntypedStorage(s.nbytes(), device="cpu")
        host.copy_(s)
        out.append(Released(s, s.nbytes(), host))
    out += [Released(s, s.nbytes(), None) for s in kv]
    done: list[Released] = []
    try:
        for r in out:
            r.storage.resize_(0)
            done.append(r)
    except RuntimeError:  # a storage that cannot be resized (e.g. borrowed from numpy)
        _restore(done)
        raise
    runner.had_graphs = any(g is not None for g in (runner.graphs, runner.extend_graphs,
                                                     runner.verify_graphs))
    runner.graphs = runner.extend_graphs = runner.verify_graphs = None
    if getattr(runner, "drafter", None) is not None:  # its graphs too (captured again on resume)
        runner.drafter.graphs = None
    runner.released = out
    gc.collect()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
        torch.cuda.empty_cache()
    freed = sum(r.nbytes for r in out)
    logger.info("memory released: %.1f MiB (weights kept on the host)", freed / 2**20)
    return f"released {freed / 2**20:.1f} MiB of weights and KV cache"


def resume(runner: Any) -> str:
    """Undoes `release`: the same tensors hold the same weights; KV pages are zero."""
    out: list[Released] | None = getattr(runner, "released", None)
    if not out:
        raise RuntimeError("memory is not released")
    _restore(out)
    for t in (*runner.kv_cache.k, *runner.kv_cache.v):
        t.zero_()
    runner.released = None
    if getattr(runner, "had_graphs", False):
        runner._capture_graphs()  # the old ones point at the storages' old addresses
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    logger.info("memory resumed")
    return "memory resumed"


def _restore(released: list[Released]) -> None:
    for r in released:
        r.storage.resize_(r.nbytes)
        if r.host is not None:
            r.storage.copy_(r.host)
