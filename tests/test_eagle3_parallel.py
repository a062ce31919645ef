"""EAGLE-3 under tensor parallelism (CPU, gloo, fp32): the head is replicated (every rank loads
it whole and drafts from the same whole residual stream, all-reduced by the target's layers), so
both ranks of `--tp 2` draft exactly what one rank drafts, step after step; only rank 0's drafts
reach the scheduler, and no rank's head KV diverges from the plan every rank verifies."""

from __future__ import annotations

import json

import pytest
import torch
from eagle3_head import make_head
from tp_ranks import eagle3_drafts_on_rank, run_ranks
from transformers import LlamaConfig, LlamaForCausalLM

STEPS = 3


@pytest.fixture(scope="module")
def target_and_head(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("eagle_tp_target")
    LlamaForCausalLM(cfg).save_pretrained(path)
    head = make_head(path / "head", json.loads((path / "config.json").read_text()),
                     draft_vocab=120, seed=3, std=0.2)
    return str(path), str(head)


def test_tp2_ranks_draft_what_one_rank_drafts(target_and_head: tuple[str, str]) -> None:
    target, head = target_and_head
    prompt = [(37 * i) % 290 + 3 for i in range(11)]
    ref, ref_shapes = eagle3_drafts_on_rank(0, target, head, prompt, STEPS)
    ranks = run_ranks(eagle3_drafts_on_rank, 2, target, head, prompt, STEPS)
    for trace, shapes in ranks:
        assert shapes == ref_shapes  # whole on each rank, not a shard
        assert trace == ref
    assert all(len(d) == STEPS for _, d in ref)
