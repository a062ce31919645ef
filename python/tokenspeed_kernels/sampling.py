"""Greedy sampling with the chosen token's logprob in one pass over the logits.

A greedy batch needs, per row, the argmax and log_softmax at it. In torch that is an argmax, a
log-sum-exp (a max pass, then exp and sum materialised) and a gather, plus a float copy of
16-bit logits: at S1 sizes (411 x 128256 float32 logits from a decode graph's buffer) the
sampler's kernels took 0.58 ms of a 34 ms step on the H100 (benches/diagnostics/profile_decode_kernels.py).
This reads the logits once, keeping a running max, its first index and the sum of
exponentials (the online log-sum-exp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GREEDY_BLOCK = 16384


@triton.jit
def _greedy_logprobs_kernel(logits_ptr, stride_b, vocab, tokens_ptr, logprobs_ptr,
                            BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_b
    offs = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)  # running max
    s = tl.full((), 0.0, tl.float32)  # sum of exp(x - m)
    best = tl.full((), 0, tl.int32)  # first index of the running max
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        block_max = tl.max(x, 0)
        block_arg = tl.argmax(x, 0, tie_break_left=True)
        new_m = tl.maximum(m, block_max)
        # -inf - -inf is nan: a running max still at -inf contributes nothing.
        alpha = tl.where(m == float("-inf"), 0.0, tl.exp(m - new_m))
        p = tl.where(x == float("-inf"), 0.0, tl.exp(x - new_m))
        s = s * alpha + tl.sum(p, 0)
        # strictly greater: a tie with an earlier block keeps the earlier (smaller) index
        best = tl.where(block_max > m, start + block_arg, best)
        m = new_m
    tl.store(tokens_ptr + row, best.to(tl.int64))
    # log_softmax at the max = max - (max + log(sum exp(x - max)))
    tl.store(logprobs_ptr + row, -tl.log(s))


def greedy_logprobs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, vocab] (any float dtype, last dim contiguous) -> (tokens [B] int64: the argmax,
    the first index among equal maxima as torch.argmax; logprobs [B] float32: log_softmax of the
    logits at that token, computed in fp32)."""
    assert logits.dim() == 2 and logits.stride(1) == 1
    batch, vocab = logits.shape
    tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(batch, dtype=torch.float32, device=logits.device)
    if batch:
        # One program per row; wide blocks, so a lone row (batch-1 decode) takes few
        # latency-bound iterations (8 for a 128k vocabulary).
        _greedy_logprobs_kernel[(batch,)](logits, logits.stride(0), vocab, tokens, logprobs,
                                          BLOCK=GREEDY_BLOCK, num_warps=16)  # fmt: skip
    return tokens, logprobs
