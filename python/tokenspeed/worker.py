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
from typing import TYPE_CHECKING

from tokenspeed.step_trace import StepTrace

if TYPE_CHECKING:
    from tokenspeed._core import WorkerChannel
    from tokenspeed.distributed import ParallelSizes
    from tokenspeed.grammar_backend import XGrammarConfig, XGrammarSlots
    from tokenspeed.model_runner import ModelRunner, PendingStep
    from tokenspeed.plan import StepPlan

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
    moe_backend: str | None = None  # None/"auto": triton on CUDA, torch_native on CPU
    log_level: str = "info"
    recv_timeout_ms: int = 1000
    kv_cache_dtype: str = "auto"  # fp8 / fp8_e4m3 / fp8_e5m2: fp8 KV cache
    quantization_param_path: str | None = None  # its per-layer scales (JSON)
    quantization: str | None = None  # fp8 weights; None: as the checkpoint declares
    lm_head_quantization: str = "auto"  # the LM head under FP8 weights (auto / fp8 / none)
    # Tensor parallelism (distributed.py): this replica's sizes and where its ranks meet.
    parallel: ParallelSizes | None = None
    dist_init_method: str = ""
    dist_timeout_s: float = 300.0
    # --grammar-backend xgrammar: this worker masks grammar-constrained rows (grammar_backend.py).
    xgrammar: XGrammarConfig | None = None


def _die_with_parent() -> None:
    """The worker must not outlive the server (PR_SET_PDEATHSIG = 1)."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)
    except OSError:
        pass


def run_worker(spec: WorkerSpec, ready: Connection) -> None:
    """Entry point of the worker process."""
    _die_with_parent()
    # Ctrl-C reaches the whole process group: the server drains, then closes the channel,
    # which ends this worker; dying on the SIGINT would fail the requests being drained.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=spec.log_level.upper(), format=f"[worker {spec.rank}] %(asctime)s %(levelname)s %(message)s"
    )
    parent = os.getppid()
    try:
        from tokenspeed._core import WorkerChannel
        from tokenspeed.model_runner import ModelRunner

        if spec.parallel is not None and spec.parallel.world_size > 1:
            # Join the process group first: the model's layers take their shards from it.
            import torch

            from tokenspeed.distributed import init_distributed

            init_distributed(spec.rank, spec.parallel, spec.dist_init_method,
                             torch.device(spec.device), spec.dist_timeout_s)
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
            moe_backend=spec.moe_backend,
            kv_cache_dtype=spec.kv_cache_dtype,
            quantization_param_path=spec.quantization_param_path,
            quantization=spec.quantization,
            lm_head_quantization=spec.lm_head_quantization,
        )
        grammars = None
        if spec.xgrammar is not None and spec.rank == 0:  # rank 0 samples for the replica
            from tokenspeed.grammar_backend import XGrammarSlots

            grammars = XGrammarSlots(spec.xgrammar, spec.max_slots)
        # Reader index on this node's ring (multi-node: rank is global, world_size per node).
        channel = WorkerChannel.attach(spec.channel_name, spec.rank % spec.world_size)
        ready.send({"ok": True, "num_pages": int(runner.num_pages), "device": str(runner.device)})
        ready.close()
    except BaseException as e:  # noqa: BLE001  (report any start-up failure, then exit)
        ready.send({"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        ready.close()
        sys.exit(1)

    logger.info("ready: %d KV pages of %d tokens", runner.num_pages, spec.page_size)
    serve_plans(channel, runner, spec, parent, grammars)


def serve_plans(channel: WorkerChannel, runner: ModelRunner, spec: WorkerSpec,
                parent: int, grammars: XGrammarSlots | None = None) -> None:
    """The step loop. A launched step's tokens are sent back once the GPU has them; meanwhile
    the loop polls for the next plan, so a plan the engine sends ahead (one-step-ahead
    scheduling) is queued on the GPU behind the running step and the GPU never waits for the
    host. Results go back in step order."""
    from tokenspeed.model_runner import has_pending_masks
    from tokenspeed.plan import StepPlan

    trace = StepTrace.from_env()
    pending: tuple[int, PendingStep] | None = None
    while True:
        try:
            # With a step in flight, poll (0 ms) so its result is sent as soon as it is ready.
            raw = channel.recv(0 if pending is not None else spec.recv_timeout_ms)
        except ConnectionError as e:  # ChannelShutdown: the server closed the channel
            logger.info("channel closed (%s); exiting", e)
            return
        if raw is None:
            if pending is not None:
                if pending[1].ready():
                    _send(channel, spec, *pending, trace, grammars)
                    pending = None
                continue
            if os.getppid() != parent:
                return
            continue
        plan = StepPlan.from_dict(raw)
        if trace:
            trace.received(plan)
        if pending is not None and pending[1].ready():  # always so on the CPU: send it first
            _send(channel, spec, *pending, trace, grammars)
            pending = None
        if grammars is not None and grammars.apply_plan(plan):
            # Worker-side grammar masks: queue the forward pass, then take the step in flight's
            # tokens (its matchers advance as it is sent), then mask and sample. The GPU runs
            # this forward meanwhile; no round trip to the server is needed.
            plan = plan.copy()  # its arrays are views the next recv invalidates
            forward = runner.launch_forward(plan)
            if pending is not None:
                _send(channel, spec, *pending, trace, grammars)
                pending = None
            pending = (plan.step_id, runner.launch_sample(plan, forward, masks=grammars.masks(plan)))
            if trace:
                trace.launched(plan.step_id)
            continue
        if has_pending_masks(plan):
            # Grammar masks that depend on the step in flight: run the forward pass, send that
            # step's result (the server computes the masks from it), then sample.
            plan = plan.copy()  # its arrays are views the next recv invalidates
            forward = runner.launch_forward(plan)
            if pending is not None:
                _send(channel, spec, *pending, trace, grammars)
                pending = None
            completion = _recv_mask_completion(channel, spec, plan.step_id, parent)
            if completion is None:
                return
            pending = (plan.step_id, runner.launch_sample(plan, forward, completion))
            if trace:
                trace.launched(plan.step_id)
            continue
        launched = (plan.step_id, runner.launch(plan))
        if trace:
            trace.launched(plan.step_id)
        if pending is not None:
            _send(channel, spec, *pending, trace, grammars)
        pending = launched


def _recv_mask_completion(channel: WorkerChannel, spec: WorkerSpec, step_id: int,
                          parent: int) -> StepPlan | None:
    """The mask completion of plan `step_id`: the next message the server sends (None when the
    channel closed or the server died)."""
    from tokenspeed.plan import StepPlan

    while True:
        try:
            raw = channel.recv(spec.recv_timeout_ms)
        except ConnectionError as e:
            logger.info("channel closed (%s); exiting", e)
            return None
        if raw is None:
            if os.getppid() != parent:
                return None
            continue
        completion = StepPlan.from_dict(raw)
        if completion.step_id != step_id or len(completion.sched_slot):
            raise RuntimeError(f"expected the mask completion of step {step_id}, got a plan for step "
                               f"{completion.step_id} with {len(completion.sched_slot)} requests")
        return completion


def _send(channel: WorkerChannel, spec: WorkerSpec, step_id: int, step: PendingStep,
          trace: StepTrace | None = None, grammars: XGrammarSlots | None = None) -> None:
    out = step.wait()
    if grammars is not None:  # every step's tokens pass here once, in step order
        grammars.advance(step_id, out)
    if trace:
        trace.done(step_id)
    if spec.rank == 0:
        channel.send_result(step_id, out.arrays())
    if trace:
        trace.sent(step_id)
