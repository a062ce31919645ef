"""ModelRunner: applies a StepPlan to the worker's state, runs the forward pass and samples."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from tokenspeed.config.derived import (
    MAX_DEFAULT_RUNNING_REQUESTS,
    default_cuda_graph_max_bs,
    default_max_running_requests,
)
from tokenspeed.distributed.groups import (
    dp_graph_batch,
    state,
    sync_sampled_tokens,
    world_min,
)
from tokenspeed.layers.attention import (
    GRAPH_BACKENDS,
    AttentionBackend,
    ForwardBatch,
    check_backend,
    check_layers,
    padding_batch,
    resolve_backend_name,
)
from tokenspeed.layers.attention_backends import create_backend
from tokenspeed.layers.host_copy import DeviceToHost, to_device_int64
from tokenspeed.layers.host_kv_cache import HostKVPool, HostTierSize, host_pages
from tokenspeed.layers.kv_cache import PagedKVCache
from tokenspeed.layers.kv_storage import KVStorage, open_storage
from tokenspeed.layers.moe import (
    GRAPH_SAFE_MOE_BACKENDS,
    MoeOptions,
    MoeParallel,
    expert_slice,
    resolve_moe_backend,
)
from tokenspeed.layers.moe_exchange import moe_parallel as distributed_moe_parallel
from tokenspeed.layers.quantization.kv_cache import KVScales, resolve_kv_cache_dtype, resolve_kv_scales
from tokenspeed.layers.quantization.methods import resolve_quantization
from tokenspeed.models.config import ModelConfig, check_expert_parallel, local_heads
from tokenspeed.models.weights import Checkpoint, load_model, open_checkpoint
from tokenspeed.worker import swa_layout
from tokenspeed.worker.cuda_graph import DecodeGraphRunner, ExtendGraphRunner, decode_only
from tokenspeed.worker.draft_chain import ChainDrafter, DraftSpec, load_drafter
from tokenspeed.worker.draft_graph import capture_spec_graphs
from tokenspeed.worker.gpu_idle import IdleClock
from tokenspeed.worker.kv_sizing import DEFAULT_CHUNKED_PREFILL, page_bytes, profile_num_pages
from tokenspeed.worker.kv_transfer import KVTransfer, PdSettings
from tokenspeed.worker.lora import LoraPool
from tokenspeed.worker.pending_step import PendingStep
from tokenspeed.worker.plan import LAST_SAMPLED, StepOutput, StepPlan, new_request_rows
from tokenspeed.worker.pooling_step import pool_step
from tokenspeed.worker.prompt_logprobs import PromptScorer
from tokenspeed.worker.sampler import Sampler, TokenMasks, token_masks
from tokenspeed.worker.spec_verify import Drafts
from tokenspeed.worker.verify_graph import VerifyGraphRunner

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device, config: ModelConfig) -> torch.dtype:
    """"auto": float32 on CPU, the checkpoint's dtype elsewhere."""
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        dtype = config.torch_dtype.replace("torch.", "")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} not in {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[dtype]


class ModelRunner:
    """Owns the model, the paged KV cache, the attention backend and the sampler of one worker.

    `step(plan)`: drop finished slots → register new requests → page-table updates → page
    copies → forward of the scheduled requests → sample the last token of every request with
    sample == 1.
    On CUDA, pure-decode steps of up to `cuda_graph_max_bs` requests replay a captured graph,
    and steps with prompt tokens replay one when their token count is <= the largest of
    `extend_graph_sizes` (triton attention only; empty: none). Under data-parallel attention
    with MoE layers (`lockstep`) the worker's tick picks the decode graph size for every rank
    (`dp_graph_batch`) and steps with prompt tokens run eagerly.
    """

    def __init__(self, model_path: str, *, dtype: str = "auto", device: str = "cpu",
                 load_format: str = "auto", page_size: int, num_pages: int | None = None,
                 max_slots: int | None, max_context_len: int, seed: int = 0,
                 mem_fraction_static: float | None = None,
                 attention_backend: str | None = None, disable_cuda_graph: bool = False,
                 cuda_graph_max_bs: int | None = None, extend_graph_sizes: list[int] | None = None,
                 chunked_prefill_size: int | None = None, moe_backend: str | None = None,
                 moe_parallel: MoeParallel | None = None, kv_cache_dtype: str = "auto",
                 quantization_param_path: str | None = None,
                 quantization: str | None = None, lm_head_quantization: str = "auto",
                 lora: dict[str, Any] | None = None, pooling: bool = False,
                 hicache: HostTierSize | None = None, pd: PdSettings | None = None,
                 config_overrides: dict[str, Any] | None = None, draft: DraftSpec | None = None,
                 swa_full_tokens_ratio: float | None = None, disable_hybrid_swa_memory: bool = False) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.page_size = page_size
        # None (no --max-running-requests): derived from the KV pool below, at most this bound,
        # which the memory profile reserves for.
        self.max_slots = max_slots or MAX_DEFAULT_RUNNING_REQUESTS
        self.max_context_len = max_context_len
        # --json-model-override-args: merged over config.json here and on every reload.
        self.config_overrides = config_overrides
        ckpt = open_checkpoint(model_path, load_format, config_overrides)
        self.config = ckpt.config
        # Where the serving weights came from: /update_weights_from_disk (worker/ops.py) changes
        # it, and reloads it if a new checkpoint fails half-way.
        self.weights_source = (model_path, load_format)
        # This rank's heads (tensor parallelism: the KV cache holds only these).
        self.num_heads, self.num_kv_heads = local_heads(self.config, state().attn_tp.size)
        self.dtype = resolve_dtype(dtype, self.device, ckpt.config)
        self.attention_backend = resolve_backend_name(attention_backend, self.device)
        check_backend(self.attention_backend, self.device)
        self.moe_backend = resolve_moe_backend(moe_backend, self.device)
        # This rank's expert slice; the parallel runtime also sets each SparseMoeBlock.comm.
        moe_parallel = moe_parallel or distributed_moe_parallel()  # from the TP/EP groups
        check_expert_parallel(self.config, moe_parallel.ep_size, moe_parallel.tp_size)
        self.kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype, bool(self.config.mla_v_dim))
        # --is-embedding: every request pools (prefill-only steps, eager: worker/pooling_step.py).
        self.pooling = pooling
        disable_cuda_graph = disable_cuda_graph or pooling
        self._load_weights(ckpt, model_path, seed, moe_parallel, quantization,
                           lm_head_quantization, quantization_param_path)
        self.drafter: ChainDrafter | None = load_drafter(self, draft, model_path, load_format, seed)
        # LoRA (worker/lora.py): its pool in every adapted layer, before memory is profiled
        # and graphs are captured (they capture the LoRA kernels too).
        self.lora = None if lora is None else LoraPool(
            self.model, **lora, max_slots=self.max_slots,
            max_tokens=max(chunked_prefill_size or DEFAULT_CHUNKED_PREFILL, 2048) + self.max_slots,
            dtype=self.dtype, device=self.device)
        use_graphs = self._plan_graphs(disable_cuda_graph, cuda_graph_max_bs, extend_graph_sizes)
        self.swa_layers = swa_layout.sliding_layers(self, swa_full_tokens_ratio, disable_hybrid_swa_memory)
        self._size_kv_pool(num_pages, max_slots, mem_fraction_static, chunked_prefill_size,
                           use_graphs)
        swa_layout.split_pages(self, swa_full_tokens_ratio, profiled=num_pages is None)
        self._allocate_step_state(seed)
        # --enable-hierarchical-cache: the radix cache's host tier (layers/host_kv_cache.py).
        self.host_kv = None if hicache is None else HostKVPool(self.kv_cache, host_pages(
            ratio=hicache.ratio, size_gb=hicache.size_gb, device_pages=self.num_pages,
            bytes_per_page=page_bytes(self)), self._open_storage(hicache))
        self.num_host_pages = 0 if self.host_kv is None else self.host_kv.num_pages
        self.num_storage_pages = 0 if hicache is None or hicache.storage is None \
            else hicache.storage.pages(page_bytes(self))
        # --disaggregation-mode: this rank's end of the KV transfer pair (worker/kv_transfer.py).
        self.kv_transfer = None if pd is None else KVTransfer(pd, self.kv_cache, state().attn_tp.rank,
                                                             state().attn_tp.size)
        self._kv_failed: set[int] = set()  # slots whose KV never arrived: their requests fail
        self._capture_graphs()
        self._log_loaded(moe_parallel)

    def _load_weights(self, ckpt: Checkpoint, model_path: str, seed: int, moe_parallel: MoeParallel,
                      quantization: str | None, lm_head_quantization: str,
                      quantization_param_path: str | None) -> None:
        """The model's weights (FP8 ones quantised), and the KV cache's scales."""
        c = self.config
        # FP8 weights (--quantization or the checkpoint's quantization_config); fails here, before
        # any weight is read, for methods TokenSpeed does not run.
        self.fp8 = resolve_quantization(quantization, c.raw,
                                        model_path if ckpt.load_format != "gguf" else None,
                                        lm_head_quantization)
        ckpt_scales = KVScales()
        self.model = load_model(ckpt, dtype=self.dtype, device=self.device,
                                max_positions=self.max_context_len, seed=seed,
                                moe=MoeOptions(backend=self.moe_backend, parallel=moe_parallel),
                                kv_scales=ckpt_scales, fp8=self.fp8, pooling=self.pooling)
        self.kv_scales = resolve_kv_scales(self.kv_dtype, c.num_hidden_layers, ckpt_scales,
                                           quantization_param_path)
        windows = [w for w in c.sliding_windows if w is not None]
        self._window = min(windows) if windows else None

    def _plan_graphs(self, disable_cuda_graph: bool, cuda_graph_max_bs: int | None,
                     extend_graph_sizes: list[int] | None) -> bool:
        """Which CUDA graphs this rank may capture (`cuda_graph_max_bs`, `extend_graph_sizes`;
        before the KV pool is sized); whether it captures any."""
        c = self.config
        # torch_native MoE reads expert counts on the host: it cannot be captured in a graph.
        moe_graph_safe = not c.num_experts or self.moe_backend in GRAPH_SAFE_MOE_BACKENDS
        # MoE layers under torch_all2all run eager (ParallelSizes.graph_capturable); under
        # data-parallel attention with MoE layers every rank runs every step together.
        sizes, moe = state().sizes, bool(c.num_experts)
        self.lockstep = sizes.lockstep(moe)
        use_graphs = (self.device.type == "cuda" and not disable_cuda_graph
                      and self.attention_backend in GRAPH_BACKENDS and moe_graph_safe
                      and sizes.graph_capturable(moe))
        # Extend graphs read the triton backend's tiled extend kernel (no host values; not MLA).
        extend = (use_graphs and self.attention_backend == "triton" and not c.mla_v_dim
                  and sizes.extend_graph_capturable(moe))
        if self.drafter is not None:  # verify graphs (extend graphs) in place of both kinds
            use_graphs, extend = extend and not self.lockstep, False
        graph_bs = (min(cuda_graph_max_bs, self.max_slots) if cuda_graph_max_bs
                    else default_cuda_graph_max_bs(self.max_slots))
        self.cuda_graph_max_bs = graph_bs if use_graphs else 0
        self.extend_graph_sizes = sorted(set(extend_graph_sizes or ())) if extend else []
        return use_graphs

    def _size_kv_pool(self, num_pages: int | None, max_slots: int | None,
                      mem_fraction_static: float | None, chunked_prefill_size: int | None,
                      use_graphs: bool) -> None:
        """The KV pages (given, or what fits beside the model), and the running requests and
        decode graphs they hold."""
        if num_pages is None:
            num_pages = profile_num_pages(self, mem_fraction_static, chunked_prefill_size)
        self.num_pages = num_pages
        if max_slots is None:  # the engine takes the smallest of all ranks' (launch/serve.py)
            self.max_slots = default_max_running_requests(num_pages * self.page_size,
                                                          self.max_context_len)
            self.cuda_graph_max_bs = min(self.cuda_graph_max_bs, self.max_slots)
        if use_graphs:  # every rank captures the same sizes: their collectives must match
            self.cuda_graph_max_bs = world_min(self.cuda_graph_max_bs)

    def _allocate_step_state(self, seed: int) -> None:
        """The KV cache, the attention backend, the sampler and what steps keep on the device."""
        c = self.config
        self.kv_cache = PagedKVCache(
            num_layers=c.num_hidden_layers, num_pages=self.num_pages, page_size=self.page_size,
            num_kv_heads=self.num_kv_heads, head_dim=c.head_dim, dtype=self.kv_dtype,
            device=self.device, max_slots=self.max_slots, max_context_len=self.max_context_len,
            k_scale=self.kv_scales[0], v_scale=self.kv_scales[1], v_from_k=c.mla_v_dim,
            layers=swa_layout.full_layers(self))
        self.backend = self._make_backend(self.kv_cache)
        self.swa = swa_layout.SwaLayout.build(self)
        self.sampler = Sampler(self.device, seed, capacity=self.max_slots)
        self.sampler.warm_up(c.vocab_size, self.dtype)
        # Each slot's last sampled token, where LAST_SAMPLED inputs read it (on the device, so
        # the next step can be queued before this one's tokens reach the host).
        self.last_tokens = torch.zeros(self.max_slots, dtype=torch.int64, device=self.device)
        self.prompt_scorer = PromptScorer(self.device)
        if self.drafter is not None:  # its KV beside the target's pages
            self.drafter.attach(self.kv_cache, self.attention_backend, self.lockstep)
        self.graphs: DecodeGraphRunner | None = None
        self.extend_graphs: ExtendGraphRunner | None = None
        self.verify_graphs: VerifyGraphRunner | None = None  # with a draft head, in place of both
        self._idle: tuple[PagedKVCache, AttentionBackend] | None = None  # idle_forward's cache
        # Marks around each step's GPU work: the GPU's idle time between steps (gpu_idle.py).
        self.idle_clock = IdleClock.for_device(self.device)

    def _capture_graphs(self) -> None:
        """Capture the planned CUDA graphs (one memory pool for all, largest first), then
        compile the eager steps."""
        c = self.config
        pool = None  # one memory pool for all graphs (largest, the extend ones, first)
        if self.lora is not None:  # graphs always run the per-token LoRA kernels
            self.lora.capture_mode()
        if self.extend_graph_sizes:
            self.extend_graphs = ExtendGraphRunner(
                self.model, self.kv_cache, self.backend, self.extend_graph_sizes,
                self.max_slots, c.hidden_size, self.device,
                self.last_tokens, self.dtype, c.head_dim)
            pool = self.extend_graphs.capture()
        if self.cuda_graph_max_bs and self.drafter is not None:  # and the head's
            self.verify_graphs = capture_spec_graphs(self, pool)
        elif self.cuda_graph_max_bs:
            self.graphs = DecodeGraphRunner(self.model, self.kv_cache, self.backend,
                                            self.cuda_graph_max_bs, c.vocab_size, self.device,
                                            self.last_tokens, self.lora)
            self.graphs.capture(pool)
            if self.lockstep:  # a GPU check greps for it
                logger.info("decode CUDA graphs under data-parallel attention: %d groups, one "
                            "padded size per step on every rank", state().sizes.attn_dp)
        if self.device.type == "cuda" and not self.lockstep:
            self._compile_eager_steps()

    def _open_storage(self, hicache: HostTierSize) -> KVStorage | None:
        """--hicache-storage-backend: the storage tier's backend for this rank's KV."""
        if hicache.storage is None:
            return None
        c = self.config
        identity = {"model": str(self.weights_source[0]), "kv_dtype": str(self.kv_dtype),
                    "page_size": self.page_size, "layers": c.num_hidden_layers,
                    "kv_heads": self.num_kv_heads, "head_dim": c.head_dim,
                    "attn_tp": [state().attn_tp.rank, state().attn_tp.size]}
        return open_storage(hicache.storage, identity, page_bytes(self))

    def _log_loaded(self, moe_parallel: MoeParallel) -> None:
        c = self.config
        logger.info("model %s loaded: dtype=%s%s device=%s attention=%s%s kv pages=%d x %d tokens "
                    "(%s), cuda graphs up to batch %d%s", c.architecture, self.dtype,
                    "" if self.fp8 is None else f", fp8 weights ({self.fp8.checkpoint_format or 'quantised'}"
                    f"{', fp8 lm_head' if self.fp8.lm_head else ''})",
                    self.device, self.attention_backend,
                    f" moe={self.moe_backend} ({c.num_experts} experts, top {c.num_experts_per_tok}"
                    f"{expert_slice(c.num_experts, moe_parallel)})"
                    if c.num_experts else "", self.num_pages, self.page_size, self.kv_dtype,
                    self.cuda_graph_max_bs,
                    f" and steps up to {self.extend_graph_sizes[-1]} tokens"
                    if self.extend_graph_sizes else "")

    def _make_backend(self, kv_cache: PagedKVCache) -> AttentionBackend:
        backend = create_backend(self.attention_backend, kv_cache,
                                 num_heads=self.num_heads, head_dim=self.config.head_dim,
                                 max_context_len=self.max_context_len,
                                 sliding_window=self._window, q_dtype=self.dtype)
        check_layers(backend, self.model)
        return backend

    @torch.inference_mode()
    def idle_forward(self) -> None:
        """Data-parallel attention: a forward pass of one padding token for a step in which this
        rank's attention group has no work but another has, so that this rank joins the MoE
        layers' collectives (a draft head's passes too). Its K/V land in a one-page scratch
        cache, nothing is sampled or returned. In a padded decode step (`dp_graph_batch`) it
        replays that step's decode graph on padding rows instead, as every other rank does."""
        graph_bs = dp_graph_batch()
        if graph_bs is not None and self.graphs is not None:
            self.idle_clock.begin()
            self.graphs.run_padding(graph_bs)
            self.idle_clock.end()
        else:
            self._idle_eager()
        if self.drafter is not None and self.lockstep:
            self.drafter.lockstep_passes(0, 0)

    def _idle_eager(self) -> None:
        if self._idle is None:
            c = self.config
            scratch = PagedKVCache(
                num_layers=c.num_hidden_layers, num_pages=1, page_size=self.page_size,
                num_kv_heads=self.num_kv_heads, head_dim=c.head_dim, dtype=self.kv_dtype,
                device=self.device, max_slots=1, max_context_len=self.page_size,
                k_scale=self.kv_scales[0], v_scale=self.kv_scales[1], v_from_k=c.mla_v_dim)
            self._idle = (scratch, self._make_backend(scratch))
        scratch, backend = self._idle
        self.idle_clock.begin()  # GPU work of its own: no idle gap for the step after it
        batch = padding_batch(scratch, backend, self.device)
        self.model(batch.input_ids, batch.positions, batch)
        self.idle_clock.end()

    # --- the step --------------------------------------------------------------------------

    def step(self, plan: StepPlan) -> StepOutput:
        return self.launch(plan).wait()

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> PendingStep:
        """Queue a step on the GPU without waiting for it: state changes, forward, sampling and
        the copy of the sampled tokens back to the host. The worker receives the next plan while
        this one runs; `PendingStep.wait()` gives the output."""
        if self.pooling:
            return pool_step(self, plan)
        # The graph's logits buffer is read by the sampler before the next replay rewrites it
        # (same stream), so no copy is needed here.
        logits, rows = self._forward(plan, copy_logits=False)
        return self._sample(plan, logits, rows)

    @torch.inference_mode()
    def launch_forward(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first half of `launch`, for a plan whose masks come later: state changes and the
        forward pass, queued. Returns what `launch_sample` takes."""
        return self._forward(plan, copy_logits=False)

    @torch.inference_mode()
    def launch_sample(self, plan: StepPlan, forward: tuple[torch.Tensor, torch.Tensor | None],
                      completion: StepPlan | None = None,
                      masks: TokenMasks | None = None) -> PendingStep:
        """The second half: sampling under the plan's masks and their `completion`, or under
        `masks` the worker computed itself (a worker-side grammar backend)."""
        return self._sample(plan, *forward, completion=completion, masks=masks)

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Apply the plan's state changes and return float32 logits [num sampled, vocab]."""
        return self._forward(plan, copy_logits=True)[0]

    @torch.inference_mode()
    def sample(self, plan: StepPlan, logits: torch.Tensor) -> StepOutput:
        """Sample one token for every scheduled request with sched_sample, in plan order."""
        return self._sample(plan, logits, None).wait()

    def _forward(self, plan: StepPlan,
                 copy_logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of the sampled rows, and their slots on the device when already there.
        `copy_logits`: copy them out of the CUDA graph's buffer (which the next replay reuses)."""
        out = self._forward_pass(plan, copy_logits)
        if self.kv_transfer is not None:  # PD prefill: the KV this forward computed leaves
            self.kv_transfer.after_forward()
        return out

    def _forward_pass(self, plan: StepPlan,
                      copy_logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.idle_clock.begin()  # before the step's first kernel (its state changes)
        self._apply_state(plan)
        if len(plan.sched_slot) == 0:
            return torch.empty(0, self.config.vocab_size, device=self.device), None
        positions, out_loc, query_start = self._token_indices(plan)
        sample = plan.sched_sample.astype(bool)
        wanted = self.sampler.prompt_logprobs_pending(plan.sched_slot).tolist()
        drafts = Drafts.of(plan)
        if self.lora is not None and (self.graphs or self.extend_graphs or self.verify_graphs):
            # The per-token adapter slots a graph replay reads.
            self.lora.prepare(plan, per_token=True)
        # Prompt logprobs read every position's hidden state, and so does verifying drafts
        # (logits at every draft position): eager, or a verify graph below.
        graph_run = None if (wanted or drafts is not None) and not self.lockstep else \
            self._replay(plan, positions, out_loc, query_start)
        if graph_run is not None:
            logits, slots_dev = graph_run
            if sample.all():
                return (logits.clone() if copy_logits else logits), slots_dev
            rows = to_device_int64([np.flatnonzero(sample)], self.device)[0]
            return logits[rows], slots_dev[rows]
        # A draft head's pure verify steps replay a verify graph (worker/verify_graph.py).
        hidden = None if self.verify_graphs is None or wanted else \
            self.verify_graphs.run_step(plan, positions, out_loc, query_start, self.drafter)
        if hidden is None:
            batch = self._build_batch(plan, positions, out_loc, query_start)
            self.backend.prepare(batch)
            if self.lora is not None:  # eager: the adapter segments
                self.lora.prepare(plan, per_token=False)
            hidden = self.model(batch.input_ids, batch.positions, batch)
            if self.drafter is not None:
                self.drafter.aux = self.model.model.captured  # type: ignore[union-attr]
        if wanted:
            self.prompt_scorer.score(plan, hidden, query_start, wanted, self.model, self.sampler)
        last = query_start[1:] - 1
        picked = last[sample] if drafts is None else drafts.logit_rows(query_start, sample)
        rows = to_device_int64([picked], self.device)[0]
        return self.model.compute_logits(hidden[rows]), None  # type: ignore[operator]

    def _replay(self, plan: StepPlan, positions: np.ndarray, out_loc: np.ndarray,
                query_start: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Run the step as a captured graph if one fits it: (logits of every request's last
        token, slots on the device); None: the step runs eagerly."""
        num_requests, num_tokens = len(plan.sched_slot), int(query_start[-1])
        ids = plan.sched_tokens.astype(np.int64)
        if self.lockstep:  # the tick chose for every rank (`decode_only`): a size, or eager
            bs = dp_graph_batch()
            if bs is None or self.graphs is None:
                return None
            if not decode_only(plan, self.sampler, applied=True):
                raise RuntimeError(f"step {plan.step_id}: the lockstep tick chose a decode graph "
                                   "for a plan that is not decode-only")
            return self.graphs.run(ids, positions, out_loc, plan.sched_slot, bs)
        if (self.graphs is not None and num_tokens == num_requests
                and self.graphs.can_run(num_requests)):
            return self.graphs.run(ids, positions, out_loc, plan.sched_slot)
        if self.extend_graphs is not None and self.extend_graphs.can_run(num_tokens, num_requests):
            return self.extend_graphs.run(ids, positions, out_loc, plan.sched_slot.astype(np.int64),
                                          plan.sched_start_pos.astype(np.int64), query_start)
        return None

    def _sample(self, plan: StepPlan, logits: torch.Tensor, slots_dev: torch.Tensor | None,
                completion: StepPlan | None = None,
                masks: TokenMasks | None = None) -> PendingStep:
        sample = plan.sched_sample.astype(bool)
        slots = plan.sched_slot[sample].astype(np.uint32)  # a copy: plan arrays die at next recv
        drafts = Drafts.of(plan)
        if drafts is not None:  # one row per verified position (spec_verify.py)
            slots = np.repeat(slots, drafts.rows)
        if self.sampler.any_penalized(plan.sched_slot):
            starts = np.concatenate([[0], np.cumsum(plan.sched_tokens_len.astype(np.int64))])
            for i, slot in enumerate(plan.sched_slot.tolist()):
                ids = plan.sched_tokens[starts[i]:starts[i + 1]]
                # A LAST_SAMPLED input is a sampled token: the sampler already holds it.
                self.sampler.observe_inputs(slot, ids[ids != LAST_SAMPLED].tolist())
        prompt = self.prompt_scorer.take()
        if len(slots) == 0:
            span = self.idle_clock.end()
            step = PendingStep(slots, None, prompt=prompt, idle_clock=self.idle_clock, span=span)
            return step if self.drafter is None else self.drafter.after(plan, step)  # a chunk's KV
        if slots_dev is None:
            slots_dev = to_device_int64([slots], self.device)[0]
        failed = self.lora.failed & set(slots.tolist()) if self.lora is not None else set()
        if self._kv_failed:
            failed = failed | (self._kv_failed & set(slots.tolist()))
            self._kv_failed -= failed
        res = self.sampler.sample(slots.tolist(), logits, slots_dev,
                                  masks if masks is not None else token_masks(plan, slots, completion))
        sync_sampled_tokens(res.tokens)  # tensor parallelism: every rank keeps rank 0's ids
        # With drafts a slot has several rows and keeps one of them: no placeholder decode
        # follows a step with drafts (the scheduler waits for its accepted tokens).
        self.last_tokens[slots_dev] = res.tokens
        outputs = DeviceToHost([res.tokens, res.logprobs, res.top_ids, res.top_logprobs])
        span = self.idle_clock.end()  # after the step's last kernel and copy
        step = PendingStep(slots, outputs, self.sampler.top_k_of(slots), prompt, self.idle_clock,
                           span, drafts, failed=failed)
        return step if self.drafter is None else self.drafter.after(plan, step)

    # --- plan → state and batch ------------------------------------------------------------

    @torch.inference_mode()
    def _compile_eager_steps(self) -> None:
        """Runs two mixed steps eagerly on scratch slots and pages before serving, so that the
        kernels only an eager step launches (past the CUDA graphs' sizes) are compiled now: the
        extend kernel's untiled launch for a prompt chunk after earlier tokens, and
        `prefill_attention` for fresh prompts. Triton compiles a kernel variant on first use;
        in the middle of a run that stalls every running stream (1.5 s in S1 on an H100, at the
        first chunk that continued a prompt past 64 requests)."""
        ps = self.page_size
        if self.max_context_len < 48:  # a context shorter than these steps' positions
            return
        slots = [0, 1][:self.max_slots]
        width = -(-48 // ps)  # pages for positions 0..47
        rows = [(slot, 0, range(slot * width, (slot + 1) * width)) for slot in slots]
        for start in (16, 0):  # a chunk after 16 earlier tokens, then a fresh prompt
            chunk = (slots[-1], start, [0] * 16, True)
            decode = [(0, 16, [0], True)] if len(slots) > 1 else []
            plan = StepPlan.build(page_tables=rows, scheduled=[*decode, chunk])
            self.kv_cache.update_page_table(plan.pt_slot, plan.pt_first, plan.pt_pages_len,
                                            plan.pt_pages)
            batch = self._build_batch(plan, *self._token_indices(plan))
            self.backend.prepare(batch)
            hidden = self.model(batch.input_ids, batch.positions, batch)
            self.model.compute_logits(hidden[-1:])  # type: ignore[operator]

    def _apply_state(self, plan: StepPlan) -> None:
        if self._kv_failed:  # a slot let go or taken by a new request fails no more
            self._kv_failed -= set(plan.finished_slot.tolist()) | set(plan.new_slot.tolist())
        for slot in plan.finished_slot.tolist():
            self.sampler.drop(slot)
            self.prompt_scorer.drop(slot)
        for i, slot in enumerate(plan.new_slot.tolist()):
            if slot >= self.max_slots:
                raise ValueError(f"new request slot {slot} >= max_slots {self.max_slots}")
        for slot, params, lists in new_request_rows(plan):
            lora_id, lora_path = params.pop("lora_id"), bytes(lists.pop("lora_path")).decode()
            if self.lora is not None:
                self.lora.admit(slot, lora_id, lora_path)
            elif lora_id:
                raise ValueError(f"slot {slot}: a LoRA adapter without --enable-lora")
            self.sampler.add(slot, params, **lists)
            self.prompt_scorer.drop(slot)
        swa_layout.apply_page_tables(self, plan)
        if not len(plan.copy_src):
            return
        src, dst, kind, key = plan.copy_src, plan.copy_dst, plan.copy_kind, plan.copy_key
        if self.kv_transfer is not None:  # PD: receives now, sends after the forward
            src, dst, kind, key = self.kv_transfer.before_forward(src, dst, kind, key,
                                                                  self._kv_failed)
            if not len(src):
                return
        if self.host_kv is not None:
            self.host_kv.run(src, dst, kind, key)
        elif np.any(kind != 0):  # copy_kind.DEVICE
            raise ValueError("host-tier page copies without --enable-hierarchical-cache")
        else:
            self.kv_cache.copy_pages(src, dst)

    def _token_indices(self, plan: StepPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per token: position and flat KV-cache index; per request: cumulative token offsets."""
        slots = plan.sched_slot.astype(np.int64)
        num_tokens = plan.sched_tokens_len.astype(np.int64)
        start_pos = plan.sched_start_pos.astype(np.int64)
        total = int(num_tokens.sum())
        ends = start_pos + num_tokens
        if len(ends) and int(ends.max()) > self.max_context_len:
            i = int(ends.argmax())
            raise ValueError(f"step {plan.step_id}: slot {slots[i]} reaches position {ends[i]} > "
                             f"max_context_len {self.max_context_len}")
        query_start = np.concatenate([[0], np.cumsum(num_tokens)]).astype(np.int64)
        if total == len(slots):  # one token per request: no repeats needed
            positions = start_pos
            pages = self.kv_cache.page_table_host[slots, positions // self.page_size]
        else:
            tok_slot = np.repeat(slots, num_tokens)
            positions = np.repeat(start_pos - query_start[:-1], num_tokens) + np.arange(total)
            pages = self.kv_cache.page_table_host[tok_slot, positions // self.page_size]
        out_loc = pages.astype(np.int64) * self.page_size + positions % self.page_size
        return positions, out_loc, query_start

    def _build_batch(self, plan: StepPlan, positions: np.ndarray, out_loc: np.ndarray,
                     query_start: np.ndarray) -> ForwardBatch:
        slots = plan.sched_slot.astype(np.int64)
        num_tokens = plan.sched_tokens_len.astype(np.int64)
        start_pos = plan.sched_start_pos.astype(np.int64)
        ids = plan.sched_tokens.astype(np.int64)
        # Placeholders (one-step-ahead decodes): token index and slot of each.
        holes = np.flatnonzero(ids == LAST_SAMPLED)
        hole_slots = np.repeat(slots, num_tokens)[holes]
        (ids_d, pos_d, loc_d, slots_d, seq_lens_d, qs_d, sp_d, holes_d, hole_slots_d) = (
            to_device_int64([ids, positions, out_loc, slots, start_pos + num_tokens, query_start,
                             start_pos, holes, hole_slots], self.device))
        if len(holes):
            ids_d[holes_d] = self.last_tokens[hole_slots_d]
        batch = ForwardBatch(
            input_ids=ids_d, positions=pos_d, out_cache_loc=loc_d, slots=slots,
            num_tokens=num_tokens, start_pos=start_pos, query_start=query_start,
            kv_cache=self.kv_cache, backend=self.backend,
            request_arrays=(slots_d, seq_lens_d, qs_d, sp_d))
        batch.swa = None if self.swa is None else self.swa.view(batch, positions)
        return batch

