"""LoRA on the GPU (run on the device machine): a batch mixing two adapters and the base model
gives the CPU path's logits (the torch reference, itself checked against HF PEFT in
test_lora_runner.py) through the eager segment kernels (SGMV) and through the decode and
extend CUDA graphs (per-token kernels reading the slot buffer written before each replay: one
GEMM over the stacked [W; A_0; A_1] and the merge kernel per projection). Decode steps with no
adapter row replay the graphs captured without LoRA. fp32, so the kernels must agree to
rounding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tokenspeed.worker.model_runner import ModelRunner
from tokenspeed.worker.offline_scheduler import OfflineScheduler

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[(11 * i + 7 * j) % 250 + 3 for j in range(n)] for i, n in enumerate([13, 6, 21, 9])]
NEW = 12
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tiny(root: Path) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      torch_dtype="float32")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2 if "norm" in name else 0.08)
    model.save_pretrained(root / "tiny")
    return str(root / "tiny")


def _adapter(root: Path, name: str, seed: int, rank: int, modules: list[str]) -> str:
    h, inter, q, kv = 128, 192, 128, 64
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for m in modules:
            fin, fout = shapes[m]
            part = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fin, generator=g) * 0.2
            tensors[f"{key}.lora_B.weight"] = torch.randn(fout, rank, generator=g) * 0.2
    d = root / name
    d.mkdir()
    save_file(tensors, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": modules}))
    return str(d)


def _run(path: str, adapters: list[str], runs: list[int], device: str, teacher=None, **kw):
    lora = {"targets": ALL, "max_rank": 16, "pool_slots": 2, "max_loaded": None, "eviction": "lru"}
    # A fixed small pool: the profiled default would take most of the GPU, and the test
    # builds two CUDA runners in one process.
    runner = ModelRunner(path, device=device, dtype="float32", page_size=4, num_pages=512,
                         max_slots=8, max_context_len=128, lora=lora, **kw)
    sampling = {"lora_id": [r for r in runs],
                "lora_path": [list(adapters[r - 1].encode()) if r else [] for r in runs]}
    res = OfflineScheduler(runner).generate(PROMPTS, NEW, chunk_size=8, keep_logits=True,
                                            teacher=teacher, sampling=sampling)
    return res.tokens, [torch.stack([x.float().cpu() for x in lg]) for lg in res.logits], runner


def test_kernels_in_eager_steps_and_cuda_graphs_match_the_reference(tmp_path: Path) -> None:
    path = _tiny(tmp_path)
    adapters = [_adapter(tmp_path, "a", 1, 16, ALL), _adapter(tmp_path, "b", 2, 4, ["q_proj", "v_proj"])]
    runs = [1, 0, 2, 1]  # adapter 1 twice (one pool slot), the base model, adapter 2
    ref_tokens, ref_logits, _ = _run(path, adapters, runs, "cpu")
    for kw in ({"disable_cuda_graph": True}, {"extend_graph_sizes": [16, 32, 64]}):
        tokens, logits, runner = _run(path, adapters, runs, "cuda", teacher=ref_tokens, **kw)
        if "extend_graph_sizes" in kw:
            assert runner.graphs is not None and runner.extend_graphs is not None
            assert runner.graphs.replays > 0 and runner.graphs.plain_replays == 0
            assert all(layer.lora.stacked is not None for layer in runner.lora.layers.values())
        for i, (got, want) in enumerate(zip(logits, ref_logits)):
            err = (got - want).abs().max().item()
            assert err < 2e-3, (kw, i, err)
        assert tokens == ref_tokens, kw


def test_base_only_decode_replays_the_graphs_without_lora(tmp_path: Path) -> None:
    """A LoRA server's steps without an adapter row: the plain decode graphs, base logits."""
    path = _tiny(tmp_path)
    adapters = [_adapter(tmp_path, "a", 1, 16, ALL)]
    runs = [0, 0, 0, 0]
    ref_tokens, ref_logits, _ = _run(path, adapters, runs, "cpu")
    tokens, logits, runner = _run(path, adapters, runs, "cuda", teacher=ref_tokens,
                                  extend_graph_sizes=[16, 32, 64])
    assert runner.graphs is not None and runner.graphs.plain_replays == runner.graphs.replays > 0
    for i, (got, want) in enumerate(zip(logits, ref_logits)):
        assert (got - want).abs().max().item() < 2e-3, i
    assert tokens == ref_tokens
