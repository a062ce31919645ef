"""Tensor parallelism on CPU (gloo, fp32): sharded layers recombine to the unsharded ones, TP
models give TP=1's greedy tokens through ModelRunner and through `tokenspeed serve --tp 3`, the
size checks name both values, and a dead rank fails the server fast."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from tp_ranks import generate_on_rank, layers_on_rank, run_ranks
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, Qwen3MoeConfig

from server_harness import Server, start_server, stop_server
from tokenspeed.distributed.groups import (
    ParallelConfigError,
    ParallelSizes,
    free_tcp_port,
    init_distributed,
    resolve_sizes,
)

# --- layers ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("world", "kv_options"), [(2, [1, 2, 6]), (3, [1, 3, 6])])
def test_sharded_layers_recombine(world: int, kv_options: list[int]) -> None:
    assert run_ranks(layers_on_rank, world, kv_options) == ["ok"] * world


# --- sizes -------------------------------------------------------------------------------------


def test_impossible_sizes_name_both_values() -> None:
    cases = [
        (ParallelSizes(world_size=4, attn_tp=4, dense_tp=3, moe_tp=4), ["--dense-tp-size 3", "4"]),
        (ParallelSizes(world_size=4, attn_tp=2, dense_tp=2, moe_tp=4, nnodes=2),
         ["--attn-tp-size 2", "--nnodes 2"]),
        (ParallelSizes(world_size=8, attn_tp=4, dense_tp=8, moe_tp=8), ["--dense-tp-size 8", "4"]),
        (ParallelSizes(world_size=4, attn_tp=4, dense_tp=4, moe_tp=2), ["--moe-tp-size 2", "4"]),
        (ParallelSizes(world_size=3, attn_tp=3, dense_tp=3, moe_tp=3, nnodes=2), ["3", "2"]),
    ]
    for sizes, words in cases:
        with pytest.raises(ParallelConfigError) as info:
            sizes.check()
        for w in words:
            assert w in str(info.value), (str(info.value), w)
    ParallelSizes(world_size=4, attn_tp=4, dense_tp=2, moe_tp=2, ep=2).check()


def test_expert_parallel_sizes() -> None:
    """--ep-size N takes N ranks' worth of experts each, MoE TP the rest of the world;
    --enable-expert-parallel (vLLM) is EP over the whole world."""
    s = resolve_sizes(tp_size=4, ep_size=2)
    assert (s.world_size, s.ep, s.moe_tp) == (4, 2, 2)
    s = resolve_sizes(tp_size=2, enable_expert_parallel=True)
    assert (s.world_size, s.ep, s.moe_tp) == (2, 2, 1)
    assert resolve_sizes(tp_size=4, ep_size=4, enable_expert_parallel=True).ep == 4
    with pytest.raises(ParallelConfigError, match="--world-size 4 ranks, but --ep-size is 2"):
        resolve_sizes(tp_size=4, ep_size=2, enable_expert_parallel=True)
    with pytest.raises(ParallelConfigError, match="--ep-size 3 does not divide --world-size 2"):
        resolve_sizes(tp_size=2, ep_size=3)


def test_heads_must_split_over_the_ranks() -> None:
    two = ParallelSizes(world_size=2, attn_tp=2, dense_tp=2, moe_tp=2)
    with pytest.raises(ParallelConfigError, match="9 attention heads .* --tp-size 2"):
        two.check_model(9, 3, 1536)  # SmolLM2-135M
    ParallelSizes(world_size=3, attn_tp=3, dense_tp=3, moe_tp=3).check_model(9, 3, 1536)
    six = ParallelSizes(world_size=6, attn_tp=6, dense_tp=6, moe_tp=6)
    six.check_model(12, 2, 1536)  # each KV head replicated on three ranks
    with pytest.raises(ParallelConfigError, match="4 KV heads"):
        six.check_model(12, 4, 1536)


# --- models through ModelRunner ----------------------------------------------------------------


PROMPTS = [[(7 * i + 3 * j) % 240 + 3 for j in range(n)] for i, n in enumerate([3, 17, 9])]
NEW_TOKENS = 8


_TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "max_position_embeddings": 256}
TINY = {
    # One KV head for two ranks (replicated), an odd vocab (padded shards), tied embeddings.
    "llama_mqa_odd_vocab": LlamaConfig(**_TINY, vocab_size=251, num_key_value_heads=1,
                                       tie_word_embeddings=True),
    "qwen3_qk_norm": Qwen3Config(**_TINY, vocab_size=256, num_key_value_heads=2, head_dim=32),
    # MoE layers under TP: each rank holds half of every expert (moe-TP 2), partials all-reduced;
    # layer 1 stays dense.
    "qwen3_moe": Qwen3MoeConfig(**_TINY, vocab_size=256, num_key_value_heads=2, num_experts=8,
                                num_experts_per_tok=2, moe_intermediate_size=32,
                                norm_topk_prob=True, mlp_only_layers=[1]),
}


def _tiny_checkpoint(tmp_path: Path, name: str) -> str:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(TINY[name]).eval()
    with torch.no_grad():  # weights far from the init scale, so that a wrong shard shows
        for pname, p in model.named_parameters():
            if "norm" in pname:  # scales near 1: every layer's output must count
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(tmp_path)
    return str(tmp_path)


def _assert_same_as_tp1(path: str, world: int, prompts: list[list[int]], n: int,
                        load_format: str = "auto") -> None:
    ref_tokens, ref_logits, _ = generate_on_rank(0, path, prompts, n, load_format=load_format)
    tokens, logits, _ = run_ranks(generate_on_rank, world, path, prompts, n, None, False,
                                  load_format)[0]
    assert tokens == ref_tokens
    worst = max(abs(a - b).max() for ours, ref in zip(logits, ref_logits) for a, b in zip(ours, ref))
    assert worst < 1e-3, f"max |logit diff| TP={world} vs TP=1: {worst}"


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_model_tp2_matches_tp1(tmp_path: Path, name: str) -> None:
    _assert_same_as_tp1(_tiny_checkpoint(tmp_path, name), 2, PROMPTS, NEW_TOKENS)


def test_dummy_weights_are_the_same_model_at_any_tp(tmp_path: Path) -> None:
    """Dummy weights are drawn per full tensor and cut, so TP=2 serves TP=1's model."""
    _assert_same_as_tp1(_tiny_checkpoint(tmp_path, "qwen3_qk_norm"), 2, PROMPTS, NEW_TOKENS,
                        load_format="dummy")


@pytest.mark.parametrize(("moe_tp", "ep"), [(1, 2), (2, 1)], ids=["ep2", "moe_tp2"])
def test_dummy_moe_weights_are_the_same_model_at_any_ep(tmp_path: Path, moe_tp: int, ep: int) -> None:
    """Dummy experts are drawn whole and cut (by expert under EP, by intermediate slice under
    moe-TP), so EP=2 serves EP=1's model: a GPU EP check on dummy weights compares like with like."""
    path = _tiny_checkpoint(tmp_path, "qwen3_moe")
    ref_tokens, ref_logits, _ = generate_on_rank(0, path, PROMPTS, NEW_TOKENS, load_format="dummy")
    sizes = ParallelSizes(world_size=2, attn_tp=2, dense_tp=2, moe_tp=moe_tp, ep=ep)
    tokens, logits, _ = run_ranks(generate_on_rank, 2, path, PROMPTS, NEW_TOKENS, None, False,
                                  "dummy", sizes=sizes)[0]
    assert max(abs(a - b).max() for o, r in zip(logits, ref_logits) for a, b in zip(o, r)) < 1e-5
    assert tokens == ref_tokens


def test_split_tp_dense_layers_replicated_under_attention_tp(tmp_path: Path) -> None:
    """--tp 2 --dense-tp-size 1: attention split over two ranks, each MLP whole on both."""
    path = _tiny_checkpoint(tmp_path, "qwen3_qk_norm")
    ref_tokens, ref_logits, _ = generate_on_rank(0, path, PROMPTS, NEW_TOKENS)
    sizes = ParallelSizes(world_size=2, attn_tp=2, dense_tp=1, moe_tp=2)
    tokens, logits, _ = run_ranks(generate_on_rank, 2, path, PROMPTS, NEW_TOKENS, sizes=sizes)[0]
    assert tokens == ref_tokens
    assert max(abs(a - b).max() for o, r in zip(logits, ref_logits) for a, b in zip(o, r)) < 1e-3


@pytest.mark.parametrize("all2all", ["naive", "torch_all2all"])
def test_expert_parallel_2_matches_tp1(tmp_path: Path, all2all: str) -> None:
    """--tp 2 --ep-size 2: attention split, each rank holds 4 of the 8 experts whole; partial
    outputs all-reduced (naive), or each rank sends half the tokens to the experts' ranks."""
    path = _tiny_checkpoint(tmp_path, "qwen3_moe")
    ref_tokens, ref_logits, _ = generate_on_rank(0, path, PROMPTS, NEW_TOKENS)
    sizes = ParallelSizes(world_size=2, attn_tp=2, dense_tp=2, moe_tp=1, ep=2,
                          all2all_backend=all2all)
    tokens, logits, _ = run_ranks(generate_on_rank, 2, path, PROMPTS, NEW_TOKENS, sizes=sizes)[0]
    assert tokens == ref_tokens
    assert max(abs(a - b).max() for o, r in zip(logits, ref_logits) for a, b in zip(o, r)) < 1e-3


def test_a_rank_that_never_joins_fails_naming_itself() -> None:
    with pytest.raises(RuntimeError, match=r"rank 0 of 2: could not form the process group"):
        init_distributed(0, ParallelSizes(world_size=2, attn_tp=2, dense_tp=2, moe_tp=2),
                         f"tcp://127.0.0.1:{free_tcp_port()}", torch.device("cpu"), timeout_s=2)


def test_every_rank_keeps_rank0s_sampled_tokens(tmp_path: Path) -> None:
    """Ranks seeded differently would draw different tokens; every rank must still feed rank
    0's draws back as the next inputs (LAST_SAMPLED reads last_tokens)."""
    path = _tiny_checkpoint(tmp_path, "qwen3_qk_norm")
    sampling = {"temperature": [1.0] * len(PROMPTS)}
    ranks = run_ranks(generate_on_rank, 2, path, PROMPTS, NEW_TOKENS, sampling, True)
    (tokens0, _, last0), (tokens1, _, last1) = ranks
    assert tokens0 == tokens1 and last0 == last1
    alone = [generate_on_rank(0, path, PROMPTS, NEW_TOKENS, sampling, True)[0] for _ in range(2)]
    assert alone[0] == alone[1]  # seeded: the draws above are rank 0's, not luck


def test_smollm2_tp3_matches_tp1() -> None:
    from test_models_numerics import smollm2_dir

    prompts = [[1, 504, 3575, 282, 4649, 314], [1, 9690, 42, 2683]]
    _assert_same_as_tp1(str(smollm2_dir()), 3, prompts, NEW_TOKENS)


# --- end to end: `tokenspeed serve --tp 3` ------------------------------------------------------

E2E_PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
E2E_FLAGS = ("--max-total-tokens", "2048", "--max-running-requests", "8", "--page-size", "4")


def _greedy_texts(srv: Server) -> list[str]:
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    return [client.completions.create(model=model, prompt=p, max_tokens=12, temperature=0)
            .choices[0].text for p in E2E_PROMPTS]


def test_serve_tp3_gives_tp1_tokens_and_a_dead_rank_fails_fast(tmp_path: Path) -> None:
    """SmolLM2 (9 heads, 3 KV heads) on three gloo ranks answers exactly like one rank; killing
    one rank turns /health to 503 at once, the server logs that rank, then exits non-zero."""
    srv = start_server(str(tmp_path), *E2E_FLAGS)
    try:
        ref = _greedy_texts(srv)
    finally:
        stop_server(srv)
    srv = start_server(str(tmp_path), "--tp", "3", *E2E_FLAGS)
    try:
        info = srv.info()
        assert info["parallel"]["world_size"] == 3 and len(info["worker_pids"]) == 3
        assert _greedy_texts(srv) == ref
        assert "Paris" in ref[0]
        victim = info["worker_pids"][2]
        assert f"rank 2 pid {victim}" in srv.log()
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while httpx.get(f"{srv.url}/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "the server still looks healthy with a dead rank"
            time.sleep(0.2)
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       timeout=10)
        assert r.status_code == 503
        assert f"worker process {victim} exited" in srv.log()  # the Rust core names the pid
        # ... and the launcher names the rank, then stops the server with a non-zero exit.
        assert srv.proc.wait(timeout=60) != 0
        assert f"worker rank 2 of 3 (pid {victim}) was killed by SIGKILL" in srv.log()
    finally:
        stop_server(srv)


def test_serve_refuses_heads_that_do_not_split(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "tokenspeed.launch.cli", "serve", "--device", "cpu", "--tp", "2"]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "9 attention heads do not split over --tp-size 2" in out.stderr, out.stderr
