"""The flashinfer backend's host-side pieces (its kernels run on the GPU: tests/test_gpu.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenspeed.layers.attention import check_backend
from tokenspeed.layers.flashinfer_attention import paged_kv_arrays


def test_paged_kv_arrays_lists_each_requests_pages_in_order() -> None:
    page_size = 4
    table = np.arange(60, dtype=np.int32).reshape(6, 10) + 100  # slot s, column j → 100 + 10s + j
    slots = np.asarray([3, 0, 5, 3])
    seq_lens = np.asarray([1, 4, 5, 13])
    indptr, indices, last = paged_kv_arrays(table, slots, seq_lens, page_size)
    assert indptr.tolist() == [0, 1, 2, 4, 8]
    assert indices.tolist() == [130, 100, 150, 151, 130, 131, 132, 133]
    assert last.tolist() == [1, 4, 1, 1]
    assert indptr.dtype == indices.dtype == last.dtype == np.int32


@pytest.mark.parametrize("seed", range(5))
def test_paged_kv_arrays_matches_a_per_request_loop(seed: int) -> None:
    rng = np.random.default_rng(seed)
    page_size = int(rng.choice([1, 3, 16]))
    table = rng.integers(0, 1000, size=(8, 40)).astype(np.int32)
    slots = rng.integers(0, 8, size=7)
    seq_lens = rng.integers(1, 40 * page_size + 1, size=7)
    indptr, indices, last = paged_kv_arrays(table, slots, seq_lens, page_size)
    want = []
    for i, (s, n) in enumerate(zip(slots, seq_lens)):
        pages = -(-int(n) // page_size)
        assert indptr[i + 1] - indptr[i] == pages
        assert 1 <= last[i] <= page_size and (pages - 1) * page_size + last[i] == n
        want.extend(table[s, :pages].tolist())
    assert indices.tolist() == want


def test_missing_flashinfer_or_a_cpu_device_is_a_clear_error() -> None:
    if importlib.util.find_spec("flashinfer") is None:
        with pytest.raises(ValueError, match="needs the flashinfer package"):
            check_backend("flashinfer")
    else:
        with pytest.raises(ValueError, match="runs on CUDA only"):
            check_backend("flashinfer", torch.device("cpu"))


def test_serve_with_an_unusable_flashinfer_backend_exits_with_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Checked before any worker starts: exit 1, the reason on one line, no traceback."""
    from tokenspeed.launch.cli import main

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                      "max_position_embeddings": 256}))
    rc = main(["serve", str(tmp_path), "--attention-backend", "flashinfer", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("tokenspeed serve: attention_backend 'flashinfer'") and "Traceback" not in err
    assert ("needs the flashinfer package" in err) != (importlib.util.find_spec("flashinfer") is not None)
