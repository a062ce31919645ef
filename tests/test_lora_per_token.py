"""LoRA's per-token path (the one CUDA graphs capture) through ModelRunner on CPU: every step
forced onto it, the Triton kernels in the interpreter. Each adapted projection is one stacked
GEMM ([W; A_0; A_1], the base weight a view of it) and one merge kernel; a batch mixing two
adapters and the base model still gives HF PEFT's logits at every token.

TRITON_INTERPRET=1 is set here before tokenspeed_kernels is first imported; if another test
module imported it earlier in this process without the interpreter, the check re-runs in a
subprocess (as tests/test_triton_backend.py does).
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

_PREIMPORTED = "tokenspeed_kernels" in sys.modules
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from test_lora_runner import _peft_logits, _run, tiny  # noqa: F401 (a fixture)

from tokenspeed.layers.lora import LoraWeights
from tokenspeed.worker.lora import LoraPool


def _needs_subprocess() -> bool:
    return (_PREIMPORTED and not torch.cuda.is_available()
            and os.environ.get("TRITON_INTERPRET") != "1")


def test_per_token_stacked_path_matches_peft(tiny: tuple[str, dict[str, str]],  # noqa: F811
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    if _needs_subprocess():
        env = dict(os.environ, TRITON_INTERPRET="1")
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              __file__], check=False, env=env, capture_output=True, text=True,
                             timeout=600)
        assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
        return
    prepare, merge = LoraPool.prepare, LoraWeights.merge
    merges: list[int] = []

    def per_token(self: LoraPool, plan, per_token: bool) -> None:
        assert all(layer.lora is not None and layer.lora.stacked is not None
                   for layer in self.layers.values()), "every tiny-Llama projection stacks"
        self.batch.kernels = True
        prepare(self, plan, per_token=True)

    def counted(self: LoraWeights, out: torch.Tensor) -> torch.Tensor:
        merges.append(out.shape[0])
        return merge(self, out)

    monkeypatch.setattr(LoraPool, "prepare", per_token)
    monkeypatch.setattr(LoraWeights, "merge", counted)
    path, adapters = tiny
    runs = ["all", None, "qv"]
    tokens, logits = _run(path, adapters, runs)
    assert merges, "the stacked GEMM + merge ran"
    want = _peft_logits(path, adapters, runs, tokens)
    for got, ref, name in zip(logits, want, runs):
        assert (got - ref).abs().max().item() < 1e-3, name
        assert got.argmax(-1).tolist() == ref.argmax(-1).tolist(), name


def test_adapter_rows_and_plain_mode(tiny: tuple[str, dict[str, str]]) -> None:  # noqa: F811
    """What picks the decode graphs without LoRA: `adapter_rows` after prepare (a step with
    only base-model rows has none), and `plain()` turns LoRA off inside, back on after."""
    from tokenspeed.worker.model_runner import ModelRunner
    from tokenspeed.worker.plan import StepPlan

    path, adapters = tiny
    lora = {"targets": ["q_proj", "v_proj"], "max_rank": 8, "pool_slots": 2, "max_loaded": None,
            "eviction": "lru"}
    pool = ModelRunner(path, page_size=4, max_slots=4, max_context_len=64, lora=lora).lora
    assert pool is not None
    # The graphs' extra activation: qkv_proj, the one adapted layer: 128 rows + 2 slots x 3 x 8.
    assert pool.stacked_bytes(4) == 4 * (128 + 48) * 4
    pool.admit(0, 0, "")
    pool.admit(1, 1, adapters["qv"])
    pool.prepare(StepPlan.of(sched_slot=[0], sched_tokens_len=[1]), per_token=True)
    assert not pool.adapter_rows and pool.batch.active
    assert (pool.batch.token_slot == -1).all()
    pool.prepare(StepPlan.of(sched_slot=[0, 1], sched_tokens_len=[1, 1]), per_token=True)
    assert pool.adapter_rows and pool.batch.token_slot[:2].tolist() == [-1, 0]
    with pool.plain():
        assert not pool.batch.active and not pool.batch.per_token
    assert pool.batch.active and pool.batch.per_token
