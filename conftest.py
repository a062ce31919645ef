"""Repo-wide pytest setup. Without a GPU, Triton kernels run in Triton's CPU interpreter; the
variable must be set before any module decorates a kernel, so it is set here, first of all."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
