"""What bounds the plan/result rings' shared memory beyond the step's tokens: the top logprobs a
result carries per token (`--max-logprobs`), and the check that the rings fit at all, made
before any worker starts (a /dev/shm that fills mid-run kills the server with SIGBUS)."""

from __future__ import annotations

import os
from typing import Any

# Slots of each ring (plans one way, results the other) of one engine's channel.
RING_SLOTS = 4
# A slot's length is a u32 in the ring header, rounded up to 64 (rust/ipc/src/channel.rs).
MAX_SLOT_BYTES = (1 << 32) - 128
SHM_DIR = "/dev/shm"


class RingSizeError(ValueError):
    """The rings cannot be laid out for these flags: says which flags size them."""


def logprobs_width(max_logprobs: int, vocab_size: int) -> int:
    """Top-logprob columns a result holds per token: `--max-logprobs` within the model's
    vocabulary (-1: all of it). The Rust front end refuses a request past the cap, and the
    worker never returns more columns than its logits have, so every result fits."""
    if max_logprobs >= 0:
        return min(max_logprobs, vocab_size) if vocab_size else max_logprobs
    if not vocab_size:
        raise RingSizeError("--max-logprobs -1 (the whole vocabulary) needs the model's "
                            "vocab_size in config.json; give a number instead")
    return vocab_size


def shm_room(path: str = SHM_DIR) -> int | None:
    """Bytes still free in the shared-memory filesystem (None where there is none to ask)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check_rings(cfg: Any, slot_bytes: int, plain_bytes: int, engines: int, slots: int, width: int,
                room: int | None) -> None:
    """Refuse a slot the ring cannot index, or top logprobs that /dev/shm (`room` bytes free)
    could not hold once every result slot fills with them, naming the flags that size them: the
    largest result is every token of a step with `width` top logprobs each (sampled and prompt
    tokens). `plain_bytes` is the slot without top logprobs: segments are sparse, and the rest
    of a slot is sized for a worst case that does not fill it in practice, as before."""
    wide = engines * RING_SLOTS * max(0, slot_bytes - plain_bytes)
    if slot_bytes <= MAX_SLOT_BYTES and (room is None or wide <= room):
        return
    mib = 1 << 20
    where = (f"a slot may hold at most {MAX_SLOT_BYTES // mib} MiB" if slot_bytes > MAX_SLOT_BYTES
             else f"{RING_SLOTS} result slots per engine need {wide // mib} MiB of shared memory for "
                  f"them, and {SHM_DIR} has {(room or 0) // mib} MiB free")
    raise RingSizeError(
        f"a plan/result ring slot of {slot_bytes // mib} MiB holds one step's largest result: "
        f"{width} top logprobs per token (--max-logprobs {cfg.max_logprobs}) for every token of a "
        f"step (--chunked-prefill-size {cfg.chunked_prefill_size}, --max-running-requests "
        f"{slots}), but {where}. Lower one of them.")
