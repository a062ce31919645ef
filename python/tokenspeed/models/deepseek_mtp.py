"""DeepSeek-V3's multi-token prediction (MTP) layer as a draft head (`--speculative-algorithm
NEXTN`, vLLM's `deepseek_mtp`).

The checkpoint ships it as one more layer after the decoder stack (`num_nextn_predict_layers`:
1), `model.layers.{num_hidden_layers}.*`: `enorm` and `hnorm` (RMSNorm), `eh_proj` (2 x hidden
→ hidden, no bias), a full DeepSeek decoder layer (MLA attention, and the MLP the target's
config gives a layer of that index: routed experts for V3), `shared_head.norm`,
`shared_head.head` (its own output head) and, in V3's release, a copy of `embed_tokens`. For
position `p` it reads the target's last hidden state at `p` (after its last layer, before the
final norm) and the token at `p + 1`:
`out = layer(eh_proj([enorm(embed(token)) ; hnorm(h)]))`, the residual added, and predicts the
token at `p + 2` by `shared_head.head(shared_head.norm(out))`. A chain feeds `out` back as the
next position's `h` (as vLLM's `deepseek_mtp.py` and the V3 report's depth-k modules do).

The layer's attention is MLA over the latent cache, like the target's (`MlaAttention`, layer 0
of the head's own one-layer cache). `shared_head.head` and `embed_tokens` that equal the
target's are shared with it, not copied (V3's are copies: about 1.8 GB each in bf16). A
separate MTP export (its layer under another index) is found by its `eh_proj` tensor.

On several ranks the decoder layer is sharded as the target's layers (built with the target's
parallel layout, loaded through its loader: MLA heads over the attention TP ranks, experts over
EP / MoE TP; about 11.5B parameters for V3, too many to replicate); the layer's own tensors are
whole on every rank (docs/speculative.md, "NEXTN on several ranks").

An FP8 checkpoint (DeepSeek-V3/R1's block-FP8 release) quantises the MTP layer's decoder layer
as the target's layers: it gets the same preparation (layers/quantization/fp8_model.py, the
checkpoint's ignore list read under the layer's own names) and its `weight` + `weight_scale_inv`
load through the target's loader, kv_b_proj dequantised once loaded, the routed experts fp8
block banks; dummy weights under such a config are block-quantised as the target's. The layer's
own tensors (norms, `eh_proj`, `shared_head`, `embed_tokens`) stay in the model dtype (V3 ships
them unquantised; one shipped FP8 is dequantised). `--quantization fp8` of a bf16 checkpoint
leaves the whole MTP layer in the dtype.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from tokenspeed.layers.attention import ForwardBatch
from tokenspeed.layers.norm import RMSNorm
from tokenspeed.layers.quantization.fp8 import FP8, dequantize
from tokenspeed.layers.quantization.fp8_model import (
    checkpoint_names,
    prepare_fp8_checkpoint,
    quantize_model,
)
from tokenspeed.layers.quantization.kv_cache import split_kv_scales
from tokenspeed.layers.quantization.methods import Fp8Config
from tokenspeed.layers.rotary import RotaryEmbedding
from tokenspeed.models.config import config_from_hf_dict, mtp_layers
from tokenspeed.models.deepseek_v2 import DeepseekMoe, DeepseekV2ForCausalLM, MlaAttention
from tokenspeed.models.llama import LlamaDecoderLayer, LlamaMLP
from tokenspeed.models.weights import (
    default_dtype,
    init_dummy_weights,
    matching_tensor_names,
    read_matching_tensors,
)

_EH_PROJ = re.compile(r"^model\.layers\.(\d+)\.eh_proj\.weight$")
# The MTP layer's own tensors (the rest of `model.layers.N.*` is its decoder layer's).
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")


class DeepseekMtpHead(nn.Module):
    """The MTP layer's weights and forward; attention through the caller's batch (its backend
    over the head's one-layer latent cache, worker/draft_chain.py)."""

    capture_width: int

    def __init__(self, target: DeepseekV2ForCausalLM, max_positions: int, own_head: bool,
                 own_embed: bool, hf_prefix: str) -> None:
        super().__init__()
        c = target.config
        # FP8 preparation (fp8_model.py) as the target's: its fused layers, its matrices.
        self.STACKED_PARAMS = target.STACKED_PARAMS
        self.HIGH_PRECISION_LINEARS = target.HIGH_PRECISION_LINEARS
        self.hf_prefix = hf_prefix  # `model.layers.N.` of the layer in the checkpoint
        n, h, eps = c.num_hidden_layers, c.hidden_size, c.rms_norm_eps
        self.capture_width = h
        self.target_layers = n
        self.enorm, self.hnorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.rotary = RotaryEmbedding(int(c.raw["qk_rope_head_dim"]), max_positions, c.rope_theta,
                                      c.rope_scaling)
        # The MLP of layer n of this model: the config extended by its MTP layer says which.
        moe = config_from_hf_dict({**c.raw, "num_hidden_layers": n + 1}).is_moe_layer(n)
        mlp = DeepseekMoe(c, target.parallel, target) if moe else LlamaMLP(c, target.parallel)
        self.decoder = LlamaDecoderLayer(c, 0, self.rotary, target.parallel, mlp)
        self.decoder.self_attn = MlaAttention(c, 0, self.rotary, target.parallel)  # type: ignore[assignment]
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, eps)
        self.shared_head.head = nn.Linear(h, c.vocab_size, bias=False) if own_head else None
        self.embed_tokens = nn.Embedding(c.vocab_size, h) if own_embed else None
        self._target = [target]  # not a submodule: its weights are the target's

    def hf_module_name(self, name: str) -> str:
        """The checkpoint's name of a module of the head (an FP8 config's ignore list reads it):
        the decoder layer's are the MTP layer's, `model.layers.N.self_attn...`."""
        return self.hf_prefix + name.removeprefix("decoder.")

    @property
    def kv_layout(self) -> dict:
        """The head cache's geometry: one latent "head" per token, V its first kv_lora_rank."""
        attn = self.decoder.self_attn.attn  # type: ignore[union-attr]
        return {"num_kv_heads": 1, "head_dim": attn.head_dim, "v_from_k": attn.v_head_dim,
                "num_heads": attn.num_heads}

    @property
    def dtype(self) -> torch.dtype:
        return self.eh_proj.weight.dtype

    def capture_layers(self, target_layers: int) -> tuple[int, ...]:
        """The stream after the target's last layer (before its final norm)."""
        return (target_layers,)

    def from_target(self, captured: torch.Tensor) -> torch.Tensor:
        return captured

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(ids)
        return self._target[0].model.embed_tokens(ids)

    def layer(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              batch: ForwardBatch) -> torch.Tensor:
        """The layer's output (before `shared_head.norm`) of rows whose previous hidden state is
        `hidden` and next token `ids`."""
        x = self.eh_proj(torch.cat([self.enorm(self.embed(ids)), self.hnorm(hidden)], dim=-1))
        h, residual = self.decoder(positions, x, None, batch)
        return h + residual

    def draft_ids(self, out: torch.Tensor) -> torch.Tensor:
        x = self.shared_head.norm(out)
        head = self.shared_head.head
        logits = head(x) if head is not None else self._target[0].compute_logits(x)
        return logits.argmax(dim=-1)

    def describe(self) -> str:
        return (f"DeepSeek MTP layer (after layer {self.target_layers - 1}), "
                f"{'routed experts' if isinstance(self.decoder.mlp, DeepseekMoe) else 'dense MLP'}")


def find_mtp_prefix(path: str | Path) -> str:
    """`model.layers.K.` of the checkpoint's MTP layer (the one with an `eh_proj`)."""
    found = [int(m[1]) for name in matching_tensor_names(str(path), _EH_PROJ)
             if (m := _EH_PROJ.match(name))]
    if not found:
        raise ValueError(f"--speculative-algorithm NEXTN: no MTP layer in {path} (no "
                         "model.layers.N.eh_proj.weight tensor)")
    return f"model.layers.{min(found)}."


def _checkpoint_fp8(fp8: Fp8Config | None) -> Fp8Config | None:
    """The FP8 setup the MTP layer loads with: an FP8 checkpoint's (the layer is quantised as
    the target's layers; no LM head of its own to quantise), else None (`--quantization fp8` of
    a bf16 checkpoint, or none: the layer stays in the dtype)."""
    if fp8 is None or not fp8.checkpoint_format:
        return None
    return replace(fp8, lm_head=False, checkpoint_lm_head=False)


def _read_layer(path: str, fp8: Fp8Config | None) -> tuple[str, dict[str, torch.Tensor]]:
    """(`model.layers.K.`, the MTP layer's tensors without it), named as the target reads its
    own: static activation / KV scales dropped, `weight_scale_inv` read as `weight_scale`."""
    prefix = find_mtp_prefix(path)
    items = split_kv_scales(iter(read_matching_tensors(path, re.compile(re.escape(prefix))).items()),
                            None)
    if fp8 is not None:
        items = checkpoint_names(items, fp8)
    return prefix, {k[len(prefix):]: v for k, v in items}


def load_mtp_head(target: nn.Module, path: str, *, dtype: torch.dtype, device: torch.device,
                  max_positions: int, dummy: bool, seed: int,
                  fp8: Fp8Config | None = None) -> DeepseekMtpHead:
    """The MTP layer of the checkpoint at `path` (the target's own, by default) for `target`;
    `dummy`: seeded random weights (the output head and embedding the target's). `fp8`: the
    target's FP8 setup (an FP8 checkpoint's applies to the layer's decoder layer too)."""
    if not isinstance(target, DeepseekV2ForCausalLM) or not mtp_layers(target.config.raw):
        raise ValueError("not supported yet: --speculative-algorithm NEXTN for a model without "
                         "an MTP layer (DeepSeek-V3's num_nextn_predict_layers)")
    quant = _checkpoint_fp8(fp8)
    prefix, tensors = f"model.layers.{target.config.num_hidden_layers}.", {}
    if not dummy:
        prefix, tensors = _read_layer(path, quant)
        tensors = _dequantize_own(tensors, dtype)
    lm, embed = target.lm_head, target.model.embed_tokens
    shared = {"shared_head.head.weight": getattr(lm, "weight", None),
              "embed_tokens.weight": getattr(embed, "weight", None)}
    for name, mine in shared.items():  # equal to the target's: use the target's
        t = tensors.get(name)
        if t is not None and mine is not None and t.shape == mine.shape and \
                mine.element_size() > 1 and torch.equal(t.to(mine.device, mine.dtype), mine):
            del tensors[name]  # (an FP8 target head is not compared: the layer keeps its own)
    with default_dtype(dtype), torch.device(device):
        head = DeepseekMtpHead(target, max_positions, "shared_head.head.weight" in tensors,
                               "embed_tokens.weight" in tensors, prefix)
    if quant is not None and not dummy:
        prepare_fp8_checkpoint(head, quant)  # fp8 weights + scale grids, as the target's layers
    if dummy:
        init_dummy_weights(head, seed + 1)
    else:
        _load(head, target, tensors)
    if quant is not None:  # dummy: block-quantised as the target's; kv_b_proj dequantised
        quantize_model(head, quant, dtype)
    return head.eval().requires_grad_(False)


def _dequantize_own(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The layer's own tensors (`eh_proj`, `shared_head.head`) in `dtype` where the checkpoint
    ships them FP8 (a `weight_scale` beside them: a block grid, per row or one in all): they run
    as plain matmuls. V3's are bf16 already."""
    out = dict(tensors)
    for name in [n for n in tensors if n.startswith(_OWN) and n.endswith(".weight_scale")]:
        weight = name[: -len("_scale")]
        w, scale = out.get(weight), out.pop(name).to(torch.float32)
        if w is None or w.dtype != FP8:
            raise ValueError(f"MTP layer tensor {name}: a weight scale without an fp8 weight")
        if scale.dim() < 2:
            scale = scale.reshape(-1).expand(w.shape[0]).contiguous() if scale.numel() == 1 \
                else scale.reshape(-1)
        elif scale.shape[1] == 1 and scale.shape[0] == w.shape[0]:  # [N, 1]: per row
            scale = scale.reshape(-1)
        out[weight] = dequantize(w, scale, dtype)
    return out


def _load(head: DeepseekMtpHead, target: DeepseekV2ForCausalLM,
          tensors: dict[str, torch.Tensor]) -> None:
    """The layer's tensors (names without `model.layers.N.`): its own directly, the decoder
    layer's through the target's loader (fused gate/up, experts, MLA; FP8 weights and their
    scales as the target's), every parameter filled."""
    params, modules = dict(head.named_parameters()), dict(head.named_modules())
    loaded = set()
    for name, t in tensors.items():
        if "rotary_emb." in name:
            continue
        if name.startswith(_OWN):
            if name not in params or params[name].shape != t.shape:
                raise ValueError(f"MTP layer tensor {name} {tuple(t.shape)}: no such parameter "
                                 "(or another shape) in the head")
            with torch.no_grad():
                params[name].copy_(t.to(params[name].dtype))
            loaded.add(name)
            continue
        got = target.load_tensor(f"decoder.{name}", t, params, modules)
        if got is not None:
            loaded.add(got)
            if params.get(got) is not None and params[got].dtype == FP8 and t.dtype != FP8:
                raise ValueError(f"MTP layer tensor {name} is {t.dtype}, where the checkpoint's "
                                 "FP8 config says fp8 (with a weight scale)")
    missing = sorted(set(params) - loaded)
    if missing:
        raise KeyError(f"MTP layer: tensors missing from the checkpoint: {missing[:6]}")
