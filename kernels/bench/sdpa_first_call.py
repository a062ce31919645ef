"""First-call cost of torch SDPA (cuDNN / flash) per new prompt length: cuDNN builds an
execution plan per shape (~35 ms on an H100, session 13), which is why the paged extend kernel
stays the prefill attention. Prints ms of the first and the second call at each length.

    python3 kernels/bench/sdpa_first_call.py   # GPU only
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HQ, HKV, D = 32, 8, 128
LENGTHS = (1000, 1001, 1002, 1003, 1024, 2047, 3000, 3001, 4096, 4100)


def call(n: int, backend: SDPBackend) -> float:
    """ms of one causal GQA call on a prompt of n tokens, host clock around a synchronised call."""
    q = torch.randn(1, HQ, n, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, HKV, n, D, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with sdpa_kernel([backend]):
        F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0)


def main() -> None:
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        for n in LENGTHS:
            print(f"{backend.name} n={n}: first {call(n, backend):.2f} ms, second "
                  f"{call(n, backend):.2f} ms")


if __name__ == "__main__":
    main()
