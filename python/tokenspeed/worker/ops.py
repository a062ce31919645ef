"""Operations on the worker group (`WorkerOp` in rust/engine/src/plan.rs): a plan that carries
one instead of a step. The engine sends it only while no request holds a slot; every rank
applies it, and the lead rank's result reports the outcome (`OpOutcome`).

`update_weights` (`/update_weights_from_disk`): the new checkpoint's tensors are copied into the
model's parameters in place, so CUDA graphs (which captured their addresses) stay valid and no
second copy of the weights is needed. A checkpoint of another architecture is refused before a
tensor is read; one that fails half-way is undone by reloading the weights that were serving."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any

import numpy as np
import torch

from tokenspeed._core import OP_KINDS
from tokenspeed.distributed.groups import world_min
from tokenspeed.layers.quantization.kv_cache import split_kv_scales
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.weights import open_checkpoint
from tokenspeed.worker.plan import RESULT_DTYPES, StepPlan

logger = logging.getLogger("tokenspeed.worker.ops")

# Config fields that may differ between checkpoints of one architecture.
_FREE_FIELDS = {"raw", "torch_dtype"}


class OpError(Exception):
    """The operation was refused or failed; the model serves what it served before."""


def has_op(plan: StepPlan) -> bool:
    return len(getattr(plan, "op_kind", ())) > 0


def run_op(runner: Any, plan: StepPlan, lockstep: bool) -> tuple[bool, str]:
    """Applies the plan's operation on this rank; (ok, message). Every rank of the group gets
    the same outcome: a failure on any rank fails the op on all (and each rank undoes it)."""
    kind = int(plan.op_kind[0])
    args = json.loads(bytes(np.asarray(plan.op_args, np.uint8)).decode() or "{}")
    if lockstep:
        return False, "weight updates are not supported yet with data-parallel attention"
    if kind in (OP_KINDS["release_memory"], OP_KINDS["resume_memory"]):
        return _memory_op(runner, kind)
    if kind != OP_KINDS["update_weights"]:
        return False, f"unknown worker operation {kind}"
    started, serving = time.perf_counter(), runner.weights_source
    try:
        update_weights(runner, str(args["model_path"]), args.get("load_format") or None)
        ok, message = True, (f"Succeeded to update model weights from {args['model_path']} "
                             f"in {time.perf_counter() - started:.1f}s.")
    except Exception as e:  # noqa: BLE001  (any failure is the op's outcome, not the worker's death)
        logger.warning("weights not updated from %s: %s", args.get("model_path"), e)
        ok, message = False, f"{type(e).__name__}: {e}"
    if world_min(int(ok)) == 0 and ok:
        # Another rank failed: every rank must serve the same weights.
        _load(runner, open_checkpoint(*serving, runner.config_overrides).tensors)
        runner.weights_source = serving
        ok, message = False, "another rank failed to load the new weights"
    return ok, message


def outcome_arrays(ok: bool, message: str) -> dict[str, bytes]:
    """The result of an op's plan: one `OpOutcome` row."""
    text = message.encode()[:8192]
    return {
        "op_result_ok": np.asarray([ok], RESULT_DTYPES["op_result_ok"]).tobytes(),
        "op_result_message_len": np.asarray([len(text)], np.uint32).tobytes(),
        "op_result_message": text,
    }


def check_same_architecture(serving: ModelConfig, new: ModelConfig) -> None:
    """Raises OpError naming the first field in which `new` differs from the serving model."""
    for f in dataclasses.fields(serving):
        if f.name in _FREE_FIELDS:
            continue
        a, b = getattr(serving, f.name), getattr(new, f.name)
        if a != b:
            raise OpError(f"the new checkpoint's {f.name} is {b!r}, the serving model's {a!r}: "
                          "only weights of the same architecture can be loaded")


def update_weights(runner: Any, model_path: str, load_format: str | None) -> None:
    """Loads `model_path`'s weights into `runner.model` in place (see the module doc)."""
    if runner.fp8 is not None:
        raise OpError("weight updates are not supported yet with FP8 weights")
    if runner.lora is not None:
        raise OpError("weight updates are not supported yet with LoRA adapters")
    fmt = load_format or runner.weights_source[1]
    ckpt = open_checkpoint(model_path, fmt, runner.config_overrides)
    if ckpt.tensors is None:
        raise OpError(f"load_format {fmt!r} has no weights to load")
    check_same_architecture(runner.config, ckpt.config)
    try:
        _load(runner, ckpt.tensors)
    except Exception:
        old = open_checkpoint(*runner.weights_source, runner.config_overrides)
        _load(runner, old.tensors)  # the old ones back
        raise
    runner.weights_source = (model_path, fmt)
    logger.info("weights updated from %s", model_path)


def _load(runner: Any, tensors: Any) -> None:
    if tensors is None:  # dummy weights: seeded at start, never overwritten
        return
    with torch.no_grad():
        # The KV cache's scales stay those the pool was set up with.
        runner.model.load_weights(split_kv_scales(tensors(), None))
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def _memory_op(runner: Any, kind: int) -> tuple[bool, str]:
    """Release or resume (worker/memory_ops.py); every rank of the group agrees on the outcome."""
    from tokenspeed.worker import memory_ops

    try:
        if kind == OP_KINDS["release_memory"]:
            ok, message = True, memory_ops.release(runner)
        else:
            ok, message = True, memory_ops.resume(runner)
    except Exception as e:  # noqa: BLE001  (the op's outcome, not the worker's death)
        logger.warning("memory operation failed: %s", e)
        ok, message = False, f"{type(e).__name__}: {e}"
    if world_min(int(ok)) == 0 and ok:
        # A rank failed: the group cannot be half released, so this rank undoes its part.
        (memory_ops.resume if kind == OP_KINDS["release_memory"] else memory_ops.release)(runner)
        ok, message = False, "another rank failed the memory operation"
    return ok, message
