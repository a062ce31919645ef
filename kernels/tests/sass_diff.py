"""Whether a kernel refactor changed the code the H100 runs, without a GPU: compile the main
Triton kernels for sm_90 from the working tree and from a git revision (Triton's bundled ptxas
and nvdisasm), and compare their SASS case by case.

    python3 kernels/tests/sass_diff.py [REV]     # REV defaults to HEAD; exit 1 if any case differs

Per case it prints `same SASS`, `same instructions, other order` (the same multiset of SASS
instructions: a register allocation or scheduling difference), or `DIFFERENT` with the
instruction counts. Splitting a kernel into @triton.jit helpers is inlined back by the compiler,
so such a split should give `same SASS`. A kernel missing at REV is reported and skipped.

Integer arguments are plain i32 unless a case gives their launch values (`ints`): those are
specialized as Triton's JIT does at a launch (1 -> constexpr, a multiple of 16 -> divisible by
16), so a "launch" case compiles the variant the server runs, e.g. the decode kernel at S1's
decode step (num_splits 1 becomes a constexpr there and the fused reduce compiles away).
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = "python/tokenspeed_kernels"


def _cases() -> list[dict]:
    """(module, kernel, pointer dtypes, constexprs, options) for the kernels S1-S3 run, and the
    MoE models' expert GEMM."""
    cases = []
    for fp8, flat in ((False, False), (True, True), (True, False)):
        cases.append({"module": "gemv", "kernel": "_gemv_kernel",
                      "sig": {"w_ptr": "*fp8e4nv" if fp8 else "*bf16", "s_ptr": "*fp32"},
                      "const": {"HAS_BIAS": False, "W_FP8": fp8, "BLOCK_M": 1 if flat else 16, "BLOCK_N": 8,
                                "BLOCK_K": 512, "USE_DOT": not flat, "DOT_PREC": "ieee", "UPCAST": False,
                                "REDUCE_ONCE": False, "PDL": flat, "FLAT": flat}})
    for quant in (False, True):
        kc = "*fp8e4nv" if quant else "*bf16"
        cases.append({"module": "rotary_kv", "kernel": "_rotary_kv_kernel",
                      "sig": {"pos_ptr": "*i64", "cache_ptr": "*fp32", "slot_ptr": "*i64", "k_cache_ptr": kc,
                              "v_cache_ptr": kc, "inv_k_scale": "fp32", "inv_v_scale": "fp32"},
                      "const": {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "HALF": 64, "BLOCK_R": 64, "BLOCK_H": 32,
                                "BLOCK_KH": 8, "BLOCK_D": 128, "BLOCK_TAIL": 0, "IS_NEOX": True,
                                "ROTATE_K": False, "QUANT": quant, "FP8_MAX": 448.0, "MANT": 3, "BIAS": 7}})
    for kv in ("bf16", "fp8e4nv"):
        fp8 = kv != "bf16"
        ptrs = {"q_ptr": "*bf16", "out_ptr": "*bf16", "k_ptr": f"*{kv}", "v_ptr": f"*{kv}",
                "qk_scale": "fp32", "v_scale": "fp32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
        cases.append({"module": "decode_attention", "kernel": "_decode_split_kernel", "ptr": "*i32", "sig": ptrs,
                      "const": {"BLOCK_H": 16, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_N": 64, "PAGE_SIZE": 16,
                                "DOT_PREC": "tf32", "UPCAST": False, "KV_CAST": fp8, "Q_F16": fp8,
                                "FUSED_REDUCE": True, "BLOCK_G": 4, "BLOCK_S": 1, "BLOCK_CS": 1,
                                "PREFETCH": fp8, "HAS_SINKS": False, "SLIDING": False},
                      "opts": {"num_warps": 4, "num_stages": 3 if fp8 else 2}})
        cases.append({"module": "extend_attention", "kernel": "_extend_kernel", "ptr": "*i32", "sig": ptrs,
                      "const": {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_M": 64, "BLOCK_N": 64, "PAGE_SIZE": 16,
                                "DOT_PREC": "tf32", "UPCAST": False, "KV_CAST": fp8, "TILED": True,
                                "SLIDING": False, "HAS_SINKS": False},
                      "opts": {"num_warps": 4, "num_stages": 2}})
    for kv in ("bf16", "fp8e4nv"):  # the decode kernel as S1's step launches it (_decode_launch)
        cases.append(_decode_launch(kv))
    for gated in (True, False):  # the MoE models' experts (bf16), gate/up then down
        cases.append({"module": "moe", "kernel": "_moe_gemm_kernel", "ptr": "*i32",
                      "sig": {"a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "as_ptr": "*fp32",
                              "ws_ptr": "*fp32"},
                      "const": {"GATED": gated, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64,
                                "DOT_PREC": "tf32", "UPCAST": False, "SCALED": False, "SCALE_N": 1,
                                "HAS_BIAS": False, "ACT": 0},
                      "opts": {"num_warps": 8, "num_stages": 3}})
    return cases


def _decode_launch(kv: str, batch: int = 820, num_sms: int = 132) -> dict:
    """paged_decode_attention's split kernel with the arguments the triton backend passes at S1's
    decode step on an H200: `batch` requests of ~1.5k tokens, Llama-3.1-8B heads (32 q / 8 kv,
    D 128), 16-token pages, fused reduce, no sinks / window. num_splits is
    default_num_splits(batch, 8, ctx): cdiv(3 * 132 SMs, 820 * 8) = 1."""
    fp8 = kv != "bf16"
    hq, hkv, d, page, splits = 32, 8, 128, 16, -(-3 * num_sms // (batch * 8))
    ints = {  # q [T, 32, 128] rows of the step, k/v cache [pages, 16, 8, 128], page table
        "stride_qb": hq * d, "stride_qh": d, "stride_kp": page * hkv * d, "stride_ks": hkv * d,
        "stride_kh": d, "stride_vp": page * hkv * d, "stride_vs": hkv * d, "stride_vh": d,
        "stride_pt": 8192,  # max_context_len 131072 / 16
        "stride_ob": hq * splits * d, "stride_oh": splits * d, "stride_os": d,
        "stride_lb": hq * splits, "stride_lh": splits, "stride_fb": hq * d, "stride_fh": d,
        "num_splits": splits, "group": hq // hkv, "window": 0,
    }
    block_s = 1 << (splits - 1).bit_length()
    return {"module": "decode_attention", "kernel": "_decode_split_kernel", "ptr": "*i32", "ints": ints,
            "label": f"launch {batch}x1.5k",
            "sig": {"q_ptr": "*bf16", "out_ptr": "*bf16", "k_ptr": f"*{kv}", "v_ptr": f"*{kv}",
                    "qk_scale": "fp32", "v_scale": "fp32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
                    "sinks_ptr": "*bf16"},
            "const": {"BLOCK_H": 16, "HEAD_DIM": d, "BLOCK_D": d, "BLOCK_N": 64, "PAGE_SIZE": page,
                      "DOT_PREC": "tf32", "UPCAST": False, "KV_CAST": fp8, "Q_F16": fp8, "FUSED_REDUCE": True,
                      "BLOCK_G": 4, "BLOCK_S": block_s, "BLOCK_CS": min(block_s, 16384 // (4 * d)),
                      "PREFETCH": fp8, "HAS_SINKS": False, "SLIDING": False},
            "opts": {"num_warps": 4, "num_stages": 3 if fp8 else 2}}


def _specialized(c: dict, kernel) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of case `c`'s @triton.jit `kernel`; a launch value
    in c["ints"] is specialized as the JIT does (triton.runtime.jit: native_specialize_impl)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    names = kernel.arg_names
    const = {k: v for k, v in c["const"].items() if k in names}  # REV may predate some
    # A constexpr left out would compile as a runtime i32 (its branches kept): a case to update.
    missing = [p.name for p in kernel.params if p.is_constexpr and p.name not in const]
    if missing:
        raise SystemExit(f"sass_diff: {c['kernel']}: give the constexprs {missing} in its case")
    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in c.get("ints", {}):
            ty, key = native_specialize_impl(CUDABackend, c["ints"][n], False, True, True)
            if ty == "constexpr":
                const[n] = key
            elif key == "D":
                attrs[(i,)] = [["tt.divisibility", 16]]
            sig[n] = ty
        else:
            sig[n] = c["sig"].get(n, "constexpr" if n in const else
                                  (c.get("ptr", "*bf16") if n.endswith("_ptr") else "i32"))
            if n.endswith("_ptr"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, const, attrs


def _compile(root: str) -> None:
    """Child process: print the SASS of every case compiled from `root`'s tokenspeed_kernels."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sys.path.insert(0, root)
    nvdisasm = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
    out = []
    for c in _cases():
        kernel = getattr(importlib.import_module(f"tokenspeed_kernels.{c['module']}"), c["kernel"], None)
        if kernel is None:
            out.append(None)
            continue
        sig, const, attrs = _specialized(c, kernel)
        src = ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=c.get("opts", {"num_warps": 4}))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
        out.append([m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]+\*/\s*(.*?);", sass)])
    print(json.dumps(out))


def _sass_of(root: str) -> list[list[str] | None]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__, "--compile", root], capture_output=True, text=True,
                          env=env, check=True)
    return json.loads(done.stdout)


def _opcodes(sass: list[str]) -> collections.Counter:
    return collections.Counter(line.split()[1] if line.startswith("@") else line.split()[0] for line in sass)


def main(rev: str) -> int:
    with tempfile.TemporaryDirectory() as old:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, PKG], capture_output=True, check=True)
        with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
            tar.extractall(old, filter="data")
        before = _sass_of(str(Path(old) / "python"))
    after = _sass_of(str(ROOT / "python"))
    different = 0
    for c, a, b in zip(_cases(), before, after, strict=True):
        weights = c["sig"].get("k_ptr") or c["sig"].get("w_ptr") or c["sig"].get("k_cache_ptr")
        name = f"{c['kernel']} ({weights.lstrip('*')}{', ' + c['label'] if 'label' in c else ''})"
        if a is None or b is None:
            verdict = f"missing at {rev}" if a is None else "missing in the working tree"
        elif a == b:
            verdict = "same SASS"
        elif _opcodes(a) == _opcodes(b):
            verdict = "same instructions, other order"
        else:
            different += 1
            verdict = f"DIFFERENT ({len(a)} instructions at {rev}, {len(b)} now)"
        print(f"{name:50s} {verdict}")
    return 1 if different else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compile"]:
        _compile(sys.argv[2])
    else:
        sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "HEAD"))
