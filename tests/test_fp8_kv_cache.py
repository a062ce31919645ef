"""FP8 KV cache (--kv-cache-dtype fp8 / fp8_e5m2) through ModelRunner on CPU, against the same model
with an fp32 cache, teacher-forced on the fp32 run's greedy tokens.

Why agreement is high but not exact: e4m3 keeps 3 mantissa bits, so each cached K/V element carries
a relative rounding error of up to 2^-4 (e5m2: 2^-3). The attention scores and outputs move by a
few percent of their spread, and the final logits by a small fraction of theirs: greedy picks stay
the same except where the reference's top two logits are nearly tied. The tests assert exactly
that: high agreement, high logits cosine, and every disagreement a near-tie in the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_models_numerics import TINY_CONFIGS, randomize
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from tokenspeed.layers.kv_cache import PagedKVCache
from tokenspeed.worker.model_runner import ModelRunner
from tokenspeed.worker.offline_scheduler import OfflineScheduler

PROMPTS = [[(13 * i + 5 * j) % 250 + 3 for j in range(n)] for i, n in enumerate([5, 19, 33, 8])]
NEW = 24


def save_tiny_llama(tmp_path_factory: pytest.TempPathFactory, name: str, seed: int,
                    **overrides: object) -> str:
    """A 2-layer Llama (vocab 256, hidden 64) with randomized weights, saved under `name`."""
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      **overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    randomize(model, seed=seed)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_llama(tmp_path_factory, "tiny_llama_fp8", seed=3)


def run(path: str, teacher: list[list[int]] | None = None, prompts: list[list[int]] = PROMPTS,
        **kw: object) -> tuple[list[list[int]], list[torch.Tensor]]:
    runner = ModelRunner(path, page_size=4, max_slots=8, max_context_len=128, **kw)  # type: ignore[arg-type]
    res = OfflineScheduler(runner).generate(prompts, NEW, chunk_size=8, keep_logits=True,
                                            teacher=teacher)
    return res.tokens, [torch.stack(lg) for lg in res.logits]


def compare(ref: tuple[list[list[int]], list[torch.Tensor]],
            got: tuple[list[list[int]], list[torch.Tensor]]) -> tuple[float, float, float]:
    """(greedy agreement, min logits cosine, largest reference top-1 margin where they differ,
    in units of the reference logits' std)."""
    agree, total, worst_margin, min_cos = 0, 0, 0.0, 1.0
    for r_tok, r_lg, g_tok, g_lg in zip(ref[0], ref[1], got[0], got[1]):
        for t in range(len(r_tok)):
            total += 1
            if r_tok[t] == g_tok[t]:
                agree += 1
            else:
                margin = (r_lg[t, r_tok[t]] - r_lg[t, g_tok[t]]) / r_lg[t].std()
                worst_margin = max(worst_margin, float(margin))
        min_cos = min(min_cos, float(torch.nn.functional.cosine_similarity(r_lg, g_lg, dim=-1).min()))
    return agree / total, min_cos, worst_margin


def test_fp8_pool_holds_twice_the_tokens() -> None:
    geometry = {"num_layers": 32, "page_size": 16, "num_kv_heads": 8, "head_dim": 128}
    bf16 = PagedKVCache.bytes_per_page(**geometry, dtype=torch.bfloat16)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert PagedKVCache.bytes_per_page(**geometry, dtype=dtype) * 2 == bf16


@pytest.mark.parametrize(("backend", "kv_dtype", "min_agree", "min_cos"), [
    ("torch_native", "fp8", 0.9, 0.995),
    ("torch_native", "fp8_e5m2", 0.85, 0.99),
    ("triton", "fp8", 0.9, 0.995),  # (e5m2 in the kernels: kernels/tests/test_fp8_kv.py)
])
def test_fp8_kv_cache_tracks_the_fp32_cache(tiny_llama: str, backend: str, kv_dtype: str,
                                            min_agree: float, min_cos: float) -> None:
    prompts = PROMPTS if backend == "torch_native" else PROMPTS[1:3]  # the interpreter is slow
    ref = run(tiny_llama, prompts=prompts, attention_backend=backend)
    got = run(tiny_llama, teacher=ref[0], prompts=prompts, attention_backend=backend,
              kv_cache_dtype=kv_dtype)
    agree, cos, margin = compare(ref, got)
    print(f"{backend} {kv_dtype}: agreement {agree:.3f}, min cosine {cos:.4f}, worst margin {margin:.3f}")
    assert agree >= min_agree and cos >= min_cos
    assert margin < 0.3, "a greedy pick changed where the reference was not near a tie"
    assert got[1][0].shape == ref[1][0].shape


@pytest.mark.parametrize("name", ["qwen2_qkv_bias", "qwen3_qk_norm_head_dim", "llama3_rope_scaling"])
def test_fp8_kv_cache_on_the_tiny_models(tmp_path: Path, name: str) -> None:
    """The other default tiny models (qkv bias, q/k norm with head_dim 32, llama3 RoPE scaling)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[name]).eval()
    randomize(model, seed=1)
    model.save_pretrained(tmp_path)
    ref = run(str(tmp_path))
    got = run(str(tmp_path), teacher=ref[0], kv_cache_dtype="fp8")
    agree, cos, margin = compare(ref, got)
    print(f"{name} fp8 KV: agreement {agree:.3f}, min cosine {cos:.4f}, worst margin {margin:.3f}")
    assert agree >= 0.9 and cos >= 0.995 and margin < 0.3


def _with_kv_scales(src: str, dst: Path, k: float, v: float, spelling: str) -> str:
    """A copy of the checkpoint with per-layer K/V scale tensors (compressed-tensors or ModelOpt
    names)."""
    dst.mkdir()
    for f in Path(src).iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(Path(src) / "model.safetensors"))
    for layer in range(2):
        prefix = f"model.layers.{layer}.self_attn."
        if spelling == "modelopt":
            tensors[prefix + "k_proj.k_scale"] = torch.tensor(k * (layer + 1))
            tensors[prefix + "v_proj.v_scale"] = torch.tensor(v)
        else:
            tensors[prefix + "k_scale"] = torch.tensor([k * (layer + 1)])
            tensors[prefix + "v_scale"] = torch.tensor([v])
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


@pytest.mark.parametrize("spelling", ["compressed_tensors", "modelopt"])
def test_checkpoint_kv_scales_are_used(tiny_llama: str, tmp_path: Path, spelling: str) -> None:
    path = _with_kv_scales(tiny_llama, tmp_path / "ckpt", 0.02, 0.05, spelling)
    runner = ModelRunner(path, page_size=4, max_slots=8, max_context_len=128, kv_cache_dtype="fp8")
    assert runner.kv_cache.k_scale == pytest.approx([0.02, 0.04])
    assert runner.kv_cache.v_scale == pytest.approx([0.05, 0.05])
    ref = run(tiny_llama)
    got = run(path, teacher=ref[0], kv_cache_dtype="fp8")
    assert compare(ref, got)[1] >= 0.995  # dequantised with the scales, not stored raw
    # Without --kv-cache-dtype fp8 the scale tensors are read and ignored.
    assert ModelRunner(path, page_size=4, max_slots=8, max_context_len=128).kv_cache.k_scale == [1.0, 1.0]


def test_quantization_param_path_overrides_the_checkpoint(tiny_llama: str, tmp_path: Path) -> None:
    path = _with_kv_scales(tiny_llama, tmp_path / "ckpt", 0.02, 0.05, "compressed_tensors")
    scales = tmp_path / "kv_cache_scales.json"
    scales.write_text(json.dumps({"model_type": "llama", "kv_cache": {
        "dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": 0.5, "1": {"k": 0.25, "v": 0.125}}}}}))
    runner = ModelRunner(path, page_size=4, max_slots=8, max_context_len=128, kv_cache_dtype="fp8",
                         quantization_param_path=str(scales))
    assert runner.kv_cache.k_scale == [0.5, 0.25] and runner.kv_cache.v_scale == [0.5, 0.125]


@pytest.mark.parametrize(("doc", "error"), [
    ({"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": 1.0}}}}, "layers \\[1\\]"),
    ({"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"1": {"0": 1.0, "1": 1.0}}}}, "rank 0"),
    ({"kv_cache": {"dtype": "int8", "scaling_factor": {"0": {"0": 1.0, "1": 1.0}}}}, "int8"),
    ({"scales": [1.0, 1.0]}, "QuantParamSchema"),
])
def test_bad_quantization_param_files_fail_at_start(tiny_llama: str, tmp_path: Path, doc: dict,
                                                    error: str) -> None:
    scales = tmp_path / "s.json"
    scales.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=error):
        ModelRunner(tiny_llama, page_size=4, max_slots=8, max_context_len=128, kv_cache_dtype="fp8",
                    quantization_param_path=str(scales))


def test_scales_without_an_fp8_cache_fail(tiny_llama: str, tmp_path: Path) -> None:
    scales = tmp_path / "s.json"
    scales.write_text(json.dumps({"kv_cache": {"scaling_factor": {"0": {"0": 1.0, "1": 1.0}}}}))
    with pytest.raises(ValueError, match="needs --kv-cache-dtype fp8"):
        ModelRunner(tiny_llama, page_size=4, max_slots=8, max_context_len=128,
                    quantization_param_path=str(scales))
