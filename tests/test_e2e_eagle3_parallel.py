"""EAGLE-3 end to end with several ranks on CPU (gloo, fp32): a tiny Llama served with
`--tp 2`, `--dp 2` and `--tp 2 --dp 2 --enable-dp-attention` answers greedy requests through the
real `openai` client with exactly the tokens of plain decoding on one rank, and drafts are
accepted (the head's draft vocabulary is the answers' most frequent tokens, so a random head is
sometimes right). A tiny Qwen3-MoE under data-parallel attention (lockstep: the eager path,
no verify graphs) too."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import openai
import pytest
from eagle3_head import make_head
from test_models_numerics import save_tiny_checkpoint
from tokenizers import Tokenizer
from transformers import LlamaConfig, Qwen3MoeConfig

from server_harness import start_server, stop_server

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a time"]
FLAGS = ("--max-total-tokens", "1024", "--max-running-requests", "4", "--page-size", "4",
         "--moe-backend", "torch_native")
TINY = {"vocab_size": 49152, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
        "bos_token_id": 1, "eos_token_id": 2}


def greedy(model_dir: Path, tmp: Path, *args: str, tokens: int = 24) -> tuple[list[str], dict]:
    """The server's greedy texts of PROMPTS (one at a time) and its engine counters."""
    srv = start_server(str(tmp), str(model_dir), *FLAGS, *args)
    try:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        name = c.models.list().data[0].id
        texts = [c.completions.create(model=name, prompt=p, max_tokens=tokens, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
                 for p in PROMPTS]
        return texts, srv.info()["engine"]
    finally:
        stop_server(srv)


def served(cfg: object, tmp: Path, seed: int) -> tuple[Path, list[str], list[str]]:
    """A tiny checkpoint, one rank's plain greedy texts, and the EAGLE-3 flags of a head whose
    draft vocabulary is the 3 most frequent tokens of those texts."""
    model_dir = tmp / "model"
    save_tiny_checkpoint(cfg, model_dir, seed=seed)
    ref, _ = greedy(model_dir, tmp)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    counts = Counter(i for t in ref for i in tok.encode(t, add_special_tokens=False).ids)
    target = json.loads((model_dir / "config.json").read_text())
    head = make_head(tmp / "head", target, draft_vocab=3, seed=1,
                     hot=[i for i, _ in counts.most_common(3)])
    # The acceptance rule off: a random head would pause speculation within a few steps, and
    # these runs check drafts accepted under each parallel layout.
    return model_dir, ref, ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                            str(head), "--speculative-num-steps", "3",
                            "--speculative-break-even-accept-length", "0"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], list[str]]:
    # 6 layers: the head's default capture layers (2, 3, 3) name one layer twice.
    return served(LlamaConfig(**TINY, num_hidden_layers=6), tmp_path_factory.mktemp("e3tp"), 7)


def assert_exact_and_accepted(got: tuple[list[str], dict], ref: list[str]) -> None:
    texts, engine = got
    assert len(set(ref)) == len(ref) and all(ref), ref  # the model is not degenerate
    assert texts == ref
    assert engine["spec_verify_steps"] > 0
    assert engine["spec_accepted_tokens"] > 0, engine


@pytest.mark.parametrize("parallel", [("--tp", "2"), ("--dp", "2"),
                                      ("--tp", "2", "--dp", "2", "--enable-dp-attention")],
                         ids=["tp2", "dp2", "dp_attention"])
def test_eagle3_gives_one_ranks_plain_tokens(llama: tuple, parallel: tuple[str, ...],
                                             tmp_path: Path) -> None:
    model_dir, ref, spec = llama
    assert_exact_and_accepted(greedy(model_dir, tmp_path, *spec, *parallel), ref)


def test_eagle3_under_lockstep_data_parallel_attention(tmp_path: Path) -> None:
    """MoE layers under data-parallel attention: every rank runs every step (lockstep), verify
    and draft steps eagerly; both attention groups answer as one plain rank."""
    cfg = Qwen3MoeConfig(**TINY, num_hidden_layers=6, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])
    model_dir, ref, spec = served(cfg, tmp_path, 5)
    got = greedy(model_dir, tmp_path, *spec, "--tp", "2", "--dp", "2", "--enable-dp-attention",
                 "--ep-size", "2")
    assert_exact_and_accepted(got, ref)
