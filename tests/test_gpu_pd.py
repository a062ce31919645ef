"""Prefill/decode disaggregation on two GPUs, the KV over NCCL: the pair gives the greedy tokens
of one server (float32, so both sides' kernels agree exactly), streamed or not, and killing the
decode server mid-stream ends the request with an error (tests/test_e2e_pd.py runs the same on
CPU with gloo)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import test_e2e_pd as cpu  # its test functions, run here on a GPU pair (not collected twice)
import torch
from test_e2e_pd import Pair, start_pair

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


@pytest.fixture
def gpu_pair(tmp_path: Path) -> Iterator[Pair]:
    p = start_pair(str(tmp_path), "--dtype", "float32", gpus=("0", "1"))
    yield p
    p.stop()


def test_a_gpu_pair_gives_the_tokens_of_one_server(gpu_pair: Pair) -> None:
    cpu.test_a_pd_pair_gives_the_tokens_of_one_server(gpu_pair)
    assert "KV transfer sent" in gpu_pair.prefill.log()
    assert cpu._chat(gpu_pair.client(), stream=True, max_tokens=64)[0]


def test_killing_the_decode_gpu_server_mid_stream_ends_the_request(gpu_pair: Pair) -> None:
    cpu.test_killing_the_decode_server_mid_stream_ends_the_request(gpu_pair)
