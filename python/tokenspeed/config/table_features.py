"""Flag table, part 3: model overrides, LoRA, kernel backends, speculative decoding,
hierarchical cache / KV store, Mamba cache, double sparsity, offloading, misc features."""

from __future__ import annotations

from tokenspeed.config.flag import (
    G_HICACHE,
    G_KERNEL,
    G_LORA,
    G_MAMBA,
    G_MISC,
    G_NGRAM,
    G_OFFLOAD,
    G_OVERRIDE,
    G_SPARSITY,
    G_SPEC,
    Flag,
    b,
    c,
    f,
    i,
    j,
    lst,
    s,
)
from tokenspeed.config.lora import DEFAULT_MAX_RANK

# The table is laid out by hand, one flag per few lines.
# fmt: off
ATTENTION_BACKENDS = (
    "torch_native", "triton", "flashinfer", "fa3", "fa4", "flashmla", "cutlass_mla", "trtllm_mla",
    "trtllm_mha", "aiter", "wave", "intel_amx", "ascend", "nsa", "dual_chunk_flash_attn",
    "hybrid_linear_attn",
)

LORA_MODULES = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
    "gate_up_proj", "all",
)

OVERRIDE_FLAGS: list[Flag] = [
    j("--json-model-override-args", "JSON object merged over the model's config.json (nested "
      "objects key by key), for the launcher and every worker: e.g. a longer rope_scaling, or "
      "'{\"architectures\": [\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": "
      "[\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}' to serve an original "
      "Qwen3-Reranker as a cross-encoder (docs/embeddings.md). vLLM's --hf-overrides is the "
      "same setting.", G_OVERRIDE, aliases=("--hf-overrides",), json_type=dict,
      readers=("launch", "worker"), implemented=True),
    j("--preferred-sampling-params", "JSON default sampling parameters for requests that set "
      "none.", G_OVERRIDE),
]

# The launcher resolves the LoRA flags with the start-up adapters (config/lora.py) and hands
# the server its part as one `lora` object.
LORA_FLAGS: list[Flag] = [
    b("--enable-lora", "Serve LoRA adapters (PEFT format) on top of the base model; requests "
      "name one by `model` or `lora_path`. Implied by --lora-paths.", G_LORA,
      readers=("launch", "worker"), implemented=True),
    i("--max-lora-rank", "Largest LoRA rank to reserve room for. Default: the largest rank of "
      f"the --lora-paths adapters, else {DEFAULT_MAX_RANK}.",
      G_LORA, minimum=1, readers=("launch", "worker"), implemented=True),
    lst("--lora-target-modules", "Modules LoRA applies to, or 'all'. Default: those the "
        "--lora-paths adapters adapt, else all.", G_LORA, choices=LORA_MODULES,
        readers=("launch", "worker"), implemented=True),
    lst("--lora-paths", "Adapters to load at start: PATH, NAME=PATH, or a JSON object with "
        "lora_name, lora_path and pinned (true: never evicted from the GPU pool, which keeps "
        "a slot for it; at most --max-loras-per-batch - 1 pinned).", G_LORA, nargs="*",
        readers=("launch",), implemented=True),
    i("--max-loras-per-batch", "Most distinct adapters in one batch (the base model not "
      "counted): the adapter slots of the GPU pool.", G_LORA, 8, minimum=1,
      readers=("launch", "worker"), implemented=True),
    i("--max-loaded-loras", "Most adapters each worker keeps in host memory (least recently "
      "used dropped, read from disk again when needed). Default: no limit.", G_LORA, minimum=1,
      readers=("worker",), implemented=True),
    c("--lora-eviction-policy", "Which adapter leaves the GPU pool (--max-loras-per-batch "
      "slots) first when a step needs a slot: lru, the least recently used; fifo, the earliest "
      "loaded. Pinned adapters never leave.", G_LORA, ("lru", "fifo"), "lru", readers=("worker",), implemented=True),
    c("--lora-backend", "Kernels used for LoRA computation.", G_LORA, ("triton", "csgmv"),
      "triton", readers=("worker",)),
    c("--max-lora-chunk-size", "Chunk size of the chunked SGMV LoRA kernels.", G_LORA,
      (16, 32, 64, 128), 16, readers=("worker",)),
]

KERNEL_FLAGS: list[Flag] = [
    c("--attention-backend", "Attention kernels. Available now: triton, flashinfer (needs the "
      "flashinfer-python package; JIT-compiles on first use) and torch_native. Default: triton "
      "on CUDA, torch_native on CPU.", G_KERNEL,
      ATTENTION_BACKENDS, supported=("torch_native", "triton", "flashinfer"), readers=("worker",),
      implemented=True),
    c("--prefill-attention-backend", "Attention kernels for prefill only, overriding "
      "--attention-backend.", G_KERNEL, ATTENTION_BACKENDS, readers=("worker",)),
    c("--decode-attention-backend", "Attention kernels for decode only, overriding "
      "--attention-backend.", G_KERNEL, ATTENTION_BACKENDS, readers=("worker",)),
    c("--sampling-backend", "Kernels used for token sampling.", G_KERNEL,
      ("flashinfer", "pytorch", "ascend"), readers=("worker",)),
    c("--grammar-backend", "Engine for grammar- and JSON-schema-constrained decoding "
      "(response_format, guided_*, tool_choice required): llguidance computes token masks in "
      "the Rust core; xgrammar computes them on the worker (needs the xgrammar package); none "
      "refuses such requests.", G_KERNEL,
      ("xgrammar", "outlines", "llguidance", "none"), "llguidance",
      supported=("llguidance", "xgrammar", "none"), readers=("server", "worker"), implemented=True),
    c("--mm-attention-backend", "Attention kernels for multimodal encoders.", G_KERNEL,
      ("sdpa", "fa3", "triton_attn", "ascend_attn"), readers=("worker",)),
    c("--nsa-prefill-backend", "Sparse-attention (NSA) kernels for prefill.", G_KERNEL,
      ("flashmla_sparse", "flashmla_decode", "fa3", "tilelang", "aiter"), "flashmla_sparse",
      readers=("worker",)),
    c("--nsa-decode-backend", "Sparse-attention (NSA) kernels for decode.", G_KERNEL,
      ("flashmla_prefill", "flashmla_kv", "fa3", "tilelang", "aiter"), "flashmla_kv",
      readers=("worker",)),
    c("--fp8-gemm-backend", "Kernels for FP8 matrix multiplies.", G_KERNEL,
      ("auto", "deep_gemm", "flashinfer_trtllm", "cutlass", "triton", "aiter"), "auto",
      readers=("worker",)),
    b("--disable-flashinfer-autotune", "Skip FlashInfer kernel autotuning at start.", G_KERNEL,
      readers=("worker",)),
]

SPEC_FLAGS: list[Flag] = [
    c("--speculative-algorithm", "Speculative decoding method: NGRAM drafts by prompt lookup "
      "over the request's own tokens (no draft weights); EAGLE3 drafts with an EAGLE-3 head "
      "(--speculative-draft-model-path) over the target's hidden states; NEXTN with the "
      "model's own multi-token prediction layer (DeepSeek-V3's MTP, read from the model's "
      "checkpoint unless --speculative-draft-model-path names another; sharded as the "
      "target's layers on several ranks) "
      "(docs/speculative.md). EAGLE and STANDALONE are not built yet.", G_SPEC,
      ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"), supported=("NGRAM", "EAGLE3", "NEXTN"),
      readers=("scheduler", "worker"), implemented=True),
    j("--speculative-config", "Speculative decoding settings as one JSON object (vLLM style): "
      '{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, '
      '"prompt_lookup_max": b} sets the NGRAM flags; {"method": "eagle3", "model": PATH, '
      '"num_speculative_tokens": k} the EAGLE3 ones; {"method": "deepseek_mtp" (or "mtp"), '
      '"num_speculative_tokens": k} the NEXTN ones; "disable_by_batch_size": n, with any '
      'method, sets --speculative-disable-by-batch-size.',
      G_SPEC, readers=("launch",), implemented=True),
    s("--speculative-draft-model-path", "Draft model for speculative decoding: the directory of "
      "an EAGLE-3 head in its public layout (config.json and safetensors or pytorch_model.bin; "
      "a config alone with --load-format dummy draws random weights); for NEXTN, a checkpoint "
      "holding the MTP layer (default: the model's own).", G_SPEC,
      aliases=("--speculative-draft-model",), readers=("worker",), metavar="PATH",
      implemented=True),
    s("--speculative-draft-model-revision", "Revision of the draft model.", G_SPEC,
      readers=("worker",)),
    i("--speculative-num-steps", "Draft steps per verification: EAGLE3's and NEXTN's chain "
      "length, one draft token each (default: --speculative-num-draft-tokens).", G_SPEC, minimum=1,
      readers=("worker",), implemented=True),
    i("--speculative-eagle-topk", "Candidates kept per draft step in EAGLE tree drafting (1: "
      "a chain; tree drafting is not built yet).", G_SPEC, minimum=1, readers=("launch",),
      implemented=True, max_supported=1),
    i("--speculative-num-draft-tokens", "Draft tokens verified per request per step (needed "
      "with --speculative-algorithm).", G_SPEC, minimum=1, readers=("scheduler", "worker"),
      implemented=True),
    i("--speculative-disable-by-batch-size", "Steps with this many running requests or more "
      "run without speculation: plain decode steps, no drafts verified (0: never; vLLM's "
      "--speculative-config disable_by_batch_size). 32: above it a step verifying drafts "
      "costs more than even a good acceptance (3.5) returns on an H200 (docs/speculative.md); "
      "below it the acceptance rule (--speculative-break-even-accept-length) decides.",
      G_SPEC, 32, minimum=0, readers=("scheduler",), implemented=True),
    f("--speculative-break-even-accept-length", "Speculation pauses while the running average "
      "of tokens per verifying request-step (accepted drafts + 1) is below this plus "
      "--speculative-break-even-per-request times the running requests, and is retried every "
      "--speculative-probe-interval plain steps (0: never pauses). Defaults fit an EAGLE-3 "
      "chain of 3 over Llama-3.1-8B on an H200 (docs/speculative.md).", G_SPEC, 1.7,
      minimum=0.0, readers=("scheduler",), implemented=True),
    f("--speculative-break-even-per-request", "How much the break-even acceptance length "
      "grows per running request (see --speculative-break-even-accept-length).", G_SPEC, 0.04,
      minimum=0.0, readers=("scheduler",), implemented=True),
    i("--speculative-probe-interval", "Plain steps between two tries of paused speculation "
      "(each try runs 2 speculative steps; see --speculative-break-even-accept-length).",
      G_SPEC, 64, minimum=1, readers=("scheduler",), implemented=True),
    f("--speculative-accept-threshold-single", "Probability above which one draft token is "
      "accepted.", G_SPEC, 1.0, minimum=0.0, maximum=1.0, readers=("worker",)),
    f("--speculative-accept-threshold-acc", "Accumulated probability threshold for accepting "
      "draft tokens.", G_SPEC, 1.0, minimum=0.0, maximum=1.0, readers=("worker",)),
    s("--speculative-token-map", "File restricting the draft vocabulary to frequent tokens.",
      G_SPEC, readers=("worker",), metavar="PATH"),
    c("--speculative-attention-mode", "Whether verification runs as a prefill or a decode "
      "attention pass.", G_SPEC, ("prefill", "decode"), "prefill", readers=("worker",)),
    s("--speculative-moe-runner-backend", "MoE runner for the draft model.", G_SPEC,
      readers=("worker",)),
    s("--speculative-moe-a2a-backend", "MoE all-to-all backend for the draft model.", G_SPEC,
      readers=("worker",)),
]

NGRAM_FLAGS: list[Flag] = [
    i("--speculative-ngram-min-match-window-size", "Shortest n-gram suffix matched when "
      "drafting.", G_NGRAM, 1, minimum=1, readers=("scheduler",), implemented=True),
    i("--speculative-ngram-max-match-window-size", "Longest n-gram suffix matched when "
      "drafting.", G_NGRAM, 12, minimum=1, readers=("scheduler",), implemented=True),
    i("--speculative-ngram-min-bfs-breadth", "Smallest breadth of the n-gram draft tree.",
      G_NGRAM, 1, minimum=1),
    i("--speculative-ngram-max-bfs-breadth", "Largest breadth of the n-gram draft tree.",
      G_NGRAM, 10, minimum=1),
    c("--speculative-ngram-match-type", "How n-gram drafts are ranked: BFS order or by "
      "frequency (PROB).", G_NGRAM, ("BFS", "PROB"), "BFS"),
    i("--speculative-ngram-branch-length", "Tokens per branch stored in the n-gram cache.",
      G_NGRAM, 18, minimum=1),
    i("--speculative-ngram-capacity", "Entries kept in the n-gram cache.", G_NGRAM, 10000000,
      minimum=1),
]

HICACHE_FLAGS: list[Flag] = [
    b("--enable-hierarchical-cache", "Spill prefix-cache KV pages to a host-memory tier "
      "instead of dropping them, and load them back on a prefix hit (HiCache). Needs the "
      "radix cache.", G_HICACHE, readers=("worker",), implemented=True),
    f("--hicache-ratio", "Host KV pool size as a multiple of the GPU KV pool.", G_HICACHE, 2.0,
      minimum=0.0, min_exclusive=True, readers=("worker",), implemented=True),
    i("--hicache-size", "Host KV pool size in GB; overrides --hicache-ratio when non-zero.",
      G_HICACHE, 0, minimum=0, readers=("worker",), implemented=True),
    c("--hicache-write-policy", "When GPU KV pages are copied to host memory: write_through "
      "as soon as they are cached (eviction then costs no copy), write_back only when they "
      "are evicted.", G_HICACHE, ("write_back", "write_through", "write_through_selective"),
      "write_through", supported=("write_back", "write_through"),
      refusals={"write_through_selective": "copying only prefixes hit "
                "more than once is not built yet; use write_through or write_back"},
      readers=("scheduler",), implemented=True),
    c("--radix-eviction-policy", "Which cached prefix is evicted first: lru (least recently "
      "used) or lfu (least frequently hit, ties by recency).", G_HICACHE, ("lru", "lfu"), "lru",
      readers=("scheduler",), implemented=True),
    c("--hicache-io-backend", "Copy mechanism between GPU and host KV pools.", G_HICACHE,
      ("direct", "kernel", "kernel_ascend"), "kernel", readers=("worker",)),
    c("--hicache-mem-layout", "Layout of the host KV pool.", G_HICACHE,
      ("layer_first", "page_first", "page_first_direct", "page_first_kv_split"), "layer_first",
      readers=("worker",)),
    c("--hicache-storage-backend", "Third tier for KV pages below host memory: what the host "
      "tier drops is stored there under the pages' block hashes and fetched back on a prefix "
      "hit. file: one file per page in a local directory (--hicache-storage-backend-extra-config "
      "sets `path` and `capacity_gb`). Needs --enable-hierarchical-cache.", G_HICACHE,
      ("file", "mooncake", "hf3fs", "nixl", "aibrix", "dynamic", "eic"), supported=("file",),
      refusals={name: "only the local-file storage backend is built; use file" for name in
                ("mooncake", "hf3fs", "nixl", "aibrix", "dynamic", "eic")},
      readers=("worker",), implemented=True),
    c("--hicache-storage-prefetch-policy", "When a prefetch from the storage tier may stop.",
      G_HICACHE, ("best_effort", "wait_complete", "timeout"), "best_effort"),
    s("--hicache-storage-backend-extra-config", "JSON settings of the storage tier. file: "
      '{"path": directory (default /tmp/tokenspeed-hicache), "capacity_gb": the most it holds '
      "(default 16)}; each model, KV layout and rank gets its own subdirectory.",
      G_HICACHE, readers=("worker",), implemented=True),
    b("--enable-lmcache", "Use LMCache as the hierarchical KV cache.", G_HICACHE,
      readers=("server", "worker")),
    s("--kvstore-backend", "External KV store that shares prefix KV pages between TokenSpeed "
      "servers.", G_HICACHE, readers=("server", "worker"), metavar="NAME"),
    j("--kvstore-config", "JSON settings for the external KV store.", G_HICACHE,
      readers=("server", "worker")),
]

MAMBA_FLAGS: list[Flag] = [
    i("--max-mamba-cache-size", "Most state slots in the Mamba cache.", G_MAMBA, minimum=1,
      readers=("server", "worker")),
    c("--mamba-ssm-dtype", "Storage type of Mamba SSM state.", G_MAMBA, ("float32", "bfloat16"),
      "float32", readers=("worker",)),
    f("--mamba-full-memory-ratio", "Memory of Mamba state relative to full-attention KV cache.",
      G_MAMBA, 0.2, minimum=0.0, min_exclusive=True, readers=("server", "worker")),
    c("--mamba-scheduler-strategy", "How the scheduler budgets Mamba state.", G_MAMBA,
      ("auto", "no_buffer", "extra_buffer"), "auto"),
    i("--mamba-track-interval", "Tokens between saved Mamba state checkpoints.", G_MAMBA, 256,
      minimum=1),
]

SPARSITY_FLAGS: list[Flag] = [
    b("--enable-double-sparsity", "Use double-sparsity attention.", G_SPARSITY,
      readers=("worker",)),
    s("--ds-channel-config-path", "Channel configuration file for double sparsity.", G_SPARSITY,
      readers=("worker",), metavar="PATH"),
    i("--ds-heavy-channel-num", "Heavy channels kept by double sparsity.", G_SPARSITY, 32,
      minimum=1, readers=("worker",)),
    i("--ds-heavy-token-num", "Heavy tokens kept by double sparsity.", G_SPARSITY, 256,
      minimum=1, readers=("worker",)),
    s("--ds-heavy-channel-type", "Which projection picks the heavy channels.", G_SPARSITY, "qk",
      readers=("worker",)),
    i("--ds-sparse-decode-threshold", "Sequence length above which decode uses double "
      "sparsity.", G_SPARSITY, 4096, minimum=0, readers=("worker",)),
]

OFFLOAD_FLAGS: list[Flag] = [
    i("--cpu-offload-gb", "GB of weights kept in host memory instead of on the GPU.", G_OFFLOAD,
      0, minimum=0, readers=("worker",)),
    i("--offload-group-size", "Layers per offloading group; -1 turns group offload off.",
      G_OFFLOAD, -1, minimum=1, allowed_special=(-1,), readers=("worker",)),
    i("--offload-num-in-group", "Layers offloaded within each group.", G_OFFLOAD, 1, minimum=1,
      readers=("worker",)),
    i("--offload-prefetch-step", "Layers prefetched ahead of use.", G_OFFLOAD, 1, minimum=0,
      readers=("worker",)),
    s("--offload-mode", "Where offloaded layers live.", G_OFFLOAD, "cpu", readers=("worker",)),
]

MISC_FLAGS: list[Flag] = [
    i("--multi-item-scoring-delimiter", "Token ID that separates query and items in "
      "multi-item scoring requests.", G_MISC, minimum=0, readers=("server", "worker")),
    j("--forward-hooks", "JSON list of forward hooks to attach to model modules.", G_MISC,
      readers=("worker",)),
    b("--enable-deterministic-inference", "Batch-invariant kernels: a request's tokens and "
      "logprobs are bit-identical whatever else is in the batch (other requests, prompt "
      "chunking, prefix-cache hits). Linear layers and the LM head in fixed-shape GEMMs (a "
      "Triton matmul on CUDA), attention over 64-key tiles from position 0 for every row, "
      "per-row logprobs, CUDA graphs for decode steps only; sampled requests need a `seed`. "
      "Slower (docs/deterministic.md); not yet with FP8 weights, LoRA, MoE, speculative "
      "decoding, TP/EP or the flashinfer backend.", G_MISC, readers=("worker",),
      implemented=True),
]

FEATURE_TABLE: list[Flag] = [
    *OVERRIDE_FLAGS,
    *LORA_FLAGS,
    *KERNEL_FLAGS,
    *SPEC_FLAGS,
    *NGRAM_FLAGS,
    *HICACHE_FLAGS,
    *MAMBA_FLAGS,
    *SPARSITY_FLAGS,
    *OFFLOAD_FLAGS,
    *MISC_FLAGS,
]
# fmt: on
