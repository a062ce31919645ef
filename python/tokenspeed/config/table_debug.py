"""Flag table, part 4: optimization and debugging switches (CUDA graphs, compilation,
overlap scheduling, ...), tensor dumps, custom weight loading, and deprecated SGLang flags."""

from __future__ import annotations

from typing import Any

from tokenspeed.config.derived import MAX_DEFAULT_CUDA_GRAPH_BS
from tokenspeed.config.flag import (
    G_DEPRECATED,
    G_DUMP,
    G_LOADER,
    G_OPT,
    Flag,
    b,
    f,
    i,
    j,
    lst,
    s,
)
from tokenspeed.config.table_parallel import DEEPEP_REFUSAL

# The table is laid out by hand, one flag per few lines.
# fmt: off
OPT_FLAGS: list[Flag] = [
    b("--disable-cuda-graph", "Run every step eagerly instead of replaying captured CUDA graphs. "
      "vLLM's --enforce-eager is the same switch.", G_OPT, aliases=("--enforce-eager",),
      readers=("worker",), implemented=True),
    i("--cuda-graph-max-bs", "Largest batch size captured as a CUDA graph; bigger batches run "
      "eagerly. Default: --max-running-requests (given or derived from the KV pool), at most "
      f"{MAX_DEFAULT_CUDA_GRAPH_BS}: beyond that a decode step is long enough to hide its "
      "launches. vLLM's "
      "--max-cudagraph-capture-size is the same setting.", G_OPT, aliases=("--max-cudagraph-capture-size",), minimum=1,
      readers=("worker",), implemented=True),
    lst("--cuda-graph-bs", "Exact list of batch sizes to capture as CUDA graphs.", G_OPT,
        item="int", minimum=1, readers=("worker",)),
    b("--disable-cuda-graph-padding", "Skip CUDA graphs whenever a batch would need padding.",
      G_OPT, readers=("worker",)),
    b("--enable-profile-cuda-graph", "Profile the CUDA graph capture.", G_OPT,
      readers=("worker",)),
    b("--enable-cudagraph-gc", "Leave garbage collection on during CUDA graph capture.", G_OPT,
      readers=("worker",)),
    b("--enable-nccl-nvls", "Use NVLink SHARP in NCCL collectives.", G_OPT, readers=("worker",)),
    b("--enable-symm-mem", "Use NCCL symmetric-memory collectives.", G_OPT, readers=("worker",)),
    b("--disable-flashinfer-cutlass-moe-fp4-allgather", "Skip the FP4 quantize-before-all-gather "
      "step of FlashInfer CUTLASS MoE.", G_OPT, readers=("worker",)),
    b("--enable-tokenizer-batch-encode", "Tokenize the prompts of a batch request together.",
      G_OPT),
    b("--disable-outlines-disk-cache", "Keep the Outlines grammar cache off disk.", G_OPT),
    b("--disable-custom-all-reduce", "Use NCCL instead of the custom all-reduce kernel.", G_OPT,
      readers=("worker",)),
    b("--enable-mscclpp", "Use MSCCL++ for small all-reduce messages.", G_OPT,
      readers=("worker",)),
    b("--enable-torch-symm-mem", "Use PyTorch symmetric memory for all-reduce.", G_OPT,
      readers=("worker",)),
    b("--disable-overlap-schedule", "Stop overlapping CPU scheduling with GPU execution: "
      "schedule each step only after the previous one's tokens came back.", G_OPT,
      readers=("server", "worker"), implemented=True),
    b("--enable-mixed-chunk", "Let decode requests ride along in chunked-prefill batches.",
      G_OPT),
    b("--enable-two-batch-overlap", "Split each batch in two and overlap their communication "
      "and compute.", G_OPT, readers=("server", "worker")),
    b("--enable-single-batch-overlap", "Overlap communication and compute within one batch.",
      G_OPT, readers=("worker",)),
    f("--tbo-token-distribution-threshold", "Token imbalance at which two-batch overlap splits "
      "differently.", G_OPT, 0.48, minimum=0.0, maximum=1.0),
    b("--enable-torch-compile", "Compile the model with torch.compile.", G_OPT,
      readers=("worker",)),
    b("--enable-torch-compile-debug-mode", "Debug mode for torch.compile.", G_OPT,
      readers=("worker",)),
    b("--disable-piecewise-cuda-graph", "Run steps with prompt tokens (prefill/extend, alone or "
      "beside decodes) eagerly instead of replaying CUDA graphs. TokenSpeed captures whole "
      "extend steps of up to --piecewise-cuda-graph-max-tokens tokens and any number of requests, "
      "attention included (triton attention backend; not with data-parallel attention), which "
      "removes the eager path's host launch time from every first token and from a full batch's "
      "mixed steps.", G_OPT, readers=("worker",),
      implemented=True),
    b("--enable-piecewise-cuda-graph", "Deprecated, as in SGLang: extend-step CUDA graphs are on "
      "by default; --disable-piecewise-cuda-graph turns them off. Accepted and changes nothing.",
      G_OPT, readers=("worker",), implemented=True),
    lst("--piecewise-cuda-graph-tokens", "Exact token counts captured as extend-step CUDA graphs "
        "(a step is padded to the next one; a step beside decodes fills that padding with prompt "
        "tokens instead, within --chunked-prefill-size). Default: 16, 32, 64, then every 64 to "
        "512, then every 128 up to --piecewise-cuda-graph-max-tokens.",
        G_OPT, item="int", minimum=1, readers=("worker",), implemented=True),
    i("--torch-compile-max-bs", "Largest batch size compiled with torch.compile.", G_OPT, 32,
      minimum=1, readers=("worker",)),
    i("--piecewise-cuda-graph-max-tokens", "Largest step (in tokens) captured as an extend-step "
      "CUDA graph; larger steps run eagerly, their GPU time hides the launches. Default 2048 "
      "(SGLang: 4096): past ~1k tokens of an 8B model the GPU work outlasts the eager launch "
      "and padding would cost more than it saves.", G_OPT, 2048, minimum=1, readers=("worker",),
      implemented=True),
    b("--enable-nan-detection", "Check logits for NaNs at every step.", G_OPT,
      readers=("worker",)),
    b("--enable-p2p-check", "Test GPU peer-to-peer access instead of assuming it works.", G_OPT,
      readers=("worker",)),
    b("--triton-attention-reduce-in-fp32", "Reduce Triton attention partial results in "
      "float32.", G_OPT, readers=("worker",)),
    i("--triton-attention-num-kv-splits", "KV splits of the Triton flash-decoding kernel.", G_OPT,
      8, minimum=1, readers=("worker",)),
    i("--triton-attention-split-tile-size", "Tile size of the Triton flash-decoding split.",
      G_OPT, minimum=1, readers=("worker",)),
    i("--num-continuous-decode-steps", "Decode steps run back to back before scheduling again.",
      G_OPT, 1, minimum=1),
    b("--delete-ckpt-after-loading", "Delete the checkpoint files once the weights are loaded.",
      G_OPT, readers=("worker",)),
    b("--enable-memory-saver", "Allow releasing and resuming GPU memory through the API.", G_OPT,
      readers=("server", "worker")),
    b("--enable-weights-cpu-backup", "Keep a host copy of the weights while GPU memory is "
      "released.", G_OPT, readers=("worker",)),
    b("--allow-auto-truncate", "Cut over-long prompts to fit instead of rejecting them.", G_OPT),
    b("--enable-custom-logit-processor", "Accept user-supplied logit processors in requests.",
      G_OPT, readers=("server", "worker")),
    b("--flashinfer-mla-disable-ragged", "Avoid ragged prefill in FlashInfer MLA.", G_OPT,
      readers=("worker",)),
    b("--disable-shared-experts-fusion", "Keep shared experts separate from routed experts.",
      G_OPT, readers=("worker",)),
    b("--disable-chunked-prefix-cache", "Turn off chunked prefix cache for MLA models.", G_OPT,
      readers=("worker",)),
    b("--disable-fast-image-processor", "Use the slow Hugging Face image processor.", G_OPT),
    b("--keep-mm-feature-on-device", "Keep multimodal features on the GPU after use.", G_OPT,
      readers=("worker",)),
    b("--enable-return-hidden-states", "Allow requests to ask for hidden states.", G_OPT,
      readers=("server", "worker")),
    i("--scheduler-recv-interval", "Scheduler steps between polls for new requests.", G_OPT, 1,
      minimum=1),
    lst("--numa-node", "NUMA node to bind each worker process to.", G_OPT, item="int",
        minimum=0, readers=("worker",)),
    b("--enable-layerwise-nvtx-marker", "Add an NVTX range around every layer for Nsight.",
      G_OPT, readers=("worker",)),
    b("--enable-attn-tp-input-scattered", "Keep attention input scattered across TP ranks.",
      G_OPT, readers=("worker",)),
    b("--enable-nsa-prefill-context-parallel", "Context parallelism for long NSA prefills.",
      G_OPT, readers=("worker",)),
    b("--disable-jump-forward", "Turn off jump-forward decoding for constrained output.", G_OPT),
    b("--disable-mla", "Run MLA models with plain multi-head attention.", G_OPT,
      readers=("worker",)),
]

DUMP_FLAGS: list[Flag] = [
    s("--debug-tensor-dump-output-folder", "Write per-layer tensors to this folder.", G_DUMP,
      readers=("worker",), metavar="DIR"),
    s("--debug-tensor-dump-input-file", "Read model inputs from this tensor file.", G_DUMP,
      readers=("worker",), metavar="PATH"),
    s("--debug-tensor-dump-inject", "Feed recorded outputs in as the input of every layer.",
      G_DUMP, readers=("worker",)),
    b("--enable-dynamic-batch-tokenizer", "Batch tokenization of requests that arrive "
      "together.", G_DUMP),
    i("--dynamic-batch-tokenizer-batch-size", "Largest tokenizer batch for "
      "--enable-dynamic-batch-tokenizer.", G_DUMP, 32, minimum=1),
    f("--dynamic-batch-tokenizer-batch-timeout", "Seconds to wait while filling a tokenizer "
      "batch.", G_DUMP, 0.002, minimum=0.0),
]

LOADER_FLAGS: list[Flag] = [
    lst("--custom-weight-loader", "Import paths of functions allowed to update weights.",
        G_LOADER, readers=("worker",)),
    b("--weight-loader-disable-mmap", "Read safetensors files without memory-mapping them.",
      G_LOADER, readers=("worker",)),
    s("--remote-instance-weight-loader-seed-instance-ip", "Address of a running server to copy "
      "weights from.", G_LOADER, readers=("worker",)),
    i("--remote-instance-weight-loader-seed-instance-service-port", "Service port of that "
      "server.", G_LOADER, minimum=1, maximum=65535, readers=("worker",)),
    j("--remote-instance-weight-loader-send-weights-group-ports", "JSON list of ports for the "
      "weight-copy process groups.", G_LOADER, readers=("worker",)),
]


def _old(name: str, instead: str, **kw: Any) -> Flag:
    return b(name, f"Old SGLang switch, kept so recipes parse; use {instead}.", G_DEPRECATED,
             readers=("worker",), **kw)


DEPRECATED_FLAGS: list[Flag] = [
    _old("--enable-ep-moe", "--ep-size"),
    _old("--enable-deepep-moe", "--moe-a2a-backend deepep", refusals={True: DEEPEP_REFUSAL}),
    _old("--enable-flashinfer-cutlass-moe", "--moe-runner-backend flashinfer_cutlass"),
    _old("--enable-flashinfer-cutedsl-moe", "--moe-runner-backend flashinfer_cutedsl"),
    _old("--enable-flashinfer-trtllm-moe", "--moe-runner-backend flashinfer_trtllm"),
    _old("--enable-triton-kernel-moe", "--moe-runner-backend triton_kernel"),
    _old("--enable-flashinfer-mxfp4-moe", "--moe-runner-backend flashinfer_mxfp4"),
]

DEBUG_TABLE: list[Flag] = [*OPT_FLAGS, *DUMP_FLAGS, *LOADER_FLAGS, *DEPRECATED_FLAGS]
# fmt: on
