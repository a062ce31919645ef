"""FP8 on the GPU (device machine): fp8 KV cache and fp8 weights through ModelRunner on the
4-layer Llama-3.1-8B-shaped dummy model, against the bf16 model with the same weights; CUDA graphs
on vs off; the KV pool the memory profile gives an fp8 cache; FlashInfer's fp8 KV path against
the triton kernels; the FP8 linear's kernels against the dequantised matmul.

The dummy model's logits are flat (top-1 - top-2 gap median ~0.19) and fp8's own rounding moves
them by ~0.14 (KV) / ~0.23 (weights) std, so any fp8 implementation agrees on only ~0.75 / ~0.6 of
its greedy tokens (benches/diagnostics/fp8_numerics_cpu.py). Each kernel variant is therefore
compared with its kernel-free twin, the same fp8 rounding done in torch (torch_native attention over
the fp8 cache; fp8.GEMM_BACKEND = "reference"): error std <= 1.25 x the twin's, agreement >= the
twin's - 0.05, cosine >= 0.95 (benches/diagnostics/fp8_accuracy.py prints the same numbers).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from test_gpu import LLAMA31_8B, NEW_TOKENS, make_runner, prompts_for, teacher_forced, write_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
NEEDS_FLASHINFER = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                                      reason="flashinfer is not installed")


@pytest.fixture(scope="module")
def llama8b_x4(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_config(tmp_path_factory.mktemp("fp8"), "llama8b", LLAMA31_8B, num_hidden_layers=4)


@pytest.fixture(scope="module")
def bf16_reference(llama8b_x4: str) -> tuple[list[list[int]], list[list[int]], torch.Tensor]:
    """(prompts, bf16 greedy tokens, bf16 teacher-forced logits [P, S, V])."""
    from test_gpu import Driver

    runner = make_runner(llama8b_x4, "bfloat16")
    prompts = prompts_for(LLAMA31_8B["vocab_size"])
    tokens = Driver(runner).greedy(prompts, NEW_TOKENS)
    logits = teacher_forced(runner, prompts, tokens)
    del runner
    torch.cuda.empty_cache()
    return prompts, tokens, logits


def vs_bf16(ref: tuple[list[list[int]], list[list[int]], torch.Tensor], runner: object
            ) -> tuple[float, float, float]:
    """(teacher-forced greedy agreement, cosine min, error std) of runner's logits vs bf16's."""
    prompts, tokens, ref_logits = ref
    ours = teacher_forced(runner, prompts, tokens)
    cos = torch.nn.functional.cosine_similarity(ours, ref_logits, dim=-1)
    want = torch.tensor(tokens, device=ours.device)
    agree = (ours.argmax(-1) == want).float().mean().item()
    return agree, cos.min().item(), (ours - ref_logits).std().item()


@pytest.mark.parametrize(("name", "kw"), [
    ("fp8 KV", {"kv_cache_dtype": "fp8"}),
    ("fp8_e5m2 KV", {"kv_cache_dtype": "fp8_e5m2"}),
    ("fp8 weights", {"quantization": "fp8"}),
    ("fp8 weights + fp8 KV", {"quantization": "fp8", "kv_cache_dtype": "fp8"}),
])
def test_fp8_kernels_track_the_torch_fp8_twin(llama8b_x4: str, bf16_reference: tuple, name: str, kw: dict,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenspeed.layers.quantization import fp8

    runner = make_runner(llama8b_x4, "bfloat16", **kw)
    agree, cos, err = vs_bf16(bf16_reference, runner)
    assert runner.graphs is not None and runner.graphs.replays > 0  # type: ignore[attr-defined]
    del runner
    torch.cuda.empty_cache()
    twin_kw = dict(kw)
    if "kv_cache_dtype" in kw:
        twin_kw["attention_backend"] = "torch_native"
    if "quantization" in kw:
        monkeypatch.setattr(fp8, "GEMM_BACKEND", "reference")
    twin = make_runner(llama8b_x4, "bfloat16", graphs=False, **twin_kw)
    t_agree, t_cos, t_err = vs_bf16(bf16_reference, twin)
    del twin
    torch.cuda.empty_cache()
    print(f"\n[{name}] vs bf16: kernels agreement {agree:.3f} cosine min {cos:.4f} error std {err:.4f}; "
          f"torch twin {t_agree:.3f} / {t_cos:.4f} / {t_err:.4f}; error ratio {err / t_err:.2f}")
    assert err <= 1.25 * t_err and agree >= t_agree - 0.05 and cos >= 0.95


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_fp8_linear_tracks_bf16_on_realistic_weights(n: int, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 weights ~ N(0, 0.02) (Llama-3.1-8B's are ~0.01-0.03), activations O(1) (RMS-normed):
    fp8 vs the bf16 linear is e4m3's per-channel rounding, 2.6% relative for weight-only (GEMV
    rows) and 3.7% with per-token activations (measured with reference_linear on the CPU)."""
    from tokenspeed.layers.quantization import fp8

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn(64, k, device="cuda", generator=gen).to(torch.bfloat16)
    q, s = fp8.quantize_per_channel(w)
    for m, tol in ((1, 0.035), (8, 0.035), (64, 0.05)):
        ref = torch.nn.functional.linear(x[:m], w).float()
        for backend in ("cublas", "triton"):
            monkeypatch.setattr(fp8, "GEMM_BACKEND", backend)
            err = ((fp8.fp8_linear(x[:m], q, s).float() - ref).norm() / ref.norm()).item()
            assert 0.005 < err < tol, (m, backend, err)  # > 0.005: it is fp8, not a bf16 fallback


def test_fp8_graphs_on_and_off_give_identical_tokens(llama8b_x4: str) -> None:
    from test_gpu import Driver

    prompts = prompts_for(LLAMA31_8B["vocab_size"], seed=1)
    kw = {"quantization": "fp8", "kv_cache_dtype": "fp8"}
    with_graphs = Driver(make_runner(llama8b_x4, "bfloat16", graphs=True, **kw)).greedy(prompts, NEW_TOKENS)
    torch.cuda.empty_cache()
    eager = Driver(make_runner(llama8b_x4, "bfloat16", graphs=False, **kw)).greedy(prompts, NEW_TOKENS)
    assert with_graphs == eager


def test_fp8_kv_pool_holds_twice_the_pages(llama8b_x4: str) -> None:
    """Same memory budget, half the bytes per page: the profile gives ~2x the pages."""
    from tokenspeed.worker.model_runner import ModelRunner

    free, total = torch.cuda.mem_get_info()
    fraction = 1.0 - (free - 12 * 2**30) / total  # ~8 GiB of KV above the 4-layer weights
    pages = {}
    for kv in ("auto", "fp8"):
        r = ModelRunner(llama8b_x4, dtype="bfloat16", device="cuda", load_format="dummy", page_size=16,
                        max_slots=64, max_context_len=4096, seed=0, mem_fraction_static=fraction,
                        chunked_prefill_size=4096, kv_cache_dtype=kv)
        pages[kv] = r.num_pages
        assert r.kv_cache.k[0].dtype == (torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16)
        del r
        torch.cuda.empty_cache()
    ratio = pages["fp8"] / pages["auto"]
    print(f"\n[kv pool] bf16 {pages['auto']} pages, fp8 {pages['fp8']} pages ({ratio:.2f}x)")
    assert 1.9 <= ratio <= 2.1


@NEEDS_FLASHINFER
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_flashinfer_fp8_kv_matches_triton_fp8_kv(llama8b_x4: str, graphs: bool,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Both attend over the same fp8 cache contents (written by the same kernel, same scales; the
    eager run uses scales other than 1.0): only the attention arithmetic differs, so the logits
    agree closely. (Triton's eager prefill of fresh prompts would read the unquantised K/V of
    the QKV output instead of the cache: kept on the cache here.)"""
    from test_gpu import Driver

    import tokenspeed_kernels

    monkeypatch.setattr(tokenspeed_kernels, "prefill_supported", lambda *a: False)

    prompts = prompts_for(LLAMA31_8B["vocab_size"], seed=4)
    res = {}
    for backend in ("triton", "flashinfer"):
        runner = make_runner(llama8b_x4, "bfloat16", graphs=graphs, attention_backend=backend,
                             kv_cache_dtype="fp8")
        if not graphs:  # eager: scales other than 1.0 (graphs bake the scales in at capture)
            layers = len(runner.kv_cache.k_scale)  # type: ignore[attr-defined]
            runner.kv_cache.k_scale[:] = [0.25] * layers  # type: ignore[attr-defined]
            runner.kv_cache.v_scale[:] = [0.5] * layers  # type: ignore[attr-defined]
        tokens = Driver(runner).greedy(prompts, 8) if backend == "triton" else res["triton"][0]
        res[backend] = (tokens, teacher_forced(runner, prompts, tokens))
        del runner
        torch.cuda.empty_cache()
    cos = torch.nn.functional.cosine_similarity(res["triton"][1], res["flashinfer"][1], dim=-1)
    print(f"\n[flashinfer vs triton, fp8 KV, {'graphs' if graphs else 'eager'}] cosine min {cos.min():.5f}")
    assert cos.min().item() >= 0.999


@pytest.mark.parametrize("m", [1, 8, 9, 300])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (100, 4096), (128256, 4096)])  # 100: not a
# multiple of 16; 128256: the fp8 lm_head (--lm-head-quantization)
def test_fp8_linear_kernels_match_the_dequantised_matmul(m: int, n: int, k: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenspeed.layers.quantization import fp8

    gen = torch.Generator(device="cuda").manual_seed(m + n)
    w, s = fp8.quantize_per_channel(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    ref = x.float() @ (w.float() * s[:, None]).T + bias.float()
    # W8A16 (GEMV, m <= 8) is exact up to bf16 output rounding; W8A8 adds per-token rounding.
    tol = 2e-2 if m <= fp8.SKINNY_MAX_ROWS else 5e-2
    for backend in ("cublas", "triton"):
        monkeypatch.setattr(fp8, "GEMM_BACKEND", backend)
        out = fp8.fp8_linear(x, w, s, bias)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert out.dtype == torch.bfloat16 and err < tol, (backend, err)
    if m > fp8.SKINNY_MAX_ROWS and n % 16 == 0:
        assert fp8._rowwise_ok, "torch._scaled_mm fell back to per-tensor scales on this GPU"


def test_quantise_while_loading_a_safetensors_checkpoint_on_cuda(tmp_path: Path) -> None:
    """Smoke: --quantization fp8 on a real (tiny) bf16 safetensors checkpoint, on CUDA, graphs."""
    from test_gpu import Driver
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
    from tokenspeed.worker.model_runner import ModelRunner

    runner = ModelRunner(str(tmp_path), dtype="bfloat16", device="cuda", page_size=16, max_slots=8,
                         max_context_len=512, num_pages=300, quantization="fp8", kv_cache_dtype="fp8")
    assert runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    out = Driver(runner).greedy(prompts_for(512, lens=[5, 9]), 4)
    assert len(out) == 2 and all(len(o) == 4 for o in out)
