"""NEXTN end to end on several ranks (CPU, gloo, fp32): a tiny random DeepSeek-V3 with its MTP
layer (tests/deepseek_mtp_model.py, SmolLM2's tokenizer) served with `--tp 2` (the MTP layer's
MLA heads and experts sharded as the target's) and with `--tp 2 --dp 2 --enable-dp-attention
--ep-size 2` (MoE layers in lockstep: every rank runs every draft pass, an idle group on a
padding row) answers greedy requests through the real `openai` client with exactly the tokens
of plain decoding on one rank, and drafts are accepted: the target's and the MTP layer's output
heads only ever pick among the same 8 words (rows r, -r, ...: one of each pair's logits is
>= 0, every other row is 0), so a random MTP layer is sometimes right."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
from deepseek_mtp_model import make_mtp_model
from safetensors.torch import load_file, save_file
from test_e2e_eagle3_parallel import FLAGS, PROMPTS, assert_exact_and_accepted, greedy
from test_models_numerics import smollm2_dir
from tokenizers import Tokenizer

from server_harness import start_server, stop_server

# The acceptance rule off (as in test_e2e_eagle3_parallel): a random MTP layer would pause
# speculation within a few steps, and these runs check drafts accepted under each layout.
NEXTN = ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
         "--speculative-break-even-accept-length", "0")
WORDS = " the cat sat on a mat by dog"


def hot_heads(model_dir: Path, n_layers: int, hot: list[int]) -> None:
    """The target's `lm_head` and the MTP layer's `shared_head.head` rewritten so that each
    one's argmax is always one of `hot` (their own random rows)."""
    (file,) = sorted(model_dir.glob("*.safetensors"))
    tensors = load_file(str(file))
    g = torch.Generator().manual_seed(3)
    for name in ("lm_head.weight", f"model.layers.{n_layers}.shared_head.head.weight"):
        w = torch.zeros_like(tensors[name])
        for a, b in zip(hot[0::2], hot[1::2]):
            w[a] = torch.randn(w.shape[1], generator=g)
            w[b] = -w[a]
        tensors[name] = w
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The checkpoint and one plain rank's greedy answers."""
    tmp = tmp_path_factory.mktemp("nextn_tp")
    model_dir = tmp / "model"
    m = make_mtp_model(model_dir, vocab_size=49152, max_position_embeddings=512)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir() / name, model_dir / name)
    hot = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(
        WORDS, add_special_tokens=False).ids
    assert len(hot) == 8, hot
    hot_heads(model_dir, m.target.config.num_hidden_layers, hot)
    ref, _ = greedy(model_dir, tmp)
    return model_dir, ref


@pytest.mark.parametrize("parallel", [("--tp", "2"),
                                      ("--tp", "2", "--dp", "2", "--enable-dp-attention",
                                       "--ep-size", "2")],
                         ids=["tp2", "dp_attention_ep2"])
def test_nextn_gives_one_ranks_plain_tokens(served: tuple[Path, list[str]],
                                            parallel: tuple[str, ...], tmp_path: Path) -> None:
    model_dir, ref = served
    assert_exact_and_accepted(greedy(model_dir, tmp_path, *NEXTN, *parallel), ref)


def test_one_rank_accepts_drafts_too(served: tuple[Path, list[str]],
                                                     tmp_path: Path) -> None:
    # The baseline of the two above: one rank with NEXTN, the same tokens, drafts accepted.
    model_dir, ref = served
    assert_exact_and_accepted(greedy(model_dir, tmp_path, *NEXTN), ref)


def test_both_attention_groups_draft_at_once(served: tuple[Path, list[str]],
                                             tmp_path: Path) -> None:
    """All prompts at once under data-parallel attention: both groups draft in the same lockstep
    passes, with unequal row counts (each group's own batch)."""
    model_dir, ref = served
    srv = start_server(str(tmp_path), str(model_dir), *FLAGS, *NEXTN, "--tp", "2", "--dp", "2",
                       "--enable-dp-attention", "--ep-size", "2")
    try:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        name = c.models.list().data[0].id

        def one(prompt: str) -> str:
            return c.completions.create(model=name, prompt=prompt, max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True}).choices[0].text

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(one, PROMPTS))
        engine = srv.info()["engine"]
    finally:
        stop_server(srv)
    assert_exact_and_accepted((texts, engine), ref)
