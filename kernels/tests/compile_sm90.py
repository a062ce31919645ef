"""Compile Triton kernels for the H100 (sm_90) on a machine without a GPU: Triton's NVIDIA backend
lowers to PTX and runs its bundled ptxas, so a kernel that has only met the interpreter (which
accepts code the compiler rejects: loop-carried type changes, unsupported ops) is checked before
it meets a GPU. Run by test_compile_sm90.py in a subprocess (the interpreter, set by conftest on
CPU, replaces @triton.jit functions). Each case: name, kernel, signature, constexprs, warps.

    python3 kernels/tests/compile_sm90.py   # prints one line per case; exit 1 on a failure
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tokenspeed_kernels.sampling import GREEDY_BLOCK, _greedy_logprobs_kernel

H100 = GPUTarget("cuda", 90, 32)
CASES = [
    (f"greedy_logprobs {dtype}", _greedy_logprobs_kernel,
     {"logits_ptr": f"*{dtype}", "stride_b": "i64", "vocab": "i32", "tokens_ptr": "*i64",
      "logprobs_ptr": "*fp32", "BLOCK": "constexpr"}, {"BLOCK": GREEDY_BLOCK}, 16)
    for dtype in ("bf16", "fp16", "fp32")
]


def main() -> int:
    failed = 0
    for name, kernel, signature, constexprs, warps in CASES:
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                      target=H100, options={"num_warps": warps})
            print(f"ok   {name}: {len(compiled.asm['cubin'])} bytes of sm_90 cubin")
        except Exception as e:  # noqa: BLE001  (report every case, fail at the end)
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
