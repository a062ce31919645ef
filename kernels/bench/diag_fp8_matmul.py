"""GPU diagnostic of the Triton W8A8 matmul (tokenspeed_kernels.fp8_matmul): error per shape
against an fp64 dequantised reference, next to cuBLAS (torch._scaled_mm on zero-padded operands,
padding changes no sum), for the partial-sum promotion settings (0 = Triton's Hopper default,
never promoted; 32 = the kernel's default; 128 = DeepSeek-V3's interval), and the time each
setting costs at prefill-sized Llama-3.1-8B shapes.

A kernel bug (mask, scale, layout) shows as rel err >= 1e-2 or a max error of the order of the
outputs; fp8 tensor-core rounding as 1e-5..1e-4.

Run (GPU): cd kernels && PYTHONPATH=.:../python python3 bench/diag_fp8_matmul.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_kernels import graph_ms

from tokenspeed_kernels import fp8_matmul
from tokenspeed_kernels.fp8_gemm import ref_per_token_quant_fp8

E4M3 = torch.float8_e4m3fn
PROMOTES = (0, 32, 128)
# The unit test's shapes (ragged M/N/K), aligned ones, and the Llama-3.1-8B layers at prefill M.
ERROR_SHAPES = [(1, 40, 64), (37, 70, 100), (64, 33, 257), (16, 128, 32), (128, 256, 4096),
                (64, 512, 14336), (300, 6144, 4096)]
TIME_SHAPES = [(512, 6144, 4096), (512, 4096, 14336), (4096, 28672, 4096)]


def per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = w.float().abs().amax(dim=1).clamp_min(1e-12) / 448.0
    return (w.float() / s[:, None]).clamp(-448, 448).to(E4M3), s


def operands(m: int, n: int, k: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(m * n + k)
    a, a_s = ref_per_token_quant_fp8(torch.randn(m, k, generator=gen))
    b, b_s = per_channel(torch.randn(n, k, generator=gen) * k**-0.5)
    return tuple(t.cuda() for t in (a, a_s, b, b_s))


def cublas(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor) -> torch.Tensor:
    k = a.shape[1]
    n = b.shape[0]
    pk, pn = -k % 16, -n % 16  # cuBLAS fp8 needs K and N multiples of 16
    if pk == 0 and pn == 0:  # no copies inside the timed shapes
        return torch._scaled_mm(a, b.t(), scale_a=a_s.view(-1, 1), scale_b=b_s.view(1, -1),
                                out_dtype=torch.float32)
    a_p = F.pad(a.view(torch.uint8), (0, pk)).view(E4M3)
    b_p = F.pad(b.view(torch.uint8), (0, pk, 0, pn)).view(E4M3)
    b_sp = F.pad(b_s, (0, pn), value=1.0)
    out = torch._scaled_mm(a_p, b_p.t(), scale_a=a_s.view(-1, 1), scale_b=b_sp.view(1, -1),
                           out_dtype=torch.float32)
    return out[:, :n]


def errs(out: torch.Tensor, ref: torch.Tensor) -> str:
    d = (out.double() - ref).abs()
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    return f"rel {rel:.2e} max {d.max().item():.2e}"


def main() -> int:
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    bad = 0
    for m, n, k in ERROR_SHAPES:
        a, a_s, b, b_s = operands(m, n, k)
        ref = (a.double() * a_s.double()[:, None]) @ (b.double() * b_s.double()[:, None]).T
        cells = [f"|ref| max {ref.abs().max().item():.2f}"]
        try:
            cells.append("cuBLAS " + errs(cublas(a, a_s, b, b_s), ref))
        except RuntimeError as e:
            cells.append(f"cuBLAS n/a ({str(e)[:60]})")
        for p in PROMOTES:
            out = fp8_matmul(a, a_s, b, b_s, torch.float32, promote=p)
            rel = ((out.double() - ref).norm() / ref.norm()).item()
            bad += rel > 1e-2 or not torch.isfinite(out).all().item()
            cells.append(f"triton p{p} " + errs(out, ref))
        out16 = fp8_matmul(a, a_s, b, b_s, torch.bfloat16)
        cells.append("triton bf16 out " + errs(out16.float(), ref))
        print(f"| {m}x{n}x{k} | " + " | ".join(cells) + " |", flush=True)
    print("\ntime (us per call, CUDA graph, warm L2), per promotion setting, vs cuBLAS:")
    for m, n, k in TIME_SHAPES:
        ops = operands(m, n, k)
        cells = [f"cuBLAS {graph_ms([lambda ops=ops: cublas(*ops)], 20, 5) * 1e3:.1f}"]
        for p in PROMOTES:
            us = graph_ms([lambda p=p, ops=ops: fp8_matmul(*ops, torch.bfloat16, promote=p)], 20, 5) * 1e3
            cells.append(f"p{p} {us:.1f}")
        print(f"| {m}x{n}x{k} | " + " | ".join(cells) + " |", flush=True)
    print(f"{bad} shape/setting pairs with a bug-sized error (rel > 1e-2 or non-finite)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
