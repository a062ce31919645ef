"""LoRA settings the launcher resolves before anything starts: reading a PEFT adapter's
`adapter_config.json`, parsing --lora-paths, and the pool's rank and modules when the flags
leave them to the adapters. Light (no torch): the launcher and the worker both use it."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# HF module name → (our module, sub-projection index).
HF_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
# --lora-target-modules spellings of several HF modules.
MODULE_GROUPS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
                 "all": tuple(HF_MODULES)}
DEFAULT_MAX_RANK = 64  # --max-lora-rank without it and without --lora-paths


class AdapterError(ValueError):
    """An adapter TokenSpeed cannot serve; the message names it and why."""


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scaling: float
    modules: frozenset[str]  # HF module names from the config (what the weights hold is checked)


def read_adapter_config(path: str | Path) -> AdapterConfig:
    """The parts of a PEFT adapter_config.json TokenSpeed uses; refuses what it cannot serve."""
    file = Path(path) / "adapter_config.json"
    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"LoRA adapter {path}: cannot read adapter_config.json: {e}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"LoRA adapter {path}: peft_type {cfg['peft_type']!r} is not LORA")
    unsupported = [k for k in ("use_dora", "fan_in_fan_out") if cfg.get(k)]
    unsupported += [k for k in ("rank_pattern", "alpha_pattern", "modules_to_save",
                                "layers_to_transform") if cfg.get(k)]
    if cfg.get("bias", "none") != "none":
        unsupported.append("bias")
    if unsupported:
        raise AdapterError(f"LoRA adapter {path}: {', '.join(unsupported)} not supported")
    rank = int(cfg.get("r", 0))
    if rank <= 0:
        raise AdapterError(f"LoRA adapter {path}: r must be positive, got {rank}")
    alpha = float(cfg.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):  # a regex or "all-linear": what the weights hold decides
        targets = list(HF_MODULES) if targets == "all-linear" else \
            [m for m in HF_MODULES if re.search(targets, m)]
    bad = sorted(set(targets) - set(HF_MODULES))
    if bad:
        raise AdapterError(f"LoRA adapter {path}: target modules {bad} not supported (only "
                           f"{', '.join(HF_MODULES)}; embeddings and lm_head are never adapted)")
    return AdapterConfig(rank, scaling, frozenset(targets))


def resolve_target_modules(given: list[str] | None, adapters: list[AdapterConfig]) -> list[str]:
    """--lora-target-modules as HF module names: given (groups expanded), else what the start-up
    adapters target, else all."""
    if given:
        return sorted({m for g in given for m in MODULE_GROUPS.get(g, (g,))})
    found = {m for a in adapters for m in a.modules}
    return sorted(found or HF_MODULES)


@dataclass(frozen=True)
class StartAdapter:
    """An adapter of --lora-paths."""

    name: str
    path: str
    pinned: bool = False  # SGLang's: never evicted from the GPU pool (the server checks the limit)


def parse_lora_paths(items: list[str] | None) -> list[StartAdapter]:
    """--lora-paths: NAME=PATH, a bare PATH (named by itself, as SGLang does), or a JSON object
    with lora_name, lora_path and optionally pinned."""
    out = []
    for item in items or []:
        text = item.strip()
        pinned = False
        if text.startswith("{"):
            try:
                obj = json.loads(text)
            except ValueError as e:
                raise AdapterError(f"--lora-paths {item!r}: {e}") from None
            name, path, pinned = obj.get("lora_name"), obj.get("lora_path"), obj.get("pinned", False)
            if not isinstance(name, str) or not isinstance(path, str):
                raise AdapterError(f"--lora-paths {item!r}: needs lora_name and lora_path")
            if not isinstance(pinned, bool):
                raise AdapterError(f"--lora-paths {item!r}: pinned must be true or false")
        elif "=" in text:
            name, path = text.split("=", 1)
        else:
            name, path = text, text
        out.append(StartAdapter(name, path, pinned))
    names = [a.name for a in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise AdapterError(f"--lora-paths names the adapter {dup!r} twice")
    return out


@dataclass(frozen=True)
class LoraSettings:
    """What the launcher hands the server and the workers."""

    adapters: list[StartAdapter]
    max_rank: int
    targets: list[str]

    def server(self, max_per_batch: int) -> dict[str, Any]:
        return {"enabled": True, "adapters": [vars(a) for a in self.adapters],
                "max_rank": self.max_rank, "target_modules": self.targets,
                "max_per_batch": max_per_batch}


def resolve_lora(enable: bool, paths: list[str] | None, max_rank: int | None,
                 targets: list[str] | None) -> LoraSettings | None:
    """The LoRA settings (None: off). --lora-paths turns LoRA on; the rank and modules default
    to what the start-up adapters need (DEFAULT_MAX_RANK and all modules without any)."""
    adapters = parse_lora_paths(paths)
    if not enable and not adapters:
        return None
    configs = [read_adapter_config(a.path) for a in adapters]
    rank = max_rank or max((c.rank for c in configs), default=DEFAULT_MAX_RANK)
    too_big = [(a.name, c.rank) for a, c in zip(adapters, configs) if c.rank > rank]
    if too_big:
        raise AdapterError(f"LoRA adapter {too_big[0][0]} has rank {too_big[0][1]} > "
                           f"--max-lora-rank {rank}")
    modules = resolve_target_modules(targets, configs)
    outside = [(a.name, sorted(c.modules - set(modules))) for a, c in zip(adapters, configs)
               if c.modules - set(modules)]
    if outside:
        raise AdapterError(f"LoRA adapter {outside[0][0]} targets {outside[0][1]}, not in "
                           f"--lora-target-modules")
    return LoraSettings(adapters, rank, modules)
