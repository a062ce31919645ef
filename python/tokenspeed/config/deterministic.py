"""`--enable-deterministic-inference`: which other settings it cannot combine with yet, refused
when `tokenspeed serve` resolves its arguments (before any worker loads), and the start-up line
saying what it changes. The kernels themselves: layers/batch_invariant.py."""

from __future__ import annotations

from typing import Any

from tokenspeed.config.errors import NotSupportedError

_SUFFIX = "not supported yet with --enable-deterministic-inference"


def _conflicts(cfg: Any) -> list[str]:
    """The given flags whose kernels or communication reduce in a batch-dependent order."""
    found = []
    if cfg.attention_backend not in (None, "torch_native", "triton"):
        found.append(f"--attention-backend {cfg.attention_backend} (its kernels' reduction order "
                     "depends on the batch; triton and torch_native have a batch-invariant path)")
    if cfg.quantization is not None:
        found.append(f"--quantization {cfg.quantization} (FP8 GEMMs)")
    if cfg.lm_head_quantization == "fp8":
        found.append("--lm-head-quantization fp8 (FP8 GEMMs)")
    if cfg.enable_lora:
        found.append("--enable-lora")
    if cfg.speculative_algorithm is not None:
        found.append(f"--speculative-algorithm {cfg.speculative_algorithm}")
    if cfg.tp_size > 1 or cfg.ep_size > 1 or cfg.enable_dp_attention:
        found.append("tensor/expert/data-parallel attention (--tp-size, --ep-size, "
                     "--enable-dp-attention: all-reduces whose algorithm depends on the size)")
    return found


def check_deterministic(cfg: Any) -> Any:
    """`cfg` unchanged, or NotSupportedError naming each flag the mode cannot honour yet."""
    if not cfg.enable_deterministic_inference:
        return cfg
    found = _conflicts(cfg)
    if found:
        raise NotSupportedError([f"{_SUFFIX}: {what}" for what in found])
    return cfg


def check_model(num_experts: int, fp8: bool) -> None:
    """Refuses, at worker start, what only the checkpoint reveals (MoE routing, FP8 weights)."""
    if num_experts:
        raise NotSupportedError([(f"{_SUFFIX}: mixture-of-experts models (the expert GEMMs' "
                                  "grouping depends on the batch)")])
    if fp8:
        raise NotSupportedError([f"{_SUFFIX}: FP8 checkpoints (FP8 GEMMs)"])


def deterministic_note(device: str, backend: str) -> str:
    """The start-up log line: what the mode changes."""
    gemm = ("a Triton matmul with one tile config for every M, no split-K" if device == "cuda"
            else "fixed 16-row GEMM blocks")
    attention = ("one Triton kernel for every query row" if backend == "triton"
                 else "torch_native tiled attention")
    return ("deterministic inference: batch-invariant linear layers and LM head "
            f"({gemm}); {attention}, keys reduced in 64-key tiles from position 0 whether the "
            "row is a prefill chunk, a prefix hit or a decode; per-row log_softmax logprobs"
            + ("; CUDA graphs for decode steps only (prompt steps eager)" if device == "cuda"
               else "; one intra-op thread unless OMP_NUM_THREADS is set"))
