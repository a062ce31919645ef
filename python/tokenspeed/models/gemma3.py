"""Gemma 3 text (Gemma3ForCausalLM: gemma-3-1b, and the text tower's shapes of 4b/12b/27b).

Against Llama: local sliding-window layers interleaved with global ones (`layer_types`), each
kind with its own rope (local: `rope_parameters["sliding_attention"]`, theta 10k); per-head q/k
RMSNorm; every RMSNorm scales by (1 + weight) in float32; four norms per layer (before and
after attention and MLP); embeddings scaled by sqrt(hidden); GELU-tanh MLP; attention scaled
by query_pre_attn_scalar ** -0.5; logits soft-capped (tanh) when `final_logit_softcapping`."""

from __future__ import annotations

import torch
from torch import nn

from tokenspeed.distributed.groups import ParallelState
from tokenspeed.layers.activation import GeluTanhAndMul
from tokenspeed.layers.attention import Attention, ForwardBatch
from tokenspeed.layers.embedding import VocabEmbedding
from tokenspeed.layers.linear import GateUpLinear, QKVLinear, RowLinear
from tokenspeed.layers.norm import GemmaRMSNorm
from tokenspeed.layers.rotary import Rope, RotaryEmbedding
from tokenspeed.models.config import ModelConfig, local_heads
from tokenspeed.models.llama import LlamaForCausalLM


class Gemma3MLP(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelState) -> None:
        super().__init__()
        if config.hidden_act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise NotImplementedError(f"Gemma 3 hidden_activation {config.hidden_act!r}")
        tp = parallel.dense_tp
        self.gate_up_proj = GateUpLinear(config.hidden_size, config.intermediate_size,
                                         tp_rank=tp.rank, tp_size=tp.size)
        self.act = GeluTanhAndMul()
        self.down_proj = RowLinear(config.intermediate_size, config.hidden_size, tp_rank=tp.rank,
                                   tp_size=tp.size, group="dense_tp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Gemma3Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                 parallel: ParallelState) -> None:
        super().__init__()
        c = config
        if c.raw.get("attn_logit_softcapping") is not None:
            raise NotImplementedError("attention logit soft-capping (attn_logit_softcapping) is "
                                      "not supported yet")
        tp = parallel.attn_tp
        self.num_heads, self.num_kv_heads = local_heads(c, tp.size)
        self.head_dim = c.head_dim
        self.qkv_proj = QKVLinear(c.hidden_size, c.head_dim, c.num_attention_heads,
                                  c.num_key_value_heads, bias=c.attention_bias,
                                  tp_rank=tp.rank, tp_size=tp.size)
        self.o_proj = RowLinear(c.q_size, c.hidden_size, bias=c.attention_bias, tp_rank=tp.rank,
                                tp_size=tp.size, group="attn_tp")
        self.q_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps)
        self.rotary = [rotary]
        scalar = float(c.raw.get("query_pre_attn_scalar") or c.head_dim)
        self.attn = Attention(layer_id, self.num_heads, self.num_kv_heads, c.head_dim,
                              scaling=scalar ** -0.5, sliding_window=c.sliding_windows[layer_id])

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, batch, rope=Rope(self.rotary[0], positions)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                 parallel: ParallelState) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = Gemma3Attention(config, layer_id, rotary, parallel)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = Gemma3MLP(config, parallel)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        x = x + self.post_attention_layernorm(
            self.self_attn(positions, self.input_layernorm(x), batch))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, parallel: ParallelState) -> None:
        super().__init__()
        tp = parallel.attn_tp
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp.rank, tp.size)
        self.normalizer = config.hidden_size ** 0.5
        self.rotary_emb = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta,
                                          config.rope_scaling, config.rotary_dim,
                                          config.max_position_embeddings)
        local_theta, local_scaling = config.sliding_rope or (config.rope_theta, config.rope_scaling)
        self.rotary_emb_local = RotaryEmbedding(config.head_dim, max_positions, local_theta,
                                                local_scaling, config.rotary_dim,
                                                config.max_position_embeddings)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, self.rotary_emb if config.sliding_windows[i] is None
                               else self.rotary_emb_local, parallel)
            for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # HF multiplies by the normalizer cast to the weights' dtype (sqrt(hidden) rounded in bf16);
        # a host scalar, so no host-to-device copy lands in a CUDA graph's capture.
        x = x * torch.tensor(self.normalizer, dtype=x.dtype).item()
        for layer in self.layers:
            x = layer(positions, x, batch)
        return self.norm(x)


# A multimodal checkpoint's (Gemma3ForConditionalGeneration, served as its text tower) tensor
# names: the tower's under these prefixes, as transformers >= 4.52 saves them and as Google
# published them; the vision tower and projector are not read.
_TOWER_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                   ("language_model.lm_head.", "lm_head."))
_NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
             "model.multi_modal_projector.")


class Gemma3ForCausalLM(LlamaForCausalLM):
    def make_model(self, max_positions: int) -> nn.Module:
        return Gemma3Model(self.config, max_positions, self.parallel)

    def load_tensor(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter],
                    modules: dict[str, nn.Module]) -> str | None:
        if name.startswith(_NOT_TEXT):
            return None
        for prefix, ours in _TOWER_PREFIXES:
            if name.startswith(prefix):
                name = ours + name[len(prefix):]
                break
        return super().load_tensor(name, tensor, params, modules)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.raw.get("final_logit_softcapping")
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
