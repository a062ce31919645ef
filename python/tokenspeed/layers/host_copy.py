"""Host ↔ device copies that never make the host wait for the GPU.

A plain `tensor.to("cuda")` from pageable memory synchronizes the stream, so the host would
wait for every queued kernel: with one-step-ahead scheduling that serializes the worker again.
Here host arrays go through pinned memory with non-blocking copies. Pinned buffers come from
torch's caching host allocator, which does not hand a block out again until the copies that use
it have completed, so no buffer is overwritten while the GPU still reads it.
"""

from __future__ import annotations

import numpy as np
import torch

ALIGN = 16  # elements (128 bytes): where each array of a packed transfer starts


def to_device_int64(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Copies several host integer arrays to the device as int64 in one transfer; returns device
    views in the same order. Safe to call while the GPU is busy: the host does not wait.
    Every view starts 128-byte aligned: Triton specializes a kernel on whether each pointer is
    16-byte aligned, so a view at an odd offset (a step with an odd token count) would compile
    it again, mid-serving (~200-300 ms once on a fresh machine, session 13)."""
    starts = np.cumsum([0] + [-(-len(a) // ALIGN) * ALIGN for a in arrays])
    packed = np.zeros(int(starts[-1]), dtype=np.int64)
    for a, start in zip(arrays, starts):
        packed[start:start + len(a)] = a
    host = torch.from_numpy(packed)
    if device.type == "cuda":
        dev = host.pin_memory().to(device, non_blocking=True)
    else:
        dev = host  # `packed` is a fresh array: nothing else aliases it
    return [dev[start:start + len(a)] for a, start in zip(arrays, starts)]


class DeviceToHost:
    """Non-blocking device → host copies of a step's outputs, readable once the GPU is done.

    `ready()` polls without blocking; `wait()` blocks until the copies have landed.
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._event: torch.cuda.Event | None = None
        if tensors and tensors[0].is_cuda:
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(self.host, tensors):
                h.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self.host = [t.detach().clone() for t in tensors]

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> list[np.ndarray]:
        if self._event is not None:
            self._event.synchronize()
        return [h.numpy() for h in self.host]
