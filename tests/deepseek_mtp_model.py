"""A tiny random DeepSeek-V3 checkpoint with its multi-token prediction layer, as V3 ships it
(`num_nextn_predict_layers: 1`, `model.layers.{N}.*` after the N-layer stack: enorm, hnorm,
eh_proj, a decoder layer, shared_head.norm / head; HF transformers ignores them), and a plain
torch reference of the MTP layer's chained greedy drafts over HF's hidden states, written from
that layout (its decoder layer is HF's own DeepseekV3DecoderLayer, run over the whole sequence)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from test_models_families import _DEEPSEEK
from test_models_numerics import randomize
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM


@dataclass
class MtpModel:
    path: Path
    target: DeepseekV3ForCausalLM  # the N-layer model (HF), its weights those on disk
    block: torch.nn.Module  # HF's decoder layer of index N: the MTP layer's
    mtp: dict[str, torch.Tensor]  # the MTP layer's own tensors (enorm, hnorm, eh_proj, shared_head)


def deepseek_v3_config(**over: object) -> DeepseekV3Config:
    return DeepseekV3Config(**{**_DEEPSEEK, "q_lora_rank": 24, "routed_scaling_factor": 2.5,
                               "norm_topk_prob": True, **over})


def make_mtp_model(path: Path, seed: int = 1, std: float = 0.08, **over: object) -> MtpModel:
    """Saves the checkpoint at `path` (config over `_DEEPSEEK`'s with `over`): layers 0 ... N - 1
    and the MTP layer drawn as one random N + 1 layer HF model (the MTP layer's decoder is its
    last layer: a MoE layer, past first_k_dense_replace), plus the MTP layer's own tensors."""
    cfg = deepseek_v3_config(**over)
    n = cfg.num_hidden_layers
    torch.manual_seed(0)
    full = DeepseekV3ForCausalLM(deepseek_v3_config(**{**over, "num_hidden_layers": n + 1})).eval()
    randomize(full, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    for module in full.modules():  # V3's routing bias is a buffer
        bias = getattr(module, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(0.3 * torch.randn(bias.shape, generator=g))
    target = DeepseekV3ForCausalLM(cfg).eval()
    target.load_state_dict(full.state_dict(), strict=False)  # all but layer n
    h, vocab = cfg.hidden_size, cfg.vocab_size
    mtp = {"enorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
           "hnorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
           "eh_proj.weight": std * torch.randn(h, 2 * h, generator=g),
           "shared_head.norm.weight": 1 + 0.2 * torch.randn(h, generator=g),
           "shared_head.head.weight": std * torch.randn(vocab, h, generator=g)}
    target.save_pretrained(path)
    files = sorted(path.glob("*.safetensors"))
    assert len(files) == 1, files
    tensors = load_file(str(files[0]))
    prefix = f"model.layers.{n}."
    for name, t in full.state_dict().items():
        if name.startswith(prefix):
            tensors[name] = t.contiguous()
    tensors.update({prefix + k: v for k, v in mtp.items()})
    save_file(tensors, str(files[0]), metadata={"format": "pt"})
    raw = json.loads((path / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(raw))
    return MtpModel(path, target, full.model.layers[n], mtp)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def last_hidden(target: DeepseekV3ForCausalLM, tokens: list[int]) -> torch.Tensor:
    """HF's hidden state after the last layer, before the final norm [len(tokens), hidden]."""
    got: dict[str, torch.Tensor] = {}
    hook = target.model.norm.register_forward_pre_hook(lambda m, args: got.update(h=args[0]))
    try:
        with torch.no_grad():
            target(torch.tensor([tokens]))
    finally:
        hook.remove()
    return got["h"][0]


def _block(m: MtpModel, x: torch.Tensor) -> torch.Tensor:
    """HF's decoder layer over rows 0 ... T - 1 (positions 0 ... T - 1), causal; the stream
    after it (residual added)."""
    t = x.shape[0]
    pos = torch.arange(t)[None]
    rope = m.target.model.rotary_emb(x[None], pos)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    out = m.block(x[None], attention_mask=mask, position_ids=pos, position_embeddings=rope)
    return (out[0] if isinstance(out, tuple) else out)[0]


def reference_drafts(m: MtpModel, tokens: list[int], steps: int) -> list[int]:
    """Greedy chain of `steps` drafts after `tokens` (all known): row p reads HF's last hidden
    state at p and the token at p + 1; each next row the previous row's output and draft."""
    eps, t = m.target.config.rms_norm_eps, m.mtp
    embed = m.target.model.embed_tokens.weight
    hidden = last_hidden(m.target, tokens)[:-1]
    ids, drafts = list(tokens[1:]), []
    with torch.no_grad():
        for _ in range(steps):
            x = torch.cat([_rms(embed[ids], t["enorm.weight"], eps),
                           _rms(hidden, t["hnorm.weight"], eps)], -1) @ t["eh_proj.weight"].T
            out = _block(m, x)
            logits = _rms(out[-1], t["shared_head.norm.weight"], eps) @ t["shared_head.head.weight"].T
            drafts.append(int(logits.argmax()))
            ids.append(drafts[-1])
            hidden = torch.cat([hidden, out[-1:]])
    return drafts


def hf_greedy(target: DeepseekV3ForCausalLM, tokens: list[int], n: int) -> list[int]:
    """The target's next `n` greedy tokens (a full forward per token: no cache involved)."""
    seq = list(tokens)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(target(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(tokens):]
