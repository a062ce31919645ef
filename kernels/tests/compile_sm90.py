"""Compile Triton kernels for the H100 (sm_90) on a machine without a GPU: Triton's NVIDIA backend
lowers to PTX and runs its bundled ptxas, so a kernel that has only met the interpreter (which
accepts code the compiler rejects: loop-carried type changes, unsupported ops) is checked before
it meets a GPU. Run by test_sampling.py::test_kernels_compile_for_sm90 in a subprocess (the
interpreter, set by conftest on CPU, replaces @triton.jit functions). Each case: name, kernel,
signature, constexprs, options, attrs, and a check of the compiled kernel (None, or a function
of its TTGIR returning an error, or "" when it is as expected).

    python3 kernels/tests/compile_sm90.py   # prints one line per case; exit 1 on a failure
"""

from __future__ import annotations

import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tokenspeed_kernels.decode_attention import _decode_split_kernel
from tokenspeed_kernels.mla_extend import _mla_extend_kernel, mla_extend_config
from tokenspeed_kernels.sampling import GREEDY_BLOCK, _greedy_logprobs_kernel

H100 = GPUTarget("cuda", 90, 32)
# Integer arguments the launches pass as multiples of 16 (Triton specializes them; without it
# the loads are not vectorised and the compiled kernel is not the one the GPU runs).
DECODE_DIV16 = ("stride_qb", "stride_qh", "stride_kp", "stride_ks", "stride_kh", "stride_vp",
                "stride_vs", "stride_vh", "stride_pt", "stride_ob", "stride_oh", "stride_os",
                "stride_fb", "stride_fh")


def decode_case(kv: str, prefetch: bool, stages: int) -> tuple:
    """paged_decode_attention's split kernel as S1 launches it: Llama-3.1-8B heads (group 4,
    D 128), page 16, bf16 q, fused reduce, one split."""
    names = _decode_split_kernel.arg_names
    sig = {}
    for n in names:
        if n.isupper():
            sig[n] = "constexpr"
        elif n in ("q_ptr", "out_ptr"):
            sig[n] = "*bf16"
        elif n in ("k_ptr", "v_ptr"):
            sig[n] = f"*{kv}"
        elif n in ("part_out_ptr", "part_lse_ptr"):
            sig[n] = "*fp32"
        elif n.endswith("_ptr"):
            sig[n] = "*i32"
        else:
            sig[n] = "fp32" if n in ("qk_scale", "v_scale") else "i32"
    fp8 = kv != "bf16"
    constexprs = {"BLOCK_H": 16, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_N": 64, "PAGE_SIZE": 16,
                  "DOT_PREC": "tf32", "UPCAST": False, "KV_CAST": fp8, "Q_F16": fp8,
                  "FUSED_REDUCE": True, "BLOCK_G": 4, "BLOCK_S": 1, "BLOCK_CS": 1, "PREFETCH": prefetch,
                  "HAS_SINKS": False, "SLIDING": False}
    attrs = {(names.index(n),): [["tt.divisibility", 16]]
             for n in names if n.endswith("_ptr") or n in DECODE_DIV16}
    return (f"decode_split {kv} prefetch={prefetch}", _decode_split_kernel, sig, constexprs,
            {"num_warps": 4, "num_stages": stages}, attrs, double_buffered if prefetch else None)


def double_buffered(ttgir: str) -> str:
    """The K and V tiles' shared-memory copies have two buffers (decode_attention.py, prefetch:
    with one, every tile waits for memory and the fp8 kernel reads ~10% slower on the H100)."""
    depths = re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x64x128x", ttgir)
    if len(depths) >= 2 and all(int(d) >= 2 for d in depths):
        return ""
    return f"K/V tiles not double-buffered: buffer depths {depths} (want >= 2 for K and V)"


def mla_extend_case() -> tuple:
    """mla_extend_attention as the triton backend launches it for DeepSeek-V3 (bf16, latent
    512 + rope 64, page 64) with its default tiles: the dots must run on wgmma."""
    names = _mla_extend_kernel.arg_names
    sig = {n: "constexpr" if n.isupper() else "*bf16" if n in ("q_ptr", "kv_ptr", "out_ptr")
           else "*i32" if n.endswith("_ptr") else "fp32" if n == "qk_scale" else "i32" for n in names}
    block_m, block_h, block_n, warps, stages = mla_extend_config(torch.bfloat16, 512)
    constexprs = {"D_LAT": 512, "D_PE": 64, "BLOCK_DL": 512, "BLOCK_DP": 64, "BLOCK_M": block_m,
                  "BLOCK_H": block_h, "BLOCK_N": block_n, "PAGE_SIZE": 64, "DOT_PREC": "tf32",
                  "UPCAST": False}
    attrs = {(names.index(n),): [["tt.divisibility", 16]]
             for n in names if n.endswith("_ptr") or n.startswith("stride_")}
    return ("mla_extend bf16 512+64", _mla_extend_kernel, sig, constexprs,
            {"num_warps": warps, "num_stages": stages}, attrs,
            lambda ttgir: "" if "warp_group_dot" in ttgir else "no wgmma in the MLA extend kernel")


CASES: list[tuple] = [
    (f"greedy_logprobs {dtype}", _greedy_logprobs_kernel,
     {"logits_ptr": f"*{dtype}", "stride_b": "i64", "vocab": "i32", "tokens_ptr": "*i64",
      "logprobs_ptr": "*fp32", "BLOCK": "constexpr"}, {"BLOCK": GREEDY_BLOCK}, {"num_warps": 16}, {},
     None)
    for dtype in ("bf16", "fp16", "fp32")
] + [decode_case("fp8e4nv", True, 3), decode_case("fp8e5", True, 3), decode_case("bf16", False, 2)] + [mla_extend_case()]


def main() -> int:
    failed = 0
    for name, kernel, signature, constexprs, options, attrs, check in CASES:
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs,
                                                attrs=attrs), target=H100, options=options)  # fmt: skip
            problem = check(compiled.asm["ttgir"]) if check else ""
        except Exception as e:  # noqa: BLE001  (report every case, fail at the end)
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}")
            continue
        if problem:
            failed += 1
            print(f"FAIL {name}: {problem}")
        else:
            print(f"ok   {name}: {len(compiled.asm['cubin'])} bytes of sm_90 cubin")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
