"""Weight loading: HF safetensors, GGUF (dequantised through the `gguf` package) and seeded dummy.

With tensor parallelism each rank builds only its shard of every layer and fills it from the
checkpoint stream: safetensors tensors arrive lazily (`LazyTensor`) and a rank reads only the
rows/columns it owns; GGUF tensors are dequantised one at a time and cut; dummy weights are drawn
per full tensor (seeded by name, so every TP size gets the same model) and cut. No rank ever
holds more than its shards plus one full tensor.
"""

from __future__ import annotations

import glob
import os
import re
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from tokenspeed.distributed.groups import ParallelState, single_rank, state
from tokenspeed.layers.moe import MoeOptions, MoeParallel
from tokenspeed.layers.quantization.fp8_model import (
    checkpoint_names,
    prepare_fp8_checkpoint,
    quantize_model,
)
from tokenspeed.layers.quantization.kv_cache import KVScales, split_kv_scales
from tokenspeed.layers.quantization.methods import Fp8Config
from tokenspeed.models.config import ModelConfig, config_from_gguf_fields, load_hf_config
from tokenspeed.models.registry import build_model, pooling_config_for

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


def find_gguf_file(model_path: str) -> str | None:
    """The .gguf file that `model_path` is or contains (exactly one), else None."""
    if os.path.isfile(model_path) and model_path.endswith(".gguf"):
        return model_path
    if os.path.isdir(model_path):
        files = sorted(glob.glob(os.path.join(model_path, "*.gguf")))
        if len(files) > 1:
            raise ValueError(f"{model_path!r} holds several .gguf files; pass one of them: {files}")
        return files[0] if files else None
    return None


def resolve_load_format(model_path: str, load_format: str) -> str:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} not in {LOAD_FORMATS}")
    if load_format != "auto":
        return load_format
    if os.path.isdir(model_path) and glob.glob(os.path.join(model_path, "*.safetensors")):
        return "safetensors"
    if find_gguf_file(model_path):
        return "gguf"
    raise FileNotFoundError(f"no *.safetensors or *.gguf weights under {model_path!r}")


# --- safetensors -----------------------------------------------------------------------------


class LazyTensor:
    """A safetensors tensor not read yet: `narrow` reads only that slice from the file, `to`
    (or `full`) reads all of it. Layers' weight loaders take it where they take a tensor."""

    def __init__(self, handle: object, name: str) -> None:
        self._handle, self._name = handle, name
        self._slice = handle.get_slice(name)  # type: ignore[attr-defined]
        self.shape = torch.Size(self._slice.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def full(self) -> torch.Tensor:
        return self._handle.get_tensor(self._name)  # type: ignore[attr-defined]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * self.dim()
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        return self.full().to(dtype)

    def float(self) -> torch.Tensor:
        """All of it in float32 (small tensors such as quantization scales)."""
        return self.to(torch.float32)


def iter_safetensors(model_dir: str, progress: bool = True,
                     lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (HF name, tensor) from every *.safetensors file, one tensor at a time; with
    `lazy`, (HF name, LazyTensor) so that a TP rank reads only its shard."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir!r}")
    handles = [safe_open(f, framework="pt") for f in files]
    keys = [list(h.keys()) for h in handles]  # safe_open handles are not dicts
    total = sum(len(k) for k in keys)
    with tqdm(total=total, desc="Loading safetensors", unit="tensor", disable=not progress) as bar:
        for h, names in zip(handles, keys):
            for name in names:
                yield name, (LazyTensor(h, name) if lazy else h.get_tensor(name))  # type: ignore[misc]
                bar.update(1)



def matching_tensor_names(model_dir: str, pattern: re.Pattern[str]) -> list[str]:
    """Names of the *.safetensors tensors that `pattern` matches (from the files' headers)."""
    from safetensors import safe_open

    names = []
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(f, framework="pt") as h:
            names += [k for k in h.keys() if pattern.match(k)]  # noqa: SIM118 (not a dict)
    return names


def read_matching_tensors(model_dir: str, pattern: re.Pattern[str]) -> dict[str, torch.Tensor]:
    """The *.safetensors tensors that `pattern` matches (one layer of a large checkpoint: only
    the files holding them are read)."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(f, framework="pt") as h:
            for k in h.keys():  # noqa: SIM118 (not a dict)
                if pattern.match(k):
                    out[k] = h.get_tensor(k)
    return out

# --- GGUF ------------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixture of experts: the router and the experts stacked on dim 0 ([E, I, H], down [E, H, I]).
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str | None:
    """llama.cpp tensor name → HF name; None for tensors we do not use (e.g. rope_freqs)."""
    m = _GGUF_BLOCK.match(name)
    if m:
        layer, part, kind = m.groups()
        hf = _GGUF_LAYER_NAMES.get(part)
        return f"model.layers.{layer}.{hf}.{kind}" if hf else None
    base, _, kind = name.rpartition(".")
    hf = _GGUF_GLOBAL_NAMES.get(base)
    return f"{hf}.{kind}" if hf else None


def unpermute_llama_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf permute of llama q/k rows (interleaved → half-split)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_fields(reader: object) -> dict[str, object]:
    """Model metadata (tokenizer arrays skipped: they are large and only their length matters)."""
    fields = reader.fields  # type: ignore[attr-defined]
    out = {k: f.contents() for k, f in fields.items() if not k.startswith("tokenizer.")}
    if "tokenizer.ggml.tokens" in fields:
        out["tokenizer.vocab_size"] = len(fields["tokenizer.ggml.tokens"].data)
    return out


def read_gguf(path: str) -> tuple[ModelConfig, Callable[[], Iterator[tuple[str, torch.Tensor]]]]:
    """Config from the GGUF metadata and a stream of dequantised, HF-named float32 tensors."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    fields = _gguf_fields(reader)
    config = config_from_gguf_fields(fields, has_output_tensor="output.weight" in names)
    if "rope_freqs.weight" in names:
        raise NotImplementedError("GGUF with rope_freqs (llama 3.1 rope scaling) is not supported")
    permute = fields["general.architecture"] == "llama"

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for t in tqdm(reader.tensors, desc="Loading GGUF", unit="tensor"):
            hf = gguf_to_hf_name(t.name)
            if hf is None:
                continue
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            if permute and ".q_proj." in hf:
                w = unpermute_llama_qk(w, config.num_attention_heads)
            elif permute and ".k_proj." in hf:
                w = unpermute_llama_qk(w, config.num_key_value_heads)
            if not w.flags.writeable or not w.flags.c_contiguous:  # F32 tensors view the mmap
                w = np.array(w, order="C")
            yield hf, torch.from_numpy(w)

    return config, tensors


# --- dummy -----------------------------------------------------------------------------------


def init_dummy_weights(model: nn.Module, seed: int, std: float = 0.02,
                       full_model: nn.Module | None = None) -> None:
    """Seeded random weights: norms 1, biases 0, the rest N(0, std), each full (unsharded)
    tensor drawn from a generator seeded by (seed, name). Same seed → same weights at any TP
    size. `full_model`: the TP=1 model on the meta device (names and full shapes); each full
    tensor goes through `model`'s weight loaders, which keep this rank's shard."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    full_model = full_model or model
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    full_modules = dict(full_model.named_modules())
    with torch.no_grad():
        for name, full in full_model.named_parameters():
            p = params[name]
            owner_name = name.rsplit(".", 1)[0]
            if "norm" in name or name.endswith(".bias"):
                p.fill_(getattr(modules[owner_name], "dummy_value", 1.0) if "norm" in name else 0.0)
                continue
            gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            value = torch.empty(full.shape, dtype=p.dtype, device=device).normal_(0.0, std,
                                                                                  generator=gen)
            loader = getattr(modules[owner_name], "weight_loader", None)
            if loader is None:
                p.copy_(value)
                continue
            # Fused parameters (qkv, gate_up) load sub-matrix by sub-matrix, as from HF.
            sizes = getattr(full_modules[owner_name], "output_sizes", [full.shape[0]])
            for shard, piece in enumerate(value.split(sizes, dim=0)):
                loader(p, piece, shard)


# --- entry point -----------------------------------------------------------------------------


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@dataclass
class Checkpoint:
    """Where the weights come from: resolved format, config, and a tensor stream (None: dummy)."""

    path: str
    load_format: str
    config: ModelConfig
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]] | None


def open_checkpoint(model_path: str, load_format: str = "auto",
                    overrides: dict[str, Any] | None = None) -> Checkpoint:
    """Read the config (config.json with `overrides` merged over it, or GGUF metadata) without
    loading any tensor yet."""
    fmt = resolve_load_format(model_path, load_format)
    if fmt == "gguf" and overrides:
        raise NotImplementedError("--json-model-override-args overrides config.json fields; a "
                                  "GGUF model's config comes from its metadata")
    if fmt == "gguf":
        path = find_gguf_file(model_path)
        if path is None:
            raise FileNotFoundError(f"no .gguf file at {model_path!r}")
        config, tensors = read_gguf(path)
        return Checkpoint(path, fmt, config, tensors)
    config = load_hf_config(model_path, overrides)
    if fmt == "dummy":
        return Checkpoint(model_path, fmt, config, None)
    return Checkpoint(model_path, fmt, config, lambda: iter_safetensors(model_path, lazy=True))


def load_model(ckpt: Checkpoint, *, dtype: torch.dtype, device: torch.device,
               max_positions: int, seed: int = 0, moe: MoeOptions | None = None,
               kv_scales: KVScales | None = None, fp8: Fp8Config | None = None,
               parallel: ParallelState | None = None, pooling: bool = False) -> nn.Module:
    """Build this rank's shard of the model on `device` in `dtype` and fill its weights (seeded
    random for dummy). The checkpoint's KV cache scales, if any, go to `kv_scales`. fp8: FP8
    linear weights, read as they are from an FP8 checkpoint, else quantised once loaded.
    `parallel`: the rank's groups (None: `distributed.state()`). `pooling`: the model as an
    embedding / scoring model (`--is-embedding`; its pooling read from the checkpoint)."""
    parallel = parallel or state()
    pool_cfg = pooling_config_for(ckpt.config, os.path.dirname(ckpt.path) if ckpt.load_format
                                  == "gguf" else ckpt.path) if pooling else None
    with default_dtype(dtype), torch.device(device):
        model = build_model(ckpt.config, max_positions, moe, parallel, pool_cfg)
    if fp8 is not None and fp8.checkpoint_format and ckpt.tensors is not None:
        prepare_fp8_checkpoint(model, fp8)
    if ckpt.tensors is None:
        full = None
        if parallel.world.size > 1:
            # The whole model (experts too: one rank's MoE options would cut them) on the meta
            # device gives every tensor's full shape, so each rank keeps its shard of the same
            # draws and the model is the same at any TP / EP / MoE-TP size.
            one = replace(moe, parallel=MoeParallel()) if moe is not None else None
            with default_dtype(dtype), torch.device("meta"):
                full = build_model(ckpt.config, max_positions, one, single_rank(), pool_cfg)
        init_dummy_weights(model, seed, full_model=full)
    else:
        tensors = split_kv_scales(ckpt.tensors(), kv_scales)
        if fp8 is not None:
            tensors = checkpoint_names(tensors, fp8)
        model.load_weights(tensors)  # type: ignore[operator]
    if fp8 is not None:
        quantize_model(model, fp8, dtype)
    return model.eval()
