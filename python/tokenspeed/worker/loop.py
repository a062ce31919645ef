"""A worker process: one per GPU rank. Loads the model, reports its KV capacity, then loops:
receive plan → forward → sample → send results (rank 0)."""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from tokenspeed.diagnostics.step_trace import StepTrace

if TYPE_CHECKING:
    from tokenspeed._core import WorkerChannel
    from tokenspeed.distributed.groups import ParallelSizes
    from tokenspeed.worker.grammar_backend import XGrammarConfig, XGrammarSlots
    from tokenspeed.worker.model_runner import ModelRunner
    from tokenspeed.worker.pending_step import PendingStep
    from tokenspeed.worker.plan import StepPlan

logger = logging.getLogger("tokenspeed.worker.loop")


@dataclass
class WorkerSpec:
    """What a worker needs; picklable (workers are spawned, not forked). `settings` is the
    declared configuration's worker section (`ServeConfig.section("worker")`, by flag dest: the
    flags whose readers name the worker); the rest is what the launcher resolved for this rank."""

    rank: int
    world_size: int
    channel_name: str
    settings: dict[str, Any]
    model_path: str  # the model's directory (--model-path, or the default model fetched)
    device: str  # this rank's device ("cuda:1" with several ranks)
    num_pages: int | None  # --max-total-tokens in pages; None: profiled (the runner)
    context_length: int  # --context-length, else the model's
    extend_graph_sizes: list[int] | None = None  # token counts of the extend CUDA graphs
    recv_timeout_ms: int = 1000
    # Tensor parallelism (distributed/groups.py): this replica's sizes and where its ranks meet.
    parallel: ParallelSizes | None = None
    dist_init_method: str = ""
    # --grammar-backend xgrammar: this worker masks grammar-constrained rows (grammar_backend.py).
    xgrammar: XGrammarConfig | None = None


def die_with_parent() -> None:
    """The worker must not outlive the server (PR_SET_PDEATHSIG = 1)."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)
    except OSError:
        pass


def _quiet_garbage_collector() -> None:
    """After start-up: move every object made so far (the model, kernels' caches, CUDA graphs)
    out of the collector's reach, as vLLM does after capturing its graphs, so a full collection
    during serving scans only what serving makes; and log any collection that still stalls
    the step loop for more than 20 ms."""
    gc.collect()
    gc.freeze()
    started: list[float] = [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif (ms := 1e3 * (time.perf_counter() - started[0])) > 20.0:
            logger.warning("garbage collection of generation %d took %.0f ms (%d collected)",
                           info["generation"], ms, info["collected"])

    gc.callbacks.append(timed)


def run_worker(spec: WorkerSpec, ready: Connection) -> None:
    """Entry point of the worker process."""
    die_with_parent()
    # Ctrl-C reaches the whole process group: the server drains, then closes the channel,
    # which ends this worker; dying on the SIGINT would fail the requests being drained.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=spec.settings["log_level"].upper(),
        format=f"[worker {spec.rank}] %(asctime)s %(levelname)s %(message)s",
    )
    parent = os.getppid()
    try:
        from tokenspeed._core import WorkerChannel

        if spec.parallel is not None and spec.parallel.world_size > 1:
            # Join the process group first: the model's layers take their shards from it.
            import torch

            from tokenspeed.distributed.groups import init_distributed

            init_distributed(spec.rank, spec.parallel, spec.dist_init_method,
                             torch.device(spec.device), float(spec.settings["dist_timeout"]))
        runner = load_runner(spec)
        grammars = None
        if spec.xgrammar is not None and _leads(spec):  # rank 0 samples for the replica
            from tokenspeed.worker.grammar_backend import XGrammarSlots

            grammars = XGrammarSlots(spec.xgrammar, runner.max_slots)
        # Reader index on this node's ring (multi-node: rank is global, world_size per node;
        # data-parallel attention: world_size is the attention group's, which has its own ring).
        channel = WorkerChannel.attach(spec.channel_name, spec.rank % spec.world_size)
        _quiet_garbage_collector()
        ready.send({"ok": True, "num_pages": int(runner.num_pages), "device": str(runner.device),
                    "num_host_pages": int(runner.num_host_pages),
                    "num_storage_pages": int(runner.num_storage_pages),
                    # Hybrid layout (worker/swa_layout.py): the sliding pool and window; 0: none.
                    "num_swa_pages": int(runner.num_swa_pages),
                    "swa_window": int(runner.swa.window) if runner.swa is not None else 0,
                    "max_running_requests": int(runner.max_slots),
                    "cuda_graph_max_bs": int(runner.cuda_graph_max_bs),
                    "extend_graph_tokens": [int(t) for t in runner.extend_graph_sizes]})
        ready.close()
    except BaseException as e:  # noqa: BLE001  (report any start-up failure, then exit)
        ready.send({"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        ready.close()
        sys.exit(1)

    logger.info("ready: %d KV pages of %d tokens, %d running requests%s", runner.num_pages,
                runner.page_size, runner.max_slots,
                "" if spec.settings["max_running_requests"] else " (derived from the KV pool)")
    serve_plans(channel, runner, spec, parent, grammars)


def load_runner(spec: WorkerSpec) -> ModelRunner:
    """The model runner of this rank, built from the worker's flags and what the launcher
    resolved for it."""
    from tokenspeed.config.speculative import DRAFT_HEADS
    from tokenspeed.layers.host_kv_cache import HostTierSize
    from tokenspeed.layers.kv_storage import StorageSettings
    from tokenspeed.worker.draft_chain import DraftSpec
    from tokenspeed.worker.kv_transfer import PdSettings
    from tokenspeed.worker.lora import lora_settings
    from tokenspeed.worker.model_runner import ModelRunner

    s = spec.settings
    deterministic = bool(s["enable_deterministic_inference"])
    if deterministic:  # before the model is built: its layers read the mode (batch_invariant)
        from tokenspeed.layers import batch_invariant

        batch_invariant.enable()
        if spec.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # The tiled attention is many small ops: with OpenMP each waits on a hand-off to the
            # other threads (20x slower on a busy 2-core machine), and they are too small to
            # gain from it.
            import torch

            torch.set_num_threads(1)
    runner = ModelRunner(
        spec.model_path,
        dtype=s["dtype"],
        device=spec.device,
        load_format=s["load_format"],
        page_size=int(s["page_size"]),
        num_pages=spec.num_pages,
        max_slots=s["max_running_requests"],  # None: derived from the KV pool (the runner)
        max_context_len=spec.context_length,
        seed=int(s["random_seed"] or 0),
        mem_fraction_static=s["mem_fraction_static"],
        attention_backend=s["attention_backend"] or None,  # None: triton on CUDA, else torch_native
        disable_cuda_graph=bool(s["disable_cuda_graph"]),
        cuda_graph_max_bs=s["cuda_graph_max_bs"],
        # Deterministic mode: decode graphs only (prompt steps eager: the batch-invariant
        # attention has no extend-graph metadata).
        extend_graph_sizes=[] if deterministic else spec.extend_graph_sizes,
        chunked_prefill_size=int(s["chunked_prefill_size"]),  # largest step: sizes the profile
        moe_backend=s["moe_backend"] or None,  # None: triton on CUDA, else torch_native
        kv_cache_dtype=s["kv_cache_dtype"],
        quantization_param_path=s["quantization_param_path"],
        quantization=s["quantization"],
        lm_head_quantization=s["lm_head_quantization"],
        lora=lora_settings(s),
        pooling=bool(s["is_embedding"]),
        hicache=HostTierSize(float(s["hicache_ratio"]), int(s["hicache_size"]), StorageSettings.parse(
            s["hicache_storage_backend"], s["hicache_storage_backend_extra_config"])
            if s["hicache_storage_backend"] else None)
        if s["enable_hierarchical_cache"] else None,
        pd=PdSettings.of(s),
        config_overrides=s["json_model_override_args"],
        draft=DraftSpec(s["speculative_algorithm"], s["speculative_draft_model_path"],
                        int(s["speculative_num_steps"]))
        if s["speculative_algorithm"] in DRAFT_HEADS else None,
        swa_full_tokens_ratio=s["swa_full_tokens_ratio"],
        disable_hybrid_swa_memory=bool(s["disable_hybrid_swa_memory"]),
    )
    if runner.num_swa_pages and (runner.kv_transfer is not None or runner.host_kv is not None):
        raise ValueError("--swa-full-tokens-ratio (hybrid sliding-window KV pool) does not support "
                         "--disaggregation-mode or --enable-hierarchical-cache yet")
    if deterministic:
        from tokenspeed.config.deterministic import check_model, deterministic_note

        check_model(runner.config.num_experts, runner.fp8 is not None)
        logger.info(deterministic_note(runner.device.type, runner.attention_backend))
    return runner


def _leads(spec: WorkerSpec) -> bool:
    """Whether this rank samples for its engine and sends the results: rank 0, or under
    data-parallel attention the first rank of each attention group."""
    p = spec.parallel
    if p is not None and p.attn_dp > 1:
        return spec.rank % p.attn_tp == 0
    return spec.rank == 0


Pending = tuple[int, "PendingStep"]
IDLE_WAIT_MS = 10  # serve_plans_lockstep: the longest wait on the ring between idle ticks
_CLOSED = object()  # _run_plan: the channel closed while waiting for a mask completion


def serve_plans(channel: WorkerChannel, runner: ModelRunner, spec: WorkerSpec,
                parent: int, grammars: XGrammarSlots | None = None) -> None:
    """The step loop. A launched step's tokens are sent back once the GPU has them; meanwhile
    the loop polls for the next plan, so a plan the engine sends ahead (one-step-ahead
    scheduling) is queued on the GPU behind the running step and the GPU never waits for the
    host. Results go back in step order."""
    from tokenspeed.worker.plan import StepPlan

    if runner.lockstep:
        # Only MoE layers span attention groups (dense TP stays inside one): a dense model's
        # groups never meet in a collective and need no lockstep.
        return serve_plans_lockstep(channel, runner, spec, parent, grammars)
    trace = StepTrace.from_env()
    pending: Pending | None = None
    kv = runner.kv_transfer
    if kv is not None and kv.settings.mode == "decode" and _leads(spec):
        from tokenspeed.worker.kv_transfer import ArrivalReports

        channel = ArrivalReports(channel, kv, runner.max_slots)  # type: ignore[assignment]
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
        ran = _run_plan(channel, runner, spec, parent, StepPlan.from_dict(raw), pending, trace,
                        grammars)
        if ran is _CLOSED:
            return
        pending = ran  # type: ignore[assignment]


def serve_plans_lockstep(channel: WorkerChannel, runner: ModelRunner, spec: WorkerSpec,
                         parent: int, grammars: XGrammarSlots | None = None) -> None:
    """The step loop under data-parallel attention. Each attention group has its own engine
    and plan ring, but the MoE layers are collectives over the whole world, so every rank runs
    every forward pass together: each iteration is a tick (`distributed.lockstep_tick`, one
    small all-gather on the CPU) in which every rank says whether it holds a plan and how many
    tokens it has. If any group has tokens, every group runs a forward pass (an idle one on a
    padding token, `ModelRunner.idle_forward`) with all groups' counts known to the MoE layers;
    otherwise no rank runs one. When every group's plan is decode-only (or it has none), every
    rank replays the decode CUDA graph of one size instead (`Tick.graph_batch`: the largest
    group's requests, rounded up to a captured size), an idle group on padding rows only.
    The engines know nothing of it: a group's plans and results flow as in `serve_plans`,
    one-step-ahead plans included (a plan sent ahead is simply picked up by a later tick)."""
    from tokenspeed.distributed.groups import lockstep_forward, lockstep_tick
    from tokenspeed.worker.cuda_graph import decode_only
    from tokenspeed.worker.plan import StepPlan

    group = spec.rank // spec.parallel.attn_tp  # type: ignore[union-attr]
    trace = StepTrace.from_env()
    pending: Pending | None = None
    # While nothing runs anywhere, each tick waits a little longer on the ring first (1, 2, 4, 8,
    # then 10 ms): an idle server ticks 100 times a second (about 7% of a core per rank on CPU,
    # measured with 2 ranks), and a request arriving then waits at most 10 ms for the others.
    idle_ms = 0
    graph_sizes = runner.graphs.sizes if runner.graphs is not None else []
    forwards = replayed = 0  # lockstep forward steps, and those that replayed a decode graph
    while True:
        stop, plan = False, None
        try:
            raw = channel.recv(0 if pending is not None else idle_ms)
        except ConnectionError as e:  # the server closed the channel: every rank leaves
            logger.info("channel closed (%s); exiting", e)
            raw, stop = None, True
        if raw is None and os.getppid() != parent:
            stop = True
        if raw is not None:
            plan = StepPlan.from_dict(raw)
        tokens = int(plan.sched_tokens_len.sum()) if plan is not None else 0
        tick = lockstep_tick(plan is not None, tokens, stop,
                             plan is not None and decode_only(plan, runner.sampler))
        if tick.stop:
            return
        if plan is None and tick.runs_plan[group]:
            # Another rank of this group received it first: it is on this ring too.
            plan = _recv_plan(channel, spec, parent)
            if plan is None:
                return
        if pending is not None and pending[1].ready():
            _send(channel, spec, *pending, trace, grammars)
            pending = None
        if not tick.forward and plan is None:
            idle_ms = min(IDLE_WAIT_MS, idle_ms * 2 or 1) if pending is None else 0
            continue
        idle_ms = 0
        if tick.forward:  # counted for the log (a GPU check reads that graphs replay)
            graphed = tick.graph_batch(graph_sizes) is not None
            forwards, replayed = forwards + 1, replayed + graphed
            if (graphed and not replayed & (replayed - 1)) or forwards % 1000 == 0:
                logger.info("lockstep: %d of %d forward steps replayed a decode CUDA graph",
                            replayed, forwards)
        with lockstep_forward(tick, graph_sizes):
            if plan is not None:
                ran = _run_plan(channel, runner, spec, parent, plan, pending, trace, grammars)
                if ran is _CLOSED:
                    return
                pending = ran  # type: ignore[assignment]
            if tick.forward and tick.tokens[group] == 0:
                runner.idle_forward()  # no plan here, or one without tokens


def _recv_plan(channel: WorkerChannel, spec: WorkerSpec, parent: int) -> StepPlan | None:
    """The next plan, waiting for it (None when the channel closed or the server died)."""
    from tokenspeed.worker.plan import StepPlan

    while True:
        try:
            raw = channel.recv(spec.recv_timeout_ms)
        except ConnectionError as e:
            logger.info("channel closed (%s); exiting", e)
            return None
        if raw is not None:
            return StepPlan.from_dict(raw)
        if os.getppid() != parent:
            return None


def _run_plan(channel: WorkerChannel, runner: ModelRunner, spec: WorkerSpec, parent: int,
              plan: StepPlan, pending: Pending | None, trace: StepTrace | None,
              grammars: XGrammarSlots | None) -> Pending | object:
    """Launch one plan (its forward pass queued) and send the step in flight's result once it
    is ready; returns the new step in flight, or _CLOSED."""
    from tokenspeed.worker.ops import has_op, outcome_arrays, run_op
    from tokenspeed.worker.sampler import has_pending_masks

    if trace:
        trace.received(plan)
    if pending is not None and pending[1].ready():  # always so on the CPU: send it first
        _send(channel, spec, *pending, trace, grammars)
        pending = None
    if has_op(plan):  # an operation alone in its plan, sent while no request runs
        if pending is not None:
            _send(channel, spec, *pending, trace, grammars)
        ok, message = run_op(runner, plan, runner.lockstep)
        if _leads(spec):
            channel.send_result(plan.step_id, outcome_arrays(ok, message))
        return None
    if grammars is not None and grammars.apply_plan(plan):
        # Worker-side grammar masks: queue the forward pass, then take the step in flight's
        # tokens (its matchers advance as it is sent), then mask and sample. The GPU runs
        # this forward meanwhile; no round trip to the server is needed.
        plan = plan.copy()  # its arrays are views the next recv invalidates
        forward = runner.launch_forward(plan)
        if pending is not None:
            _send(channel, spec, *pending, trace, grammars)
        launched = (plan.step_id, runner.launch_sample(plan, forward, masks=grammars.masks(plan)))
        if trace:
            trace.launched(plan.step_id)
        return launched
    if has_pending_masks(plan):
        # Grammar masks that depend on the step in flight: run the forward pass, send that
        # step's result (the server computes the masks from it), then sample.
        plan = plan.copy()  # its arrays are views the next recv invalidates
        forward = runner.launch_forward(plan)
        if pending is not None:
            _send(channel, spec, *pending, trace, grammars)
        completion = _recv_mask_completion(channel, spec, plan.step_id, parent)
        if completion is None:
            return _CLOSED
        launched = (plan.step_id, runner.launch_sample(plan, forward, completion))
        if trace:
            trace.launched(plan.step_id)
        return launched
    launched = (plan.step_id, runner.launch(plan))
    if trace:
        trace.launched(plan.step_id)
    if pending is not None:
        _send(channel, spec, *pending, trace, grammars)
    return launched


def _recv_mask_completion(channel: WorkerChannel, spec: WorkerSpec, step_id: int,
                          parent: int) -> StepPlan | None:
    """The mask completion of plan `step_id`: the next message the server sends (None when the
    channel closed or the server died)."""
    completion = _recv_plan(channel, spec, parent)
    if completion is not None and (completion.step_id != step_id or len(completion.sched_slot)):
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
    if _leads(spec):
        channel.send_result(step_id, out.arrays())
    if trace:
        trace.sent(step_id)
