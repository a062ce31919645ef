"""`tokenspeed serve`: resolve the model, start the workers, learn the KV capacity, then hand
the process to the Rust core (`tokenspeed._core.serve`), which never calls back into Python."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenspeed.config import BY_DEST
from tokenspeed.config.derived import MAX_DEFAULT_RUNNING_REQUESTS
from tokenspeed.config.lora import AdapterError, LoraSettings, resolve_lora
from tokenspeed.config.speculative import speculative_note
from tokenspeed.distributed.groups import ParallelConfigError, free_tcp_port, resolve_sizes
from tokenspeed.launch import relay
from tokenspeed.launch.model_facts import (
    checkpoint_refusal,
    model_context_length,
    model_vocab_size,
    pooling_facts,
    sampling_defaults,
)
from tokenspeed.launch.ring_size import RING_SLOTS, RingSizeError, check_rings, logprobs_width, shm_room
from tokenspeed.launch.supervisor import DeathWatch, Watched, describe, without_sigint
from tokenspeed.worker.kv_transfer import check_disaggregation
from tokenspeed.worker.loop import WorkerSpec, run_worker

if TYPE_CHECKING:
    from tokenspeed.distributed.groups import ParallelSizes
    from tokenspeed.worker.grammar_backend import XGrammarConfig

logger = logging.getLogger("tokenspeed.launch.serve")


class LaunchError(RuntimeError):
    """The server could not start (bad model dir, worker failed to load, ...)."""


def resolve_model(model_path: str | None) -> Path:
    if model_path is None:
        from tokenspeed.launch.assets import ensure_default_model

        return ensure_default_model()
    path = Path(model_path).expanduser()
    if not (path / "config.json").exists():
        raise LaunchError(
            f"model {model_path!r}: no config.json there. TokenSpeed loads local model directories "
            "(there is no model hub access); pass a directory with config.json and weights."
        )
    return path


def check_moe_settings(cfg: Any, model_dir: Path, device: str, sizes: Any) -> None:
    """MoE flags against the model and the device, before any worker starts: an EP size that does
    not divide the expert count (or EP on a dense model), a MoE-TP size that does not divide the
    experts' intermediate size, a MoE backend that cannot run here."""
    from tokenspeed.models.config import check_expert_parallel, load_hf_config

    try:
        config = load_hf_config(str(model_dir), cfg.json_model_override_args)
        check_expert_parallel(config, sizes.ep, sizes.moe_tp if config.num_experts else 1)
        if cfg.moe_backend and config.num_experts:
            import torch

            from tokenspeed.layers.moe import resolve_moe_backend

            resolve_moe_backend(cfg.moe_backend, torch.device(device))
    except ValueError as e:
        raise LaunchError(str(e)) from None


def resolve_device(device: str | None) -> str:
    if device in (None, "auto"):
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


@dataclass
class Layout:
    """Where this node's ranks run, resolved and checked before any worker starts."""

    model_dir: Path
    tokenizer_dir: Path
    context: int  # the context length: --context-length, else the model's
    device: str  # "cuda" or "cpu" (each rank's own device is derived from it)
    sizes: ParallelSizes
    node_rank: int
    dp: int  # data-parallel replicas (one engine and process group each)
    groups: int  # attention groups of one world (data-parallel attention; 1: none)
    readers: int  # ranks on this node reading one plan ring
    init_methods: list[str]  # where each replica's process group meets

    @property
    def world(self) -> int:
        """Ranks on this node: all of them read the one plan ring."""
        return self.sizes.nprocs_per_node

    @property
    def engines(self) -> int:
        """Engines (and plan channels): one per replica, or per attention group of one."""
        return self.dp * self.groups


@dataclass
class WorkerGroup:
    """This node's started workers and their plan channels, ready: what `serve` and the
    in-process engine (`tokenspeed.LLM`) both start from. `stop()` shuts them down."""

    layout: Layout
    vocab_size: int
    channel_names: list[str]
    channels: list[Any]
    workers: list[Any]
    watched: list[Watched]
    watch: DeathWatch
    capacities: list[dict]
    # The configuration the workers run with (LoRA's rank and modules resolved), and the
    # start-up adapters.
    cfg: Any = None
    lora: LoraSettings | None = None
    pages: int = 0
    max_running: int = 0

    def stop(self) -> None:
        self.watch.stop()  # before the workers are stopped on purpose
        for c in self.channels:
            c.close()
        _stop_workers(self.workers)


def start_workers(cfg: Any, on_failure: Any = None) -> WorkerGroup:
    """Resolves the layout, opens the plan channels, spawns this node's workers and waits for
    their KV capacity; a failed start stops what was started."""
    note = speculative_note(cfg)
    if note:
        logger.info(note)
    if cfg.enable_hierarchical_cache and cfg.disable_radix_cache:
        raise LaunchError("--enable-hierarchical-cache keeps the radix cache's evicted prefixes "
                          "in host memory: it cannot be combined with --disable-radix-cache")
    if cfg.hicache_storage_backend and not cfg.enable_hierarchical_cache:
        raise LaunchError("--hicache-storage-backend keeps what the host tier drops: it needs "
                          "--enable-hierarchical-cache")
    cfg, lora = lora_settings(cfg)
    layout = resolve_layout(cfg)
    pd_refusal = check_disaggregation(cfg, layout.device, layout.dp, layout.groups)
    if pd_refusal:
        raise LaunchError(pd_refusal)
    vocab_size = model_vocab_size(layout.model_dir, cfg.json_model_override_args)
    xgrammar = worker_xgrammar(cfg, layout, vocab_size)
    channel_names, channels = open_channels(cfg, layout, vocab_size, xgrammar is not None)
    ctx = mp.get_context("spawn")
    try:
        workers, links, watched = spawn_workers(ctx, cfg, layout, channel_names, xgrammar)
    except BaseException:
        for c in channels:
            c.close()
        raise
    watch = DeathWatch(watched, layout.node_rank, layout.sizes.nnodes, on_failure=on_failure)
    group = WorkerGroup(layout, vocab_size, channel_names, channels, workers, watched, watch, [],
                        cfg, lora)
    try:
        logger.info("node %d: started %d worker rank(s): %s", layout.node_rank,
                    layout.world * layout.dp, _describe_ranks(layout, workers))
        group.capacities = _wait_ready(watched, links, where=watch.where)
        # Every rank's pool holds these pages and its worker this many slots (every replica's
        # too: the engines share one configuration).
        group.pages = min(c["num_pages"] for c in group.capacities)
        group.max_running = min(int(c["max_running_requests"]) for c in group.capacities)
    except BaseException:
        group.stop()
        raise
    return group


def launch(cfg: Any) -> int:
    """Runs the server until SIGINT/SIGTERM. `cfg` is the resolved ServeConfig."""
    group = start_workers(cfg)
    cfg = group.cfg
    layout, channels, workers, watched, watch = (group.layout, group.channels, group.workers,
                                                 group.watched, group.watch)
    try:
        pages, max_running = group.pages, group.max_running
        if layout.sizes.nnodes > 1:
            timeout = float(cfg.dist_timeout or 300)
            if layout.node_rank > 0:  # no HTTP here: relay node 0's plans until it shuts down
                return relay.run_sink(channels[0], layout.node_rank, layout.sizes.nnodes,
                                      cfg.dist_init_addr, timeout, (pages, max_running),
                                      watched, watch.where)
            ctx = mp.get_context("spawn")
            pages, max_running = start_relay(ctx, cfg, layout, group.channel_names[0], timeout,
                                             (pages, max_running), workers, watched, watch)
        config = server_config(cfg, layout, group.vocab_size, group.capacities, pages,
                               max_running, workers, group.lora)
        logger.info(
            "workers ready on %s: %d KV pages x %d tokens, %d running requests%s; starting HTTP "
            "on %s:%s", layout.device, pages, int(cfg.page_size), max_running,
            "" if cfg.max_running_requests else " (derived from the KV pool)", cfg.host, cfg.port,
        )
        return serve_core(cfg, config, channels, watch)
    finally:
        group.stop()


def lora_settings(cfg: Any) -> tuple[Any, LoraSettings | None]:
    """The LoRA settings, resolved with the start-up adapters (config/lora.py), and `cfg`
    with the rank and modules the workers' pools hold filled in."""
    try:
        lora = resolve_lora(cfg.enable_lora, cfg.lora_paths, cfg.max_lora_rank,
                            cfg.lora_target_modules)
    except AdapterError as e:
        raise LaunchError(str(e)) from None
    if lora is None:
        return cfg, None
    return replace(cfg, enable_lora=True, max_lora_rank=lora.max_rank,
                   lora_target_modules=lora.targets), lora


def check_priority_flags(cfg: Any) -> None:
    """A priority-ordering flag without priority scheduling would be accepted and ignored."""
    if cfg.schedule_low_priority_values_first and not cfg.enable_priority_scheduling:
        raise LaunchError("--schedule-low-priority-values-first orders requests by their priority: "
                          "it needs --enable-priority-scheduling")
    if (cfg.priority_scheduling_preemption_threshold
            != BY_DEST["priority_scheduling_preemption_threshold"].default
            and not cfg.enable_priority_scheduling):
        raise LaunchError("--priority-scheduling-preemption-threshold compares request "
                          "priorities: it needs --enable-priority-scheduling")


def resolve_layout(cfg: Any) -> Layout:
    """The model, the device and the parallel layout, every flag checked against them."""
    model_dir = resolve_model(cfg.model_path)
    tokenizer_dir = Path(cfg.tokenizer_path).expanduser() if cfg.tokenizer_path else model_dir
    context = cfg.context_length or model_context_length(model_dir, cfg.json_model_override_args)
    device = resolve_device(cfg.device)
    check_attention_backend(cfg.attention_backend, device)
    sizes = parallel_sizes(cfg, model_dir)
    check_moe_settings(cfg, model_dir, device, sizes)
    if refusal := checkpoint_refusal(cfg, model_dir):  # quantization, NEXTN's MTP layer
        raise LaunchError(refusal)
    check_priority_flags(cfg)
    world = sizes.nprocs_per_node
    node_rank = int(cfg.node_rank or 0)
    if sizes.nnodes > 1 and not cfg.dist_init_addr:
        raise LaunchError(f"--nnodes {sizes.nnodes} needs --dist-init-addr HOST:PORT (node 0's "
                          "address, the same on every node)")
    if node_rank >= sizes.nnodes:
        raise LaunchError(f"--node-rank {node_rank} with --nnodes {sizes.nnodes}: ranks are "
                          f"0..{sizes.nnodes - 1}")
    dp = data_parallel_size(cfg, sizes.nnodes)
    # Data-parallel attention: the world's attention groups, each with its own engine and plan
    # ring (distributed/groups.py); ranks on this node reading one ring.
    groups = sizes.attn_dp
    readers = sizes.attn_tp if groups > 1 else world
    if groups > 1 and dp > 1:
        raise LaunchError(f"--dp-size {dp} replicas of a world with data-parallel attention "
                          f"(--world-size {sizes.world_size}, --attn-tp-size {sizes.attn_tp}) are "
                          "not built yet; with --enable-dp-attention, --dp-size counts the "
                          "attention groups of one world instead")
    # One process group per replica, each meeting at its own address.
    init_methods = [f"tcp://{cfg.dist_init_addr or f'127.0.0.1:{free_tcp_port()}'}"]
    init_methods += [f"tcp://127.0.0.1:{free_tcp_port()}" for _ in range(1, dp)]
    if device == "cuda" and world * dp > 1:
        import torch

        if torch.cuda.device_count() < world * dp:
            need = f"--dp-size {dp} x --tp-size {world}" if dp > 1 else f"--tp-size {world}"
            raise LaunchError(f"{need} needs {world * dp} GPUs, this node has "
                              f"{torch.cuda.device_count()}")
    return Layout(model_dir, tokenizer_dir, context, device, sizes, node_rank, dp, groups,
                  readers, init_methods)


def check_attention_backend(backend: str | None, device: str) -> None:
    """A backend that cannot run here: one line, before any worker starts."""
    if not backend:
        return
    import torch

    from tokenspeed.layers.attention import check_backend

    try:
        check_backend(backend, torch.device(device))
    except ValueError as e:
        raise LaunchError(str(e)) from None


def worker_xgrammar(cfg: Any, layout: Layout, vocab_size: int) -> XGrammarConfig | None:
    """With `--grammar-backend xgrammar` the workers mask: grammars cross the plan, not masks."""
    from tokenspeed.worker.grammar_backend import xgrammar_config

    try:
        return xgrammar_config(cfg.grammar_backend, cfg.constrained_json_whitespace_pattern,
                               bool(cfg.constrained_json_disable_any_whitespace),
                               str(layout.tokenizer_dir), vocab_size)
    except (ImportError, ValueError) as e:
        raise LaunchError(str(e)) from None


def kv_tiers(cfg: Any) -> int:
    """Where KV pages may live: 1 the device, 2 a host tier too, 3 a storage tier below it."""
    if not cfg.enable_hierarchical_cache:
        return 1
    return 3 if cfg.hicache_storage_backend else 2


def open_channels(cfg: Any, layout: Layout, vocab_size: int,
                  worker_grammars: bool) -> tuple[list[str], list[Any]]:
    """One plan channel per engine (data-parallel replica, or attention group of one), read by
    that engine's ranks only; their names and the channels this node writes."""
    from tokenspeed import _core

    # Worker slots and plan slots hold this many requests; without --max-running-requests each
    # worker derives the engine's limit from its KV pool (config/derived.py), at most this.
    slots = int(cfg.max_running_requests or MAX_DEFAULT_RUNNING_REQUESTS)
    chunk = int(cfg.chunked_prefill_size)
    names = [f"/tokenspeed-{os.getpid()}" + (f"-dp{e}" if layout.engines > 1 else "")
             for e in range(layout.engines)]
    # A slot holds the largest plan and result of a step, a bound derived from the schema
    # (with structured output, one token mask row per slot: the model's vocabulary in bits).
    mask_words = -(-vocab_size // 32) \
        if cfg.grammar_backend == "llguidance" and not cfg.is_embedding else 0
    # --is-embedding: one pooled vector per slot comes back in a result.
    pooled_dim = pooling_facts(layout.model_dir, cfg.json_model_override_args)[1] if cfg.is_embedding else 0
    try:  # each token's top logprobs: --max-logprobs columns at most
        width = logprobs_width(int(cfg.max_logprobs), vocab_size)
        limits = (slots, chunk + slots, -(-layout.context // int(cfg.page_size)), mask_words,
                  worker_grammars, pooled_dim, kv_tiers(cfg))
        pd = cfg.disaggregation_mode != "null"  # page transfers ride in the plan
        drafts = int(cfg.speculative_num_steps or 0)  # a draft head's proposals ride in results
        slot_bytes = _core.slot_bytes(*limits, width, kv_transfer=pd, max_drafts=drafts)
        check_rings(cfg, slot_bytes, _core.slot_bytes(*limits, 0, kv_transfer=pd, max_drafts=drafts),
                    len(names), slots, width, shm_room())
    except RingSizeError as e:
        raise LaunchError(str(e)) from None
    if layout.node_rank == 0:  # multi-node: one more reader, the relay to the other nodes
        readers = layout.readers + (layout.sizes.nnodes > 1)
        return names, [_core.ServerChannel.create(name, readers, RING_SLOTS, slot_bytes) for name in names]
    # Written by this node's relay (relay.py).
    return names, [_core.PlanWriter.create(names[0], layout.world, RING_SLOTS, slot_bytes)]


def spawn_workers(ctx: Any, cfg: Any, layout: Layout, channel_names: list[str],
                  xgrammar: XGrammarConfig | None) -> tuple[list[Any], list[Any], list[Watched]]:
    """One worker process per rank of this node (of every replica); their processes, the ends
    of their ready pipes, and how the death watch names each."""
    world, dp, node_rank = layout.world, layout.dp, layout.node_rank
    if layout.device == "cpu" and dp > 1 and "OMP_NUM_THREADS" not in os.environ:
        # Replicas share the CPU: split its cores between all their ranks (spawned workers read
        # this when torch starts), as distributed/groups.py does between the ranks of one group.
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // (world * dp)))
    workers, links, watched = [], [], []
    for replica, rank in ((r, k) for r in range(dp) for k in range(node_rank * world, (node_rank + 1) * world)):
        local = rank - node_rank * world
        spec = worker_spec(cfg, layout, replica, rank, channel_names, xgrammar)
        parent_end, child_end = ctx.Pipe(duplex=False)
        in_replica = f" of data-parallel replica {replica}" if dp > 1 else ""
        if layout.groups > 1:
            in_replica += f" (attention group {local // layout.readers})"
        proc = ctx.Process(target=without_sigint, args=(run_worker, spec, child_end),
                           name=f"tokenspeed-worker-{rank}" + (f"-dp{replica}" if dp > 1 else ""),
                           daemon=True)
        proc.start()
        child_end.close()
        workers.append(proc)
        links.append(parent_end)
        watched.append(Watched(proc, f"worker rank {rank} of {layout.sizes.world_size}{in_replica}"))
    return workers, links, watched


def worker_spec(cfg: Any, layout: Layout, replica: int, rank: int, channel_names: list[str],
                xgrammar: XGrammarConfig | None) -> WorkerSpec:
    """Rank `rank` of replica `replica`: the worker section of the declared configuration, and
    what this launcher resolved for that rank."""
    world = layout.world
    local = rank - layout.node_rank * world
    gpu = replica * world + local  # replica r: GPUs r*tp .. r*tp+tp-1
    return WorkerSpec(
        rank=rank,
        world_size=layout.readers,
        channel_name=channel_names[replica * layout.groups + local // layout.readers],
        settings=cfg.section("worker"),
        model_path=str(layout.model_dir),
        device=f"cuda:{gpu}" if layout.device == "cuda" and world * layout.dp > 1 else layout.device,
        num_pages=max(1, int(cfg.max_total_tokens) // int(cfg.page_size)) if cfg.max_total_tokens else None,
        context_length=layout.context,
        extend_graph_sizes=extend_graph_sizes(cfg),
        parallel=layout.sizes,
        dist_init_method=layout.init_methods[replica],
        xgrammar=xgrammar,
    )


def _describe_ranks(layout: Layout, workers: list[Any]) -> str:
    world = layout.world
    return ", ".join((f"replica {i // world} " if layout.dp > 1 else "")
                     + f"rank {layout.node_rank * world + i % world} pid {p.pid}"
                     for i, p in enumerate(workers))


def start_relay(ctx: Any, cfg: Any, layout: Layout, channel_name: str, timeout: float,
                capacity: tuple[int, int], workers: list[Any], watched: list[Watched],
                watch: DeathWatch) -> tuple[int, int]:
    """Node 0 of several: start the relay of plans to the other nodes and wait for it; returns
    the KV pages and running requests every node agreed on."""
    parent_end, child_end = ctx.Pipe(duplex=False)
    source = ctx.Process(target=without_sigint, name="tokenspeed-relay", daemon=True,
                         args=(relay.run_source, channel_name, layout.world, layout.sizes.nnodes,
                               cfg.dist_init_addr, timeout, capacity, child_end))
    source.start()
    child_end.close()
    workers.append(source)  # watched like a rank: its death fails the server
    # Its link stays open after the ready report: a rank that dies on another node is
    # named there (relay.run_source).
    watched.append(Watched(source, "plan relay to the other nodes", link=parent_end))
    logger.info("plan relay to %d other node(s): pid %d", layout.sizes.nnodes - 1, source.pid)
    agreed = _wait_ready(watched[-1:], [parent_end], timeout_s=timeout + 60, where=watch.where)[0]
    return agreed["num_pages"], agreed["max_running_requests"]


def server_config(cfg: Any, layout: Layout, vocab_size: int, capacities: list[dict], pages: int,
                  max_running: int, workers: list[Any],
                  lora: LoraSettings | None = None) -> dict[str, Any]:
    """The Rust core's config: the flags it reads, cut from the declared table by reader
    (ServerConfig's fields and its `scheduler` section are named after the flags), then what
    this launcher resolved or measured in their place."""
    sizes, model_dir = layout.sizes, layout.model_dir
    return cfg.section("server") | {
        "model_path": str(cfg.model_path or model_dir),
        "tokenizer_path": str(layout.tokenizer_dir),
        "served_model_name": cfg.served_model_name or (cfg.model_path or model_dir.name),
        "sampling_defaults": sampling_defaults(model_dir, cfg.sampling_defaults),
        "dp_size": layout.engines,
        "scheduler": cfg.section("scheduler") | {
            "context_length": layout.context, "num_pages": pages,
            "max_running_requests": max_running,
            # The host tier's slots (0: --enable-hierarchical-cache off) and its storage tier's
            # pages (0: no --hicache-storage-backend): each rank has them.
            "num_host_pages": min(int(c.get("num_host_pages", 0)) for c in capacities),
            "num_storage_pages": min(int(c.get("num_storage_pages", 0)) for c in capacities),
            # The hybrid layout's sliding-window pool (0: one pool for every layer).
            "num_swa_pages": min(int(c.get("num_swa_pages", 0)) for c in capacities),
            "swa_window": max(int(c.get("swa_window", 0)) for c in capacities),
            # Token counts every rank replays an extend graph at: mixed steps fill their padding.
            "extend_graph_tokens": sorted(set.intersection(
                *(set(c.get("extend_graph_tokens", ())) for c in capacities)))},
        "vocab_size": vocab_size,
        "pooling_labels": pooling_facts(model_dir, cfg.json_model_override_args)[0] if cfg.is_embedding else [],
        "json_whitespace": ("compact" if cfg.constrained_json_disable_any_whitespace
                            else cfg.constrained_json_whitespace_pattern),
        "worker_pids": [p.pid for p in workers],
        "lora": lora.server(cfg.max_loras_per_batch) if lora else {
            "enabled": False, "adapters": [], "max_rank": 0, "target_modules": [],
            "max_per_batch": 0},
        "server_info": {
            "device": capacities[0]["device"],
            "tp_size": sizes.attn_tp,
            "load_balance_method": cfg.load_balance_method,
            "parallel": {"world_size": sizes.world_size, "attn_tp_size": sizes.attn_tp,
                         "dense_tp_size": sizes.dense_tp, "moe_tp_size": sizes.moe_tp,
                         "ep_size": sizes.ep, "attn_dp_size": layout.groups,
                         "all2all_backend": sizes.all2all_backend,
                         "nnodes": sizes.nnodes},
            "num_pages_per_rank": [int(c["num_pages"]) for c in capacities],
            "num_swa_pages_per_rank": [int(c.get("num_swa_pages", 0)) for c in capacities],
            # Decode batches up to this replay a CUDA graph (0: none; this node's ranks).
            "cuda_graph_max_bs": min(int(c["cuda_graph_max_bs"]) for c in capacities),
            "model_dir": str(model_dir),
            "worker_pids": [p.pid for p in workers],
        },
    }


def serve_core(cfg: Any, config: dict[str, Any], channels: list[Any], watch: DeathWatch) -> int:
    """Hand the process to the Rust core until it stops; non-zero when a child died."""
    from tokenspeed import _core

    watch.start()
    try:
        _core.serve(json.dumps(config), channels, cfg.log_level)
    except RuntimeError as e:  # a worker died or hung, or the engine failed: exit non-zero
        died = watch.report()  # which child died, if one did
        raise LaunchError(f"{died} ({e})" if died else str(e)) from None
    if watch.failure:  # the watch stopped the server because a child died
        return 1
    return 0


def _stop_workers(workers: list[Any]) -> None:
    """Workers exit by themselves once the channel is shut down; a hung one (the watchdog's
    case) is terminated, then killed, so no process outlives the server."""
    deadline = time.monotonic() + 5
    for proc in workers:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in workers:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=3)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=3)


def extend_graph_sizes(cfg: Any) -> list[int]:
    """Token counts of the extend-step CUDA graphs (--piecewise-cuda-graph-*); [] when off."""
    if cfg.disable_cuda_graph or cfg.disable_piecewise_cuda_graph:
        return []
    if cfg.piecewise_cuda_graph_tokens:
        return sorted({int(t) for t in cfg.piecewise_cuda_graph_tokens})
    from tokenspeed.worker.cuda_graph import extend_capture_sizes

    return extend_capture_sizes(int(cfg.piecewise_cuda_graph_max_tokens))


def data_parallel_size(cfg: Any, nnodes: int) -> int:
    """`--dp-size`, checked against what is built: replicas on one node. Under
    `--enable-dp-attention` it counts attention groups inside one world instead
    (`parallel_sizes`), so there is one replica."""
    if getattr(cfg, "enable_dp_attention", False):
        return 1
    dp = int(cfg.dp_size or 1)
    if dp > 1 and nnodes > 1:
        raise LaunchError(f"--dp-size {dp} with --nnodes {nnodes}: data parallelism across nodes "
                          "is not built yet (run one server per node, or --nnodes 1)")
    return dp


def parallel_sizes(cfg: Any, model_dir: Path) -> Any:
    """The checked parallel sizes, and that the model's heads split over them; one line naming
    both values otherwise, before any worker starts."""
    try:
        dp_attention = 1
        if cfg.enable_dp_attention:
            dp_attention = int(cfg.dp_size or 1)
            if dp_attention < 2:
                raise ParallelConfigError(
                    f"--enable-dp-attention with --dp-size {dp_attention}: it splits the world "
                    "into --dp-size attention groups; give --dp-size 2 or more")
        sizes = resolve_sizes(int(cfg.tp_size or 1), cfg.dense_tp_size, cfg.moe_tp_size,
                              cfg.world_size, cfg.nprocs_per_node, int(cfg.nnodes or 1),
                              int(cfg.ep_size or 1), bool(cfg.enable_expert_parallel),
                              dp_attention, cfg.all2all_backend)
        if sizes.world_size > 1:
            from tokenspeed.models.weights import open_checkpoint

            c = open_checkpoint(str(model_dir), cfg.load_format or "auto", cfg.json_model_override_args).config
            sizes.check_model(c.num_attention_heads, c.num_key_value_heads, c.intermediate_size)
    except ParallelConfigError as e:
        raise LaunchError(str(e)) from None
    return sizes


def _wait_ready(watched: list[Watched], links: list[Any], timeout_s: float = 900.0,
                where: str = "") -> list[dict]:
    """Every child's start-up report, watching all of them at once: one that dies fails the
    start naming it (its global rank; node and host on several nodes) at once (the others
    would otherwise wait in the process group)."""
    deadline = time.monotonic() + timeout_s
    ready: dict[int, dict] = {}
    while len(ready) < len(watched):
        if time.monotonic() > deadline:
            missing = ", ".join(w.what for i, w in enumerate(watched) if i not in ready)
            raise LaunchError(f"{missing}{where} did not become ready within {timeout_s:.0f}s")
        for i, (w, link) in enumerate(zip(watched, links)):
            if i in ready:
                continue
            if link.poll(0.1 if len(watched) == 1 else 0.02):
                try:
                    msg = link.recv()
                except EOFError:
                    msg = {"ok": False, "error": "exited during start-up"}
                if not msg.get("ok"):
                    sys.stderr.write(msg.get("traceback", ""))
                    raise LaunchError(f"{w.what} (pid {w.proc.pid}{where}) failed to start: "
                                      f"{msg.get('error')}")
                ready[i] = msg
            elif not w.proc.is_alive():
                raise LaunchError(f"{describe(w, where)} during start-up")
        time.sleep(0.05)
    return [ready[i] for i in range(len(watched))]


# The generation_config.json fields vLLM takes as request defaults (its `--generation-config auto`).
