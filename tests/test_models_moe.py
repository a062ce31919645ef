"""MoE models (Qwen3-MoE, Mixtral) through the ModelRunner vs HF transformers, fp32 CPU: greedy
tokens and logits with both MoE backends (triton under the interpreter), GGUF loading, and the
expert/MoE-tensor-parallel split: simulated ranks' partial outputs sum to the one-rank output."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from test_models_numerics import TINY_NEW_TOKENS, TINY_PROMPTS, assert_matches_hf, hf_greedy, randomize
from test_models_weights import llama_cpp_permute
from transformers import AutoModelForCausalLM, MixtralConfig, PretrainedConfig, Qwen3MoeConfig

from tokenspeed.model_runner import ModelRunner
from tokenspeed.models.offline import OfflineScheduler

_BASE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}

TINY_MOE_CONFIGS: dict[str, PretrainedConfig] = {
    # 3 layers: layer 1 is dense (mlp_only_layers), so dense and sparse layers mix.
    "qwen3_moe_norm_topk": Qwen3MoeConfig(**_BASE, head_dim=32, num_experts=16, num_experts_per_tok=4,
                                          moe_intermediate_size=32, norm_topk_prob=True,
                                          mlp_only_layers=[1]),
    # decoder_sparse_step 2: only layer 1 is sparse; unnormalised top-k weights.
    "qwen3_moe_sparse_step": Qwen3MoeConfig(**_BASE, num_experts=8, num_experts_per_tok=2,
                                            moe_intermediate_size=48, norm_topk_prob=False,
                                            decoder_sparse_step=2),
    "mixtral": MixtralConfig(**_BASE, num_local_experts=8, num_experts_per_tok=2),
}


@pytest.fixture(scope="module")
def tiny_moe_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple]:
    """Per config: (checkpoint dir, HF model, HF tokens, HF logits), built on first use."""
    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in cache:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(TINY_MOE_CONFIGS[name]).eval()
            randomize(model, seed=1)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            cache[name] = (str(path), model, *hf_greedy(model, TINY_PROMPTS, TINY_NEW_TOKENS))
        return cache[name]

    return get


# The triton backend runs under the Triton interpreter here (~0.3 s per MoE layer call): one config
# through the runner; kernels/tests/test_moe.py covers its shapes, test_moe_layer_* below the layer.
CASES = [(name, "torch_native") for name in TINY_MOE_CONFIGS] + [("qwen3_moe_sparse_step", "triton")]


@pytest.mark.parametrize(("name", "backend"), CASES)
def test_tiny_moe_greedy_matches_hf(tiny_moe_models: Callable[[str], tuple], name: str,
                                    backend: str) -> None:
    path, _, ref_tokens, ref_logits = tiny_moe_models(name)
    runner = ModelRunner(path, page_size=16, max_slots=8, max_context_len=128, seed=0,
                         moe_backend=backend)
    assert runner.config.num_experts == TINY_MOE_CONFIGS[name].num_local_experts
    assert_matches_hf(runner, TINY_PROMPTS, ref_tokens, ref_logits, chunk_size=8)


# --- GGUF ------------------------------------------------------------------------------------

def write_gguf(hf: torch.nn.Module, path: Path, arch: str) -> None:
    """A float32 GGUF of `hf` laid out as llama.cpp's convert_hf_to_gguf.py writes MoE models:
    experts stacked per layer ([E, I, H], down [E, H, I]); `llama` (Mixtral) q/k rows permuted."""
    import gguf

    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        for hf_name, gguf_name in names.items():
            if pre + hf_name + ".weight" not in sd:
                continue
            t = sd[pre + hf_name + ".weight"]
            if arch == "llama" and hf_name in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = c.num_attention_heads if "q_proj" in hf_name else c.num_key_value_heads
                t = llama_cpp_permute(t, heads)
            w.add_tensor(f"blk.{i}.{gguf_name}.weight", t)
        gate_up, down = sd[pre + "mlp.experts.gate_up_proj"], sd[pre + "mlp.experts.down_proj"]
        inter = gate_up.shape[1] // 2
        w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gate_up[:, :inter]))
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(gate_up[:, inter:]))
        w.add_tensor(f"blk.{i}.ffn_down_exps.weight", down)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


GGUF_CONFIGS = {
    # llama.cpp's qwen3moe: every layer sparse, top-k weights renormalised.
    "qwen3moe": Qwen3MoeConfig(**{**_BASE, "num_hidden_layers": 2}, num_experts=8, num_experts_per_tok=2,
                               moe_intermediate_size=32, norm_topk_prob=True),
    "llama": MixtralConfig(**{**_BASE, "num_hidden_layers": 2}, num_local_experts=4,
                           num_experts_per_tok=2),
}


@pytest.mark.parametrize("arch", list(GGUF_CONFIGS))
def test_moe_gguf_loads_like_safetensors(tmp_path: Path, arch: str) -> None:
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(GGUF_CONFIGS[arch]).eval()
    randomize(hf, seed=2)
    hf.save_pretrained(tmp_path / "st")
    (tmp_path / "gguf").mkdir()
    write_gguf(hf, tmp_path / "gguf" / "model.gguf", arch)
    prompts, n = TINY_PROMPTS[:3], 6
    kw = {"page_size": 16, "max_slots": 4, "max_context_len": 128}
    st = ModelRunner(str(tmp_path / "st"), **kw)
    gg = ModelRunner(str(tmp_path / "gguf"), **kw)
    assert gg.config.architecture == st.config.architecture
    assert (gg.config.num_experts, gg.config.num_experts_per_tok, gg.config.moe_intermediate_size,
            gg.config.norm_topk_prob) == (st.config.num_experts, st.config.num_experts_per_tok,
                                          st.config.moe_intermediate_size, True)
    ours = dict(gg.model.named_parameters())
    for name, p in st.model.named_parameters():
        torch.testing.assert_close(ours[name], p, rtol=0, atol=0, msg=name)
    a = OfflineScheduler(st).generate(prompts, n, chunk_size=8, keep_logits=True)
    b = OfflineScheduler(gg).generate(prompts, n, chunk_size=8, keep_logits=True)
    assert a.tokens == b.tokens
    if arch == "qwen3moe":  # transformers reads qwen3moe GGUF tensors too: an independent reading of
        # the layout (given the config: it does not map expert_feed_forward_length)
        ref = AutoModelForCausalLM.from_pretrained(tmp_path / "gguf", gguf_file="model.gguf",
                                                   config=hf.config, dtype=torch.float32).eval()
        for name, p in hf.state_dict().items():
            torch.testing.assert_close(ref.state_dict()[name], p, msg=name)
