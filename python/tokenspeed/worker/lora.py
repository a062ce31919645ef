"""LoRA adapters on the worker: reading PEFT checkpoints, and the pool the model's layers read.

An adapter is a PEFT directory: `adapter_config.json` (r, lora_alpha, use_rslora, ...) and
`adapter_model.safetensors` (`...layers.{i}.self_attn.q_proj.lora_A.weight` [r, in],
`...lora_B.weight` [out, r]). Its q/k/v and gate/up matrices go to sub-projections of our
fused qkv_proj / gate_up_proj; scaling is lora_alpha / r (rsLoRA: / sqrt(r)), folded into B.

`LoraPool` owns the adapters of one worker: a host cache of loaded adapters (at most
--max-loaded-loras, least recently used dropped; a dropped one is read from disk again when a
request needs it) and --max-loras-per-batch pool slots in every adapted layer (on the device;
the scheduler never puts more adapters in one step; pinned adapters, which each plan lists,
are never evicted and the scheduler keeps their slots). Requests carry an adapter id (0: the base
model) and its path, fixed when the server registered it, so ids are never reused for
another adapter.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tokenspeed.config.lora import HF_MODULES, AdapterError, read_adapter_config
from tokenspeed.layers.linear import ColumnLinear, RowLinear, shard_cols, shard_rows
from tokenspeed.layers.lora import LoraBatch, LoraWeights, token_segments
from tokenspeed.worker.plan import StepPlan

logger = logging.getLogger(__name__)
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")

@dataclass
class Adapter:
    """One loaded adapter: per (layer, HF module) its A [r, in] and scaled B [out, r] on the host."""

    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def load_adapter(path: str | Path, targets: list[str], max_rank: int,
                 dtype: torch.dtype) -> Adapter:
    """Read a PEFT adapter directory; refuses one past `max_rank` or adapting other modules."""
    from safetensors.torch import load_file

    cfg = read_adapter_config(path)
    if cfg.rank > max_rank:
        raise AdapterError(f"LoRA adapter {path}: rank {cfg.rank} > --max-lora-rank {max_rank}")
    file = Path(path) / "adapter_model.safetensors"
    try:
        tensors = load_file(str(file))
    except (OSError, ValueError) as e:
        raise AdapterError(f"LoRA adapter {path}: cannot read {file.name}: {e}") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in HF_MODULES:
            raise AdapterError(f"LoRA adapter {path}: tensor {key!r} adapts a module TokenSpeed "
                               "does not (only the attention and MLP projections)")
        if m.group(2) not in targets:
            raise AdapterError(f"LoRA adapter {path}: adapts {m.group(2)}, which is not in "
                               f"--lora-target-modules ({', '.join(targets)})")
        halves.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
    weights = {}
    for where, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"LoRA adapter {path}: layer {where[0]} {where[1]} lacks lora_"
                               f"{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != cfg.rank or b.shape[1] != cfg.rank:
            raise AdapterError(f"LoRA adapter {path}: layer {where[0]} {where[1]}: shapes "
                               f"{tuple(a.shape)}, {tuple(b.shape)} do not match r={cfg.rank}")
        weights[where] = (a.to(dtype), (b.float() * cfg.scaling).to(dtype))
    return Adapter(cfg.rank, weights)


def lora_layers(model: nn.Module) -> dict[tuple[int, str], ColumnLinear | RowLinear]:
    """The model's adaptable linear layers by (layer index, our module name)."""
    found: dict[tuple[int, str], ColumnLinear | RowLinear] = {}
    for name, module in model.named_modules():
        parts = name.split(".")
        if (isinstance(module, (ColumnLinear, RowLinear)) and len(parts) >= 2
                and parts[-1] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
                and "layers" in parts):
            found[(int(parts[parts.index("layers") + 1]), parts[-1])] = module
    return found


class LoraPool:
    """The worker's adapters: host cache, device pool slots, and each request slot's adapter."""

    def __init__(self, model: nn.Module, *, targets: list[str], max_rank: int, pool_slots: int,
                 max_loaded: int | None, max_slots: int, max_tokens: int,
                 dtype: torch.dtype, device: torch.device, eviction: str) -> None:
        self.targets, self.max_rank, self.dtype = targets, max_rank, dtype
        self.lru = eviction == "lru"  # else "fifo": a pool slot's adapter by when it was loaded
        self.max_loaded = max_loaded
        self.batch = LoraBatch(torch.full((max_tokens,), -1, dtype=torch.int32, device=device))
        ours = {HF_MODULES[m][0] for m in targets}
        self.layers = {k: v for k, v in lora_layers(model).items() if k[1] in ours}
        if not self.layers:
            raise AdapterError(f"{type(model).__name__} has no layers LoRA can adapt")
        for layer in self.layers.values():
            in_features = layer.weight.shape[1]
            subs = layer.output_sizes if isinstance(layer, ColumnLinear) else [layer.weight.shape[0]]
            layer.lora = LoraWeights(self.batch, in_features, subs, max_rank, pool_slots, dtype,
                                     device)
            # One GEMM for the base output and every slot's x A^T in per-token steps.
            layer.lora.stack_base(layer.weight, layer.bias, layer.weight_scale is not None)
        if device.type == "cuda":  # the unstacked weights' blocks, before memory is measured
            torch.cuda.empty_cache()
        self.host: OrderedDict[int, Adapter] = OrderedDict()  # adapter id → weights, LRU first
        self.paths: dict[int, str] = {}
        self.resident: OrderedDict[int, int] = OrderedDict()  # adapter id → pool slot, evicted first first
        self.free = list(range(pool_slots - 1, -1, -1))
        self.slot_adapter = np.zeros(max_slots, np.int64)  # request slot → adapter id (0: base)
        self._slots_clear = False  # whether batch.token_slot holds only -1
        self.adapter_rows = False  # the last prepared step has a row on an adapter
        self.failed: set[int] = set()  # request slots whose adapter could not be read

    def stacked_bytes(self, tokens: int) -> int:
        """Activation bytes the stacked path adds to a per-token step of `tokens` tokens (the
        stacked GEMM's output [tokens, OUT + A rows] beside the merge's, at the widest layer):
        the CUDA graphs' pool holds it; the profile forward (eager, no LoRA) does not see it."""
        rows = [layer.lora.stacked.shape[0] for layer in self.layers.values()
                if layer.lora is not None and layer.lora.stacked is not None]
        return tokens * max(rows, default=0) * self.dtype.itemsize

    def admit(self, slot: int, adapter_id: int, path: str) -> None:
        """A new request in worker slot `slot` runs adapter `adapter_id` (0: the base model).
        An adapter that cannot be read (gone since the server checked it) fails the request,
        not the worker: its slot runs the base model and its events carry an error."""
        self.slot_adapter[slot] = adapter_id
        self.failed.discard(slot)
        if not adapter_id:
            return
        self.paths[adapter_id] = path
        try:
            self._adapter(adapter_id)  # read now: a failure is this request's alone
        except (AdapterError, OSError) as e:
            logger.error("slot %d: LoRA adapter %d: %s", slot, adapter_id, e)
            self.slot_adapter[slot] = 0
            self.failed.add(slot)

    def prepare(self, plan: StepPlan, per_token: bool) -> None:
        """Point the layers at the step's adapters: load missing ones into pool slots (over
        adapters neither this step nor a pin needs: the plan lists every pinned adapter, and
        the scheduler keeps a slot for each), then the per-token slots (CUDA graphs,
        `per_token`) or the segments of adapter rows."""
        ids = self.slot_adapter[plan.sched_slot]
        pool_slot = np.full(len(ids), -1, np.int32)
        wanted = set(ids[ids > 0].tolist())
        keep = wanted | set(plan.lora_pin_adapter.tolist())
        for aid in dict.fromkeys(ids[ids > 0].tolist()):  # once per adapter, not per request
            pool_slot[ids == aid] = self._resident(aid, keep)
        token_slot = np.repeat(pool_slot, plan.sched_tokens_len)
        batch = self.batch
        self.adapter_rows = bool(wanted)
        if per_token:
            self._write_token_slots(token_slot if wanted else None)
            batch.active, batch.per_token = True, True
        else:
            batch.set_segments(token_segments(token_slot))

    def capture_mode(self) -> None:
        """Before CUDA graphs are captured: every layer runs the per-token kernels (on slots
        all -1 now; a replay reads what `prepare` wrote)."""
        self._write_token_slots(None)
        self.batch.active, self.batch.per_token = True, True

    @contextmanager
    def plain(self) -> Iterator[None]:
        """Inside: the layers run without LoRA (capturing the decode graphs that steps with
        no adapter row replay: they skip the LoRA kernels and the stacked GEMM's A rows)."""
        batch = self.batch
        state = batch.active, batch.per_token
        batch.active = batch.per_token = False
        try:
            yield
        finally:
            batch.active, batch.per_token = state

    def _write_token_slots(self, token_slot: np.ndarray | None) -> None:
        """The whole fixed-size buffer: this step's slots, -1 past them (graph padding rows).
        None: all -1, skipped when the buffer holds that already (base-model-only steps)."""
        if token_slot is None and self._slots_clear:
            return
        host = np.full(self.batch.token_slot.shape[0], -1, np.int32)
        if token_slot is not None:
            host[:len(token_slot)] = token_slot
        self.batch.token_slot.copy_(_to_copy(torch.from_numpy(host)), non_blocking=True)
        self._slots_clear = token_slot is None

    def _resident(self, aid: int, keep: set[int]) -> int:
        """The pool slot holding adapter `aid`, loading it (over the least recently used, or
        under fifo the earliest loaded, adapter not in `keep`) when it is not there."""
        if aid in self.resident:
            if self.lru:
                self.resident.move_to_end(aid)
            return self.resident[aid]
        if self.free:
            slot = self.free.pop()
        else:
            victim = next((v for v in self.resident if v not in keep), None)
            if victim is None:
                raise RuntimeError(f"a step needs more adapters than the {len(self.resident)} "
                                   "pool slots (--max-loras-per-batch); the scheduler bounds it")
            slot = self.resident.pop(victim)
        self._write(slot, self._adapter(aid))
        self.resident[aid] = slot
        return slot

    def _adapter(self, aid: int) -> Adapter:
        if aid in self.host:
            self.host.move_to_end(aid)
            return self.host[aid]
        adapter = load_adapter(self.paths[aid], self.targets, self.max_rank, self.dtype)
        missing = [f"layer {i} {hf}" for i, hf in adapter.weights
                   if (i, HF_MODULES[hf][0]) not in self.layers]
        if missing:  # e.g. an MLP adapter on a mixture-of-experts model
            raise AdapterError(f"LoRA adapter {self.paths[aid]} adapts {missing[0]}, which this "
                               "model has no adaptable linear layer for")
        self.host[aid] = adapter
        while self.max_loaded is not None and len(self.host) > self.max_loaded:
            self.host.popitem(last=False)
        logger.info("LoRA adapter %d loaded from %s (rank %d)", aid, self.paths[aid], adapter.rank)
        return adapter

    def _write(self, slot: int, adapter: Adapter) -> None:
        """Copy an adapter into pool slot `slot` of every layer, each rank its shard."""
        for layer in self.layers.values():
            assert layer.lora is not None
            layer.lora.clear(slot)
        for (layer_id, hf), (a, b) in adapter.weights.items():
            ours, sub = HF_MODULES[hf]
            layer = self.layers.get((layer_id, ours))
            if layer is None or layer.lora is None:
                raise AdapterError(f"LoRA adapter {hf} of layer {layer_id}: no such layer")
            if isinstance(layer, ColumnLinear):  # B's rows split like the base output
                part, parts = layer.shard_splits[sub]
                b = shard_rows(b, part, parts)
            else:  # A's columns split like the base input
                a = shard_cols(a, layer.tp_rank, layer.tp_size)
            dev = layer.lora.a.device
            layer.lora.set_sub(slot, sub, _to_copy(a).to(dev, non_blocking=True),
                               _to_copy(b).to(dev, non_blocking=True))


def _to_copy(host: torch.Tensor) -> torch.Tensor:
    """`host` ready for a non-blocking copy to a CUDA device: pinned (a pageable copy would
    make the host wait for every queued kernel, undoing one-step-ahead scheduling; torch's
    caching host allocator keeps the block until the copy is done)."""
    return host.pin_memory() if torch.cuda.is_available() else host


def lora_settings(settings: dict[str, Any]) -> dict[str, Any] | None:
    """The LoraPool arguments in the worker's flags (None: LoRA off)."""
    if not settings.get("enable_lora"):
        return None
    return {"targets": list(settings["lora_target_modules"]),
            "max_rank": int(settings["max_lora_rank"]),
            "pool_slots": int(settings["max_loras_per_batch"]),
            "max_loaded": settings.get("max_loaded_loras"),
            "eviction": str(settings["lora_eviction_policy"])}
