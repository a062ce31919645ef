"""Llama family (Llama 2/3/3.1, Mistral, SmolLM2); also the base of Qwen2 and Qwen3."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import ClassVar

import torch
from torch import nn

from tokenspeed.distributed.groups import ParallelState, state
from tokenspeed.layers.activation import SiluAndMul
from tokenspeed.layers.attention import Attention, ForwardBatch
from tokenspeed.layers.embedding import LMHead, VocabEmbedding
from tokenspeed.layers.linear import GateUpLinear, QKVLinear, RowLinear
from tokenspeed.layers.moe import MoeOptions
from tokenspeed.layers.norm import RMSNorm
from tokenspeed.layers.rotary import Rope, RotaryEmbedding
from tokenspeed.models.config import ModelConfig, local_heads


class LlamaMLP(nn.Module):
    """gate_up column-parallel, down row-parallel over the dense-TP group."""

    def __init__(self, config: ModelConfig, parallel: ParallelState,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {config.hidden_act!r} (only silu)")
        tp = parallel.dense_tp
        inter = intermediate_size or config.intermediate_size  # DeepSeek's shared experts
        self.gate_up_proj = GateUpLinear(config.hidden_size, inter,
                                         bias=config.mlp_bias, tp_rank=tp.rank, tp_size=tp.size)
        self.act = SiluAndMul()
        self.down_proj = RowLinear(inter, config.hidden_size,
                                   bias=config.mlp_bias, tp_rank=tp.rank, tp_size=tp.size,
                                   group="dense_tp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """qkv projection (+ optional per-head q/k RMSNorm, Qwen3) → RoPE → paged attention → o_proj.

    RoPE goes to the attention layer, which lets the backend fuse it with the KV-cache write.
    With TP each rank runs its share of the heads (see QKVLinear for the KV heads)."""

    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                 parallel: ParallelState) -> None:
        super().__init__()
        c = config
        tp = parallel.attn_tp
        self.num_heads, self.num_kv_heads = local_heads(c, tp.size)
        self.head_dim = c.head_dim
        self.qkv_proj = QKVLinear(c.hidden_size, c.head_dim, c.num_attention_heads,
                                  c.num_key_value_heads, bias=c.attention_bias,
                                  tp_rank=tp.rank, tp_size=tp.size)
        self.o_proj = RowLinear(c.q_size, c.hidden_size, bias=False, tp_rank=tp.rank,
                                tp_size=tp.size, group="attn_tp")
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.rotary = [rotary]  # a list so the shared table is not registered once per layer
        self.attn = Attention(layer_id, self.num_heads, self.num_kv_heads, c.head_dim,
                              scaling=c.head_dim ** -0.5,
                              sliding_window=c.sliding_windows[layer_id])

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # before RoPE, as in Qwen3
        return self.o_proj(self.attn(q, k, v, batch, rope=Rope(self.rotary[0], positions)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                 parallel: ParallelState, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_id, rotary, parallel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream kept apart so that add + RMSNorm fuse into one kernel on CUDA:
        returns (mlp output, residual); the layer's output is their sum."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(positions, h, batch)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, parallel: ParallelState,
                 make_mlp: Callable[[int], nn.Module]) -> None:
        super().__init__()
        tp = parallel.attn_tp
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp.rank, tp.size)
        self.rotary_emb = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta,
                                          config.rope_scaling, config.rotary_dim,
                                          config.max_position_embeddings)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.rotary_emb, parallel, make_mlp(i))
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Draft heads (worker/draft_chain.py): the residual stream at these layers' inputs
        # (EAGLE-3), or index num_layers: after the last layer, before the final norm (an MTP
        # layer), concatenated, is kept in `captured` after each forward for the head.
        self.capture_layers: tuple[int, ...] = ()
        self.captured: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        aux = []
        for i, layer in enumerate(self.layers):
            if i in self.capture_layers:  # once per mention (N // 2 == N - 3 when N is 6)
                aux += [x if residual is None else x + residual] * self.capture_layers.count(i)
            x, residual = layer(positions, x, residual, batch)
        if len(self.layers) in self.capture_layers:
            aux += [x if residual is None else x + residual] * self.capture_layers.count(len(self.layers))
        if aux:
            self.captured = torch.cat(aux, dim=-1)
        if residual is None:
            return self.norm(x)
        return self.norm.add_forward(x, residual)[0]


# HF checkpoint name fragment → (our fused parameter fragment, shard index).
STACKED_PARAMS = [
    (".q_proj.", ".qkv_proj.", 0),
    (".k_proj.", ".qkv_proj.", 1),
    (".v_proj.", ".qkv_proj.", 2),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
]


class LlamaForCausalLM(nn.Module):
    # The HF modules fused into one of ours; FP8 checkpoints name the HF ones (fp8_model.py).
    STACKED_PARAMS: ClassVar[list[tuple[str, str, int]]] = STACKED_PARAMS

    def __init__(self, config: ModelConfig, max_positions: int | None = None,
                 moe: MoeOptions | None = None, parallel: ParallelState | None = None) -> None:
        super().__init__()
        self.config = config
        self.moe_options = moe or MoeOptions()  # used by the MoE families' make_mlp
        self.parallel = parallel or state()
        self.parallel.sizes.check_model(config.num_attention_heads, config.num_key_value_heads,
                                        config.intermediate_size)
        tp = self.parallel.attn_tp
        self.model = self.make_model(max_positions or config.max_position_embeddings)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tp.rank, tp.size)
        if config.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states [T, hidden]; `compute_logits` projects the rows that sample."""
        return self.model(input_ids, positions, batch)

    def make_model(self, max_positions: int) -> nn.Module:
        """The decoder stack (`model.*` in the checkpoint); other families build their own."""
        return LlamaModel(self.config, max_positions, self.parallel, self.make_mlp)

    def make_mlp(self, layer_id: int) -> nn.Module:
        """The MLP of layer `layer_id` (dense here; the MoE families return a SparseMoeBlock)."""
        return LlamaMLP(self.config, self.parallel)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, routing q/k/v and gate/up into the fused parameters."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self.load_tensor(name, tensor, params, modules)
            if target is not None:
                loaded.add(target)
        missing = set(params) - loaded
        if missing:
            raise KeyError(f"parameters missing from the checkpoint: {sorted(missing)[:8]}")

    def load_tensor(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter],
                    modules: dict[str, nn.Module]) -> str | None:
        """Load one HF tensor; return the name of the parameter it filled (None: not used)."""
        if "rotary_emb." in name:
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        shard = 0
        for hf, ours, idx in self.STACKED_PARAMS:
            if hf in name:
                name, shard = name.replace(hf, ours), idx
                break
        if name not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no parameter in "
                           f"{type(self).__name__}")
        param = params[name]
        owner = modules[name.rsplit(".", 1)[0]]
        loader = getattr(owner, "weight_loader", None)
        if loader is not None:
            loader(param, tensor, shard)
        else:
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != "
                                 f"parameter shape {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
        return name
