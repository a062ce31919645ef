"""A worker process: one per GPU rank. Loads the model, reports its KV capacity, then loops:
receive plan → forward → sample → send results (rank 0)."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

logger = logging.getLogger("tokenspeed.worker")


@dataclass
class WorkerSpec:
    """What a worker needs; picklable (workers are spawned, not forked)."""

    rank: int
    world_size: int
    model_path: str
    channel_name: str
    device: str
    dtype: str
    load_format: str
    page_size: int
    num_pages: int | None
    max_slots: int
    context_length: int
    seed: int
    mem_fraction_static: float | None
    attention_backend: str | None  # None/"auto": triton on CUDA, torch_native on CPU
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    chunked_prefill_size: int | None = None  # largest prefill step: sizes the memory profile
    log_level: str = "info"
    recv_timeout_ms: int = 1000


def _die_with_parent() -> None:
    """The worker must not outlive the server (PR_SET_PDEATHSIG = 1)."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)
    except OSError:
        pass


def run_worker(spec: WorkerSpec, ready: Connection) -> None:
    """Entry point of the worker process."""
    _die_with_parent()
    logging.basicConfig(
        level=spec.log_level.upper(), format=f"[worker {spec.rank}] %(asctime)s %(levelname)s %(message)s"
    )
    parent = os.getppid()
    try:
        from tokenspeed._core import WorkerChannel
        from tokenspeed.model_runner import ModelRunner
        from tokenspeed.plan import StepPlan

        runner = ModelRunner(
            spec.model_path,
            dtype=spec.dtype,
            device=spec.device,
            load_format=spec.load_format,
            page_size=spec.page_size,
            num_pages=spec.num_pages,
            max_slots=spec.max_slots,
            max_context_len=spec.context_length,
            seed=spec.seed,
            mem_fraction_static=spec.mem_fraction_static,
            attention_backend=spec.attention_backend,
            disable_cuda_graph=spec.disable_cuda_graph,
            cuda_graph_max_bs=spec.cuda_graph_max_bs,
            chunked_prefill_size=spec.chunked_prefill_size,
        )
        channel = WorkerChannel.attach(spec.channel_name, spec.rank)
        ready.send({"ok": True, "num_pages": int(runner.num_pages), "device": str(runner.device)})
        ready.close()
    except BaseException as e:  # noqa: BLE001  (report any start-up failure, then exit)
        ready.send({"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        ready.close()
        sys.exit(1)

    logger.info("ready: %d KV pages of %d tokens", runner.num_pages, spec.page_size)
    while True:
        try:
            raw = channel.recv(spec.recv_timeout_ms)
        except ConnectionError as e:  # ChannelShutdown: the server closed the channel
            logger.info("channel closed (%s); exiting", e)
            return
        if raw is None:
            if os.getppid() != parent:
                return
            continue
        plan = StepPlan.from_dict(raw)
        out = runner.step(plan)
        if spec.rank == 0:
            top_k = 0 if out.top_ids is None else int(out.top_ids.shape[1]) if out.top_ids.ndim == 2 else 0
            channel.send_results(
                plan.step_id,
                out.slots.astype("uint32").tobytes(),
                out.tokens.astype("uint32").tobytes(),
                out.logprobs.astype("float32").tobytes(),
                b"" if top_k == 0 else out.top_ids.astype("uint32").tobytes(),
                b"" if top_k == 0 else out.top_logprobs.astype("float32").tobytes(),
                top_k,
            )
