"""An EAGLE-3 draft head in the public checkpoint layout (SafeAILab/EAGLE, SGLang, vLLM).

The head is one decoder layer over the target's own hidden states. For position `p` it takes
the target's residual stream at the inputs of three target layers (by default layers 2,
N // 2 and N - 3, i.e. the outputs of layers 1, N // 2 - 1 and N - 4), concatenated (3 x the
target's hidden size) and fused by `fc` into one hidden-wide vector, plus the embedding of the
token at `p + 1` (the target's embedding unless the head ships `embed_tokens`). The layer's
attention input is `[input_layernorm(embedding) ; hidden_norm(fused)]`, so q/k/v read 2 x
hidden; its residual is the fused vector. Its output (before `norm`) predicts the token at
`p + 2` through `norm` and the head's own `lm_head` over a reduced draft vocabulary, mapped
back by `d2t` (target id = draft id + d2t[draft id]); chained drafting feeds that output back
as the next position's hidden state (hidden-wide already: no `fc`).

Checkpoint tensors: `fc.weight` [hidden, 3 * target_hidden] (`fc.bias` with `bias: true`),
`midlayer.self_attn.{q,k,v}_proj.weight` [*, 2 * hidden], `midlayer.self_attn.o_proj.weight`,
`midlayer.mlp.{gate,up,down}_proj.weight`, `midlayer.{hidden_norm,input_layernorm,
post_attention_layernorm}.weight`, `norm.weight`, `lm_head.weight` [draft_vocab, hidden],
`d2t` [draft_vocab] (`t2d`, the inverse as a mask, is not needed), optionally
`embed_tokens.weight`. A `model.` prefix on the names is accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenspeed.layers.attention import Attention, ForwardBatch
from tokenspeed.layers.norm import RMSNorm
from tokenspeed.layers.rotary import RotaryEmbedding
from tokenspeed.models.config import _rope
from tokenspeed.models.weights import init_dummy_weights

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# The decoder layer's checkpoint prefixes; our parameters sit flat on the head.
_PREFIXES = ("midlayer.self_attn.", "midlayer.mlp.", "midlayer.")


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    target_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    vocab_size: int
    draft_vocab_size: int
    fc_bias: bool
    max_position_embeddings: int
    aux_layer_ids: tuple[int, ...] | None  # target layers whose *outputs* feed fc (None: default)

    @staticmethod
    def load(path: str | Path) -> Eagle3Config:
        raw = json.loads((Path(path) / "config.json").read_text())
        arch = (raw.get("architectures") or ["?"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"{path}: architecture {arch!r} is not an EAGLE-3 head "
                             f"({', '.join(ARCHITECTURES)})")
        if int(raw.get("num_hidden_layers", 1)) != 1:
            raise ValueError(f"{path}: not supported yet: EAGLE-3 heads of "
                             f"{raw['num_hidden_layers']} layers (only 1)")
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        theta, scaling = _rope(raw)  # either transformers spelling, as the target's
        return Eagle3Config(
            hidden_size=hidden, target_hidden_size=int(raw.get("target_hidden_size") or hidden),
            num_heads=heads, num_kv_heads=int(raw.get("num_key_value_heads", heads)),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=scaling or None,
            vocab_size=int(raw["vocab_size"]),
            draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
            fc_bias=bool(raw.get("bias", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            aux_layer_ids=tuple(int(i) for i in ids) if ids else None)

    def capture_layers(self, target_layers: int) -> tuple[int, ...]:
        """Target layers whose *input* residual stream is captured (SGLang's and vLLM's
        default: 2, N // 2, N - 3; a config's layer ids name outputs, hence + 1)."""
        if self.aux_layer_ids is not None:
            return tuple(i + 1 for i in self.aux_layer_ids)
        return (2, target_layers // 2, target_layers - 3)


def read_head_tensors(path: str | Path) -> dict[str, torch.Tensor] | None:
    """The head's tensors (*.safetensors, else pytorch_model.bin); None: the directory has
    only a config (a dummy head)."""
    root = Path(path)
    files = sorted(root.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(str(f)))
        return out
    if (root / "pytorch_model.bin").exists():
        return torch.load(root / "pytorch_model.bin", map_location="cpu", weights_only=True)
    return None


def load_eagle3_head(target: nn.Module, path: str, *, dtype: torch.dtype, device: torch.device,
                     max_positions: int, dummy: bool, seed: int) -> Eagle3Head:
    """The head at `path` for `target` (its embedding unless the head ships one); a config
    alone draws seeded random weights with `dummy`."""
    cfg = Eagle3Config.load(path)
    with torch.device(device):
        head = Eagle3Head(cfg, max_positions)
    tensors = read_head_tensors(path)
    if tensors is None:
        if not dummy:
            raise ValueError(f"--speculative-draft-model-path {path}: no *.safetensors or "
                             "pytorch_model.bin (a config alone needs --load-format dummy)")
        init_dummy_weights(head, seed + 1)
    else:
        head.load(tensors)
    for name, module in head.named_children():
        if name != "rotary":  # RoPE tables stay float32
            module.to(dtype)
    head.target_embed = [target.model.embed_tokens]
    return head.eval().requires_grad_(False)


class Eagle3Head(nn.Module):
    """The head's weights and its forward; attention through the caller's batch (the
    configured attention backend over a KV layer beside the target's pages,
    worker/draft_chain.py)."""

    def __init__(self, cfg: Eagle3Config, max_positions: int) -> None:
        super().__init__()
        self.cfg = c = cfg
        h, d = c.hidden_size, c.head_dim
        self.capture_width = 3 * c.target_hidden_size
        self.attn = Attention(0, c.num_heads, c.num_kv_heads, d, d ** -0.5)
        self.target_embed: list[nn.Module] = []  # the target's embedding (not a submodule)
        self.fc = nn.Linear(3 * c.target_hidden_size, h, bias=c.fc_bias)
        self.q_proj = nn.Linear(2 * h, c.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, c.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, c.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_heads * d, h, bias=False)
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.norm = RMSNorm(h, c.rms_norm_eps)
        self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False)
        self.embed_tokens: nn.Embedding | None = None  # the target's unless the head has one
        self.d2t: torch.Tensor
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.rotary = RotaryEmbedding(d, max_positions, c.rope_theta, c.rope_scaling,
                                      max_position_embeddings=c.max_position_embeddings)


    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Fills the parameters from the checkpoint's tensors; every parameter must be there."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, t in tensors.items():
            name = name.removeprefix("model.")
            if name == "t2d":
                continue
            if name == "d2t":
                if t.shape != self.d2t.shape:
                    raise ValueError(f"d2t shape {tuple(t.shape)} != ({self.cfg.draft_vocab_size},)")
                self.d2t.copy_(t.to(torch.int64))
                continue
            if name == "embed_tokens.weight":
                self.embed_tokens = nn.Embedding(*t.shape).to(self.fc.weight.device)
                params[name] = self.embed_tokens.weight
            for prefix in _PREFIXES:  # midlayer.self_attn.q_proj.weight → q_proj.weight
                if name.startswith(prefix):
                    name = name[len(prefix):]
                    break
            if name not in params:
                raise KeyError(f"EAGLE-3 head tensor {name!r} has no parameter")
            if params[name].shape != t.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != "
                                 f"{tuple(params[name].shape)}")
            with torch.no_grad():
                params[name].copy_(t)
            loaded.add(name)
        missing = sorted(set(params) - loaded - {"embed_tokens.weight"})
        if missing:
            raise KeyError(f"EAGLE-3 head: tensors missing from the checkpoint: {missing[:6]}")

    @property
    def kv_layout(self) -> dict:
        """The head cache's geometry (its one layer's K and V heads)."""
        c = self.cfg
        return {"num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim, "v_from_k": None,
                "num_heads": c.num_heads}

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def capture_layers(self, target_layers: int) -> tuple[int, ...]:
        return self.cfg.capture_layers(target_layers)

    def from_target(self, captured: torch.Tensor) -> torch.Tensor:
        """The fused hidden state of rows from the target's captured states."""
        return self.fc(captured)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.embed_tokens if self.embed_tokens is not None else self.target_embed[0]
        return e(ids)

    def layer(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              batch: ForwardBatch) -> torch.Tensor:
        """The layer's output (before `norm`) of rows whose fused hidden state is `hidden` and
        next token `ids`."""
        q, k, v = self.qkv(self.embed(ids), hidden, positions)
        return self.finish(self.attn(q, k, v, batch), hidden)

    def describe(self) -> str:
        return f"EAGLE-3 head, draft vocabulary {self.cfg.draft_vocab_size}"

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, Hk, D] (RoPE applied) of rows whose fused hidden state is
        `hidden` (hidden-wide) and next-token embedding `embeds`."""
        c = self.cfg
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        q = self.q_proj(x).view(-1, c.num_heads, c.head_dim)
        k = self.k_proj(x).view(-1, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(-1, c.num_kv_heads, c.head_dim)
        q, k = self.rotary(positions, q.contiguous(), k.contiguous())
        return q, k, v

    def finish(self, attn: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's output before `norm` (what chained drafting feeds back), from the
        attention output [T, H * D] and the rows' fused hidden state (the residual)."""
        residual = self.o_proj(attn) + hidden
        h = self.post_attention_layernorm(residual)
        h = self.down_proj(torch.nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))
        return h + residual

    def draft_ids(self, out: torch.Tensor) -> torch.Tensor:
        """Greedy drafts, as target token ids, from layer outputs [T, hidden]."""
        best = self.lm_head(self.norm(out)).argmax(dim=-1)
        return best + self.d2t[best]

