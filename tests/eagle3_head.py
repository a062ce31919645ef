"""A random EAGLE-3 head saved in the public checkpoint layout (config.json + safetensors with
`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`), for a given target config; and a plain
torch reference of the head's forward (chained greedy drafts) written from the layout alone."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def make_head(path: Path, target: dict, draft_vocab: int, seed: int = 0, std: float = 0.05,
              hot: list[int] | None = None) -> Path:
    """Writes a head for `target` (a config.json dict) to `path`; its draft vocabulary is
    `draft_vocab` target ids drawn at random, or the ids `hot` (d2t: target id - draft id)."""
    g = torch.Generator().manual_seed(seed)
    h, heads = target["hidden_size"], target["num_attention_heads"]
    kvh, d = target["num_key_value_heads"], target.get("head_dim") or h // heads
    inter, vocab = target["intermediate_size"], target["vocab_size"]

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    if hot is None:
        hot = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    else:
        hot, draft_vocab = torch.tensor(sorted(set(hot))), len(set(hot))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[hot] = True
    tensors = {
        "fc.weight": w(h, 3 * h),
        "midlayer.self_attn.q_proj.weight": w(heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(kvh * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(kvh * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, heads * d),
        "midlayer.mlp.gate_proj.weight": w(inter, h),
        "midlayer.mlp.up_proj.weight": w(inter, h),
        "midlayer.mlp.down_proj.weight": w(h, inter),
        "midlayer.hidden_norm.weight": 1 + w(h),
        "midlayer.input_layernorm.weight": 1 + w(h),
        "midlayer.post_attention_layernorm.weight": 1 + w(h),
        "norm.weight": 1 + w(h),
        "lm_head.weight": w(draft_vocab, h) * 10,
        "d2t": hot - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
           "hidden_size": h, "num_attention_heads": heads, "num_key_value_heads": kvh,
           "head_dim": d, "intermediate_size": inter, "num_hidden_layers": 1,
           "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
           "rope_theta": target.get("rope_theta", 10000.0), "vocab_size": vocab,
           "draft_vocab_size": draft_vocab, "target_hidden_size": h,
           "tie_word_embeddings": False, "max_position_embeddings": 2048, "hidden_act": "silu"}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    f = pos[:, None].double() * inv[None]
    cos, sin = torch.cat([f, f], -1).cos().float()[:, None], torch.cat([f, f], -1).sin().float()[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_drafts(head_dir: Path, embed: torch.Tensor, aux: torch.Tensor, tokens: list[int],
                     steps: int) -> list[int]:
    """Greedy chain of `steps` drafts after `tokens` (all known, len n), from the target's
    captured hidden states `aux` [n - 1, 3h] (position p: the layers' inputs at p) and its
    embedding table: position p's row reads the token at p + 1."""
    t = load_file(str(head_dir / "model.safetensors"))
    c = json.loads((head_dir / "config.json").read_text())
    eps, heads, kvh, d = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    m = "midlayer."

    def layer(emb: torch.Tensor, hid: torch.Tensor, pos: torch.Tensor,
              kv: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, tuple]:
        x = torch.cat([_rms(emb, t[m + "input_layernorm.weight"], eps),
                       _rms(hid, t[m + "hidden_norm.weight"], eps)], -1)
        q = _rope((x @ t[m + "self_attn.q_proj.weight"].T).view(-1, heads, d), pos, c["rope_theta"])
        k = _rope((x @ t[m + "self_attn.k_proj.weight"].T).view(-1, kvh, d), pos, c["rope_theta"])
        v = (x @ t[m + "self_attn.v_proj.weight"].T).view(-1, kvh, d)
        if kv is not None:
            k, v = torch.cat([kv[0], k]), torch.cat([kv[1], v])
        kr, vr = k.repeat_interleave(heads // kvh, 1), v.repeat_interleave(heads // kvh, 1)
        n, total = q.shape[0], k.shape[0]
        mask = torch.ones(n, total, dtype=torch.bool).tril(total - n)
        a = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), kr.transpose(0, 1), vr.transpose(0, 1), attn_mask=mask)
        res = a.transpose(0, 1).reshape(n, -1) @ t[m + "self_attn.o_proj.weight"].T + hid
        y = _rms(res, t[m + "post_attention_layernorm.weight"], eps)
        y = (torch.nn.functional.silu(y @ t[m + "mlp.gate_proj.weight"].T) * (y @ t[m + "mlp.up_proj.weight"].T)
             ) @ t[m + "mlp.down_proj.weight"].T
        return y + res, (k, v)

    def draft(out: torch.Tensor) -> int:
        i = int((_rms(out, t["norm.weight"], eps) @ t["lm_head.weight"].T).argmax())
        return i + int(t["d2t"][i])

    n = len(tokens)
    hid = aux @ t["fc.weight"].T
    out, kv = layer(embed[tokens[1:]], hid, torch.arange(n - 1), None)
    last, drafts = out[-1:], [draft(out[-1])]
    for j in range(1, steps):
        last, kv = layer(embed[[drafts[-1]]], last, torch.tensor([n - 2 + j]), kv)
        drafts.append(draft(last[0]))
    return drafts
