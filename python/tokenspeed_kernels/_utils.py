"""Small shared helpers for the Triton kernels (device properties, dot precision)."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def num_sms(device_index: int | None = None) -> int:
    """Streaming multiprocessor count of the current CUDA device (8 when running without CUDA)."""
    if not torch.cuda.is_available():
        return 8
    idx = torch.cuda.current_device() if device_index is None else device_index
    return torch.cuda.get_device_properties(idx).multi_processor_count


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact fp32 ("ieee") for fp32 inputs, tensor-core default otherwise."""
    return "ieee" if dtype == torch.float32 or upcast_dot(dtype) else "tf32"


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (kernels run on the CPU through numpy)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def upcast_dot(dtype: torch.dtype) -> bool:
    """The interpreter's tl.dot multiplies bf16 bit patterns as integers: upcast to fp32 there."""
    return interpreting() and dtype == torch.bfloat16
