"""Data-parallel attention end to end on CPU (gloo): `tokenspeed serve --tp 2 --dp 2
--enable-dp-attention --ep-size 2` is one world of two ranks in two attention groups (one engine,
radix cache and KV pool each) sharing a tiny random Qwen3-MoE's experts. Its greedy text equals
one rank's for a concurrent batch that lands on both groups and for a lone request (the other
group runs idle forward passes every step); a dense tiny Llama under it too; a killed rank stops
the server; the sizes resolve as seed 001's split example says; and the MoE exchange itself, on
two gloo ranks with unequal token counts, gives each group exactly its rows of one rank's output;
a tiny DeepSeek-V3 (MLA, grouped routing) gives one rank's text under it too.
`--all2all-backend torch_all2all` (tokens sent only to the ranks holding their experts) too: the
same text with and without attention groups, and one rank's MoE output layer by layer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from test_e2e_expert_parallel import moe_dir  # noqa: F401  (the tiny Qwen3-MoE fixture)
from test_models_families import DEEPSEEK_V3
from test_models_numerics import save_tiny_checkpoint
from tp_ranks import (
    generate_on_rank,
    lockstep_generate_on_rank,
    lockstep_tick_on_rank,
    moe_all_gather_on_rank,
    moe_all_to_all_on_rank,
    run_ranks,
    world_min_on_rank,
)
from transformers import LlamaConfig

from server_harness import Server, start_server, stop_server
from tokenspeed.distributed.groups import (
    ParallelConfigError,
    ParallelSizes,
    Tick,
    dp_graph_batch,
    dp_token_counts,
    lockstep_forward,
    resolve_sizes,
)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a time"]
NEW_TOKENS = 8
FLAGS = ("--max-total-tokens", "1024", "--max-running-requests", "4", "--page-size", "4",
         "--moe-backend", "torch_native")
DP_ATTENTION = ("--tp", "2", "--dp", "2", "--enable-dp-attention")


def test_sizes_of_data_parallel_attention() -> None:
    s = resolve_sizes(tp_size=4, world_size=8, ep_size=8)  # seed 001: --world-size 8 --attn-tp-size 4
    assert (s.world_size, s.attn_tp, s.attn_dp, s.dense_tp, s.ep, s.moe_tp) == (8, 4, 2, 4, 8, 1)
    s = resolve_sizes(tp_size=2, ep_size=2, dp_attention=2)  # --tp 2 --dp 2 --enable-dp-attention
    assert (s.world_size, s.attn_tp, s.attn_dp, s.ep) == (2, 1, 2, 2)
    with pytest.raises(ParallelConfigError, match="--dp-size 3: it does not divide the world of 4"):
        resolve_sizes(tp_size=4, dp_attention=3)
    with pytest.raises(ParallelConfigError, match="--dense-tp-size 4 is larger than --attn-tp-size 2"):
        resolve_sizes(tp_size=4, dense_tp_size=4, dp_attention=2)


def test_all2all_backend_travels_with_the_sizes_and_decides_graphs() -> None:
    s = resolve_sizes(tp_size=2, ep_size=2)
    assert s.all2all_backend == "naive" and s.graph_capturable(moe=True)
    assert s.extend_graph_capturable(moe=True) and not s.lockstep(moe=True)
    # naive under data-parallel attention gathers the groups' tokens: no rank holds them all.
    # Decode steps replay graphs padded to one size on every rank; prompt steps stay eager.
    s = resolve_sizes(tp_size=2, ep_size=2, dp_attention=2)
    assert s.all2all_backend == "allgather_reducescatter" and s.lockstep(moe=True)
    assert s.graph_capturable(moe=True) and not s.extend_graph_capturable(moe=True)
    # A dense model's attention groups never meet: graphs of every kind, no lockstep.
    assert s.extend_graph_capturable(moe=False) and not s.lockstep(moe=False)
    for dp in (1, 2):  # split sizes read on the host every layer: eager either way
        s = resolve_sizes(tp_size=2, ep_size=2, dp_attention=dp, all2all_backend="torch_all2all")
        assert s.all2all_backend == "torch_all2all" and not s.graph_capturable(moe=True)
        assert s.graph_capturable(moe=False)  # no MoE layer: nothing goes through it
    # One rank: no exchange.
    assert resolve_sizes(all2all_backend="torch_all2all").graph_capturable(moe=True)
    with pytest.raises(ParallelConfigError, match="--all2all-backend 'pplx' is not one of"):
        resolve_sizes(tp_size=2, all2all_backend="pplx")


# A grammar-constrained request: its masks come from the engine after the step in flight, so
# the worker waits for them between its forward pass and sampling, inside a lockstep step.
REGEX = {"regex": "[a-z]{2,5}-[0-9]{3}"}


def _serve_fails(*args: str) -> str:
    cmd = [sys.executable, "-m", "tokenspeed.launch.cli", "serve", "--device", "cpu", *args]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0, out.stdout + out.stderr
    return out.stderr


def test_serve_refuses_what_dp_attention_cannot_do(moe_dir: Path) -> None:  # noqa: F811
    err = _serve_fails(str(moe_dir), "--tp", "2", "--enable-dp-attention")
    assert "--enable-dp-attention with --dp-size 1" in err, err
    err = _serve_fails(str(moe_dir), "--world-size", "4", "--tp", "2", "--dp", "2")
    assert "--dp-size 2 replicas of a world with data-parallel attention" in err, err


def _greedy(srv: Server, prompts: list[str], concurrent: bool,
            extra: dict | None = None) -> list[str]:
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    def one(p: str) -> str:
        return client.completions.create(model=model, prompt=p, max_tokens=NEW_TOKENS,
                                         temperature=0, extra_body={"ignore_eos": True, **(extra or {})}
                                         ).choices[0].text

    if not concurrent:
        return [one(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _reference(model_dir: Path, tmp_path: Path) -> tuple[list[str], str]:
    """One rank's greedy texts of PROMPTS, and of PROMPTS[1] under REGEX."""
    srv = start_server(str(tmp_path), str(model_dir), *FLAGS)
    try:
        ref = _greedy(srv, PROMPTS, concurrent=False), _greedy(srv, PROMPTS[1:2], False, REGEX)[0]
    finally:
        stop_server(srv)
    assert len(set(ref[0])) == len(ref[0]) and all(ref[0]), ref  # the model is not degenerate
    return ref


@pytest.fixture(scope="module")
def moe_ref(moe_dir: Path, tmp_path_factory: pytest.TempPathFactory  # noqa: F811
            ) -> tuple[list[str], str]:
    return _reference(moe_dir, tmp_path_factory.mktemp("moe_ref"))


def test_moe_dp_attention_gives_one_ranks_text_and_a_dead_rank_stops_it(
        moe_dir: Path, moe_ref: tuple[list[str], str], tmp_path: Path) -> None:  # noqa: F811
    ref, ref_regex = moe_ref
    srv = start_server(str(tmp_path), str(moe_dir), *DP_ATTENTION, "--ep-size", "2", *FLAGS)
    try:
        info = srv.info()
        p = info["parallel"]
        assert (p["world_size"], p["attn_tp_size"], p["attn_dp_size"], p["ep_size"]) == (2, 1, 2, 2)
        assert p["all2all_backend"] == "allgather_reducescatter"
        # A batch spread over both attention groups, then one request alone (the other group
        # idles through every step of it), then the batch again on warm caches.
        assert _greedy(srv, PROMPTS, concurrent=True) == ref
        alone = _greedy(srv, PROMPTS[:1], concurrent=False)
        assert alone == ref[:1]
        assert _greedy(srv, PROMPTS[1:2], False, REGEX) == [ref_regex]
        replicas = srv.info()["replicas"]
        assert len(replicas) == 2 and all(r["routed"] >= 2 and r["steps"] > 0 for r in replicas), \
            replicas
        assert _greedy(srv, PROMPTS, concurrent=True) == ref
        log = srv.log()
        assert "ep rank 0/2 holds experts [0, 4)" in log and "ep rank 1/2 holds experts [4, 8)" in log
        assert "attention group 1/2" in log
        # A rank dies: the server stops non-zero, naming it (its group's engine fails; the
        # other group's rank is left waiting in a collective and is stopped with the server).
        victim = info["worker_pids"][1]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while httpx.get(f"{srv.url}/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "the server still looks healthy with a dead rank"
            time.sleep(0.2)
        assert srv.proc.wait(timeout=60) != 0, srv.log()
        assert "worker rank 1 of 2" in srv.log() and "was killed by SIGKILL" in srv.log(), srv.log()
    finally:
        stop_server(srv)


def test_attention_groups_of_two_ranks_give_one_ranks_text(
        moe_dir: Path, moe_ref: tuple[list[str], str], tmp_path: Path) -> None:  # noqa: F811
    """Seed 001's split shape, small: --world-size 4 --attn-tp-size 2, experts over EP 2 x MoE-TP
    2. Two ranks read each group's ring, and one may see a plan before the other."""
    ref, _ = moe_ref
    srv = start_server(str(tmp_path), str(moe_dir), "--world-size", "4", "--attn-tp-size", "2",
                       "--ep-size", "2", *FLAGS)
    try:
        p = srv.info()["parallel"]
        assert (p["world_size"], p["attn_tp_size"], p["attn_dp_size"], p["moe_tp_size"]) == \
            (4, 2, 2, 2)
        assert _greedy(srv, PROMPTS, concurrent=True) == ref
        assert _greedy(srv, PROMPTS[2:3], concurrent=False) == ref[2:3]
    finally:
        stop_server(srv)


@pytest.mark.parametrize("layout", [("--tp", "2", "--ep-size", "2"),
                                    (*DP_ATTENTION, "--ep-size", "2")], ids=["ep2", "dp2-ep2"])
def test_moe_torch_all2all_gives_one_ranks_text(
        moe_dir: Path, moe_ref: tuple[list[str], str], tmp_path: Path,  # noqa: F811
        layout: tuple[str, ...]) -> None:
    """Tokens sent only to the ranks holding their experts (all_to_all_single over gloo), with
    attention TP replicating them (each rank dispatches half: a lone decode token leaves rank 0
    only) and with attention groups of their own."""
    ref, _ = moe_ref
    srv = start_server(str(tmp_path), str(moe_dir), *layout, "--all2all-backend", "torch_all2all",
                       *FLAGS)
    try:
        assert srv.info()["parallel"]["all2all_backend"] == "torch_all2all"
        assert _greedy(srv, PROMPTS, concurrent=True) == ref
        assert _greedy(srv, PROMPTS[:1], concurrent=False) == ref[:1]
    finally:
        stop_server(srv)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama_dpattn")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    save_tiny_checkpoint(cfg, path, seed=7)
    return path


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny DeepSeek-V3 (test_models_families' config) with SmolLM2's vocabulary."""
    path = tmp_path_factory.mktemp("deepseek_dpattn")
    cfg = DEEPSEEK_V3.__class__.from_dict({**DEEPSEEK_V3.to_dict(), "vocab_size": 49152})
    save_tiny_checkpoint(cfg, path, seed=5)
    return path


def test_deepseek_dp_attention_gives_one_ranks_text(deepseek_dir: Path, tmp_path: Path) -> None:
    """Issue 39's layout, small: each group's MLA over its own requests, DeepSeek-V3's routing
    (sigmoid, bias, grouped top-k) carried with the tokens to the experts over EP 2."""
    ref, ref_regex = _reference(deepseek_dir, tmp_path)
    srv = start_server(str(tmp_path), str(deepseek_dir), *DP_ATTENTION, "--ep-size", "2", *FLAGS)
    try:
        assert _greedy(srv, PROMPTS, concurrent=True) == ref
        assert _greedy(srv, PROMPTS[1:2], False, REGEX) == [ref_regex]
    finally:
        stop_server(srv)


def test_dense_dp_attention_gives_one_ranks_text(llama_dir: Path, tmp_path: Path) -> None:
    """Dense layers stay inside an attention group, so the groups never meet in a collective."""
    ref, _ = _reference(llama_dir, tmp_path)
    srv = start_server(str(tmp_path), str(llama_dir), *DP_ATTENTION, *FLAGS)
    try:
        assert srv.info()["parallel"]["attn_dp_size"] == 2
        assert _greedy(srv, PROMPTS, concurrent=True) == ref
    finally:
        stop_server(srv)


@pytest.mark.parametrize(("sizes", "counts"), [
    (ParallelSizes(world_size=2, attn_tp=1, dense_tp=1, moe_tp=1, ep=2), [3, 1]),
    (ParallelSizes(world_size=2, attn_tp=1, dense_tp=1, moe_tp=1, ep=2), [1, 5]),
    # Two groups of two ranks, experts over EP 2 x MoE-TP 2: the all-reduce over attn_tp counts.
    (ParallelSizes(world_size=4, attn_tp=2, dense_tp=2, moe_tp=2, ep=2), [2, 3]),
], ids=["2ranks-3-1", "2ranks-1-5", "4ranks-2-3"])
def test_moe_all_gather_gives_each_group_its_rows(sizes: ParallelSizes, counts: list[int]) -> None:
    world = sizes.world_size
    assert run_ranks(moe_all_gather_on_rank, world, counts, sizes=sizes) == ["ok"] * world


A2A_LAYOUTS = {  # sizes, and (tokens per attention group, routing) per case
    # Plain EP: both ranks hold the same tokens and each dispatches half (none with one token).
    "ep2": (ParallelSizes(world_size=2, attn_tp=2, dense_tp=2, moe_tp=1, ep=2,
                          all2all_backend="torch_all2all"),
            [([5], "random"), ([1], "random"), ([4], "first"), ([3], "last")]),
    "dp2-ep2": (ParallelSizes(world_size=2, attn_tp=1, dense_tp=1, moe_tp=1, ep=2,
                              all2all_backend="torch_all2all"),
                [([3, 1], "random"), ([1, 5], "last"), ([2, 2], "first")]),
    # Two groups of two ranks (each dispatching half its group's tokens), EP 2 x MoE-TP 2: each
    # token goes to both MoE-TP ranks of an EP rank holding its experts.
    "dp2-attntp2-ep2-moetp2": (ParallelSizes(world_size=4, attn_tp=2, dense_tp=2, moe_tp=2, ep=2,
                                             all2all_backend="torch_all2all"),
                               [([2, 3], "random"), ([1, 4], "first")]),
}


@pytest.mark.parametrize("layout", list(A2A_LAYOUTS))
def test_moe_all_to_all_gives_one_ranks_output(layout: str) -> None:
    sizes, cases = A2A_LAYOUTS[layout]
    world = sizes.world_size
    assert run_ranks(moe_all_to_all_on_rank, world, cases, sizes=sizes) == ["ok"] * world


# --- decode CUDA graphs under data-parallel attention -----------------------------------------


def _tick(tokens: list[int], decode: list[bool]) -> Tick:
    return Tick(runs_plan=[t > 0 for t in tokens], tokens=tokens, stop=False, decode=decode)


def test_tick_pads_every_group_to_one_graph_size_when_all_decode() -> None:
    sizes = [1, 2, 4, 8, 16, 24]
    # The largest group's requests, rounded up to a captured size; an idle group pads too.
    assert _tick([3, 1], [True, True]).graph_batch(sizes) == 4
    assert _tick([0, 5], [True, True]).graph_batch(sizes) == 8
    assert _tick([17, 2, 0, 1], [True] * 4).graph_batch(sizes) == 24
    assert _tick([8, 8], [True, True]).graph_batch(sizes) == 8
    # Eager for every rank: a group with prompt tokens, more requests than the largest graph,
    # no forward pass at all, or no graphs.
    assert _tick([3, 9], [True, False]).graph_batch(sizes) is None
    assert _tick([25, 1], [True, True]).graph_batch(sizes) is None
    assert _tick([0, 0], [True, True]).graph_batch(sizes) is None
    assert _tick([3, 1], [True, True]).graph_batch([]) is None
    # The padded step's counts: every group the graph's size, in both MoE exchanges' eyes.
    with lockstep_forward(_tick([3, 0], [True, True]), sizes):
        assert dp_graph_batch() == 4
    with lockstep_forward(_tick([3, 6], [True, False]), sizes):
        assert dp_graph_batch() is None
    with pytest.raises(ValueError, match="padded decode step of 4 rows per group with counts"), \
            dp_token_counts([4, 3], graph_batch=4):
        pass


def test_lockstep_tick_carries_each_groups_decode_flag() -> None:
    """Two groups of two ranks. Group 0: only rank 1 holds its decode plan yet (rank 0, with
    no plan, has no say). Group 1: both hold a plan with prompt tokens (not decode-only)."""
    sizes = ParallelSizes(world_size=4, attn_tp=2, dense_tp=2, moe_tp=2, ep=2)
    rows = [(False, 0, False), (True, 3, True), (True, 7, False), (True, 7, False)]
    ticks = run_ranks(lockstep_tick_on_rank, 4, rows, sizes=sizes)
    assert ticks == [([True, True], [3, 7], [True, False], False)] * 4
    # Group 1 idle (no plan): decode-only vacuously, so a decode graph may serve the step.
    rows = [(True, 3, True), (True, 3, True), (False, 0, False), (False, 0, False)]
    ticks = run_ranks(lockstep_tick_on_rank, 4, rows, sizes=sizes)
    assert ticks == [([True, False], [3, 0], [True, True], False)] * 4


@pytest.mark.parametrize("sizes", [
    ParallelSizes(world_size=2, attn_tp=1, dense_tp=1, moe_tp=1, ep=2),  # over the gloo world_cpu
    ParallelSizes(world_size=2, attn_tp=2, dense_tp=2, moe_tp=2, ep=1),  # over the world group
], ids=["dp2", "tp2"])
def test_every_rank_captures_the_smallest_graph_size_any_rank_allows(sizes: ParallelSizes) -> None:
    assert run_ranks(world_min_on_rank, 2, sizes=sizes) == [6, 6]


# Group 0: three prompts (one of two chunks), five tokens each; group 1: one prompt of two
# chunks, three tokens. Steps: both prefill (eager); group 0's 1-token last chunk beside group
# 1's second chunk (eager for both); two steps of 3 + 1 decodes (both padded to 4); then group 1
# is done and replays the graph on padding rows beside group 0's decodes.
LOCKSTEP_PROMPTS = [[[11, 12, 13, 14, 15], list(range(30, 39)), [7, 8, 9]], [list(range(50, 64))]]
LOCKSTEP_NEW = [5, 3]
LOCKSTEP_GRAPHS = [None, None, 4, 4, 4, 4]  # the decode graph size of each forward step


def test_padded_lockstep_decode_gives_the_eager_path_and_one_ranks_tokens(
        moe_dir: Path) -> None:  # noqa: F811
    """The decode graph's body (run eagerly: no capture on the CPU) under data-parallel
    attention on two gloo ranks: groups of different sizes padded to one size, and an idle
    group replaying it on padding rows, give the tokens and logits of the unpadded eager path
    and of one rank. A pool of 9 pages (all of group 0's) catches a padding row written into a
    real page."""
    sizes = ParallelSizes(world_size=2, attn_tp=1, dense_tp=1, moe_tp=1, ep=2,
                          all2all_backend="allgather_reducescatter")
    runs = {padded: run_ranks(lockstep_generate_on_rank, 2, str(moe_dir), LOCKSTEP_PROMPTS,
                              LOCKSTEP_NEW, padded, 9, sizes=sizes)
            for padded in (True, False)}
    for rank in (0, 1):
        assert runs[True][rank][2] == LOCKSTEP_GRAPHS, runs[True][rank][2]
        assert runs[False][rank][2] == [None] * len(LOCKSTEP_GRAPHS)
    prompts = [p for group in LOCKSTEP_PROMPTS for p in group]
    ref_tokens, ref_logits, _ = run_ranks(generate_on_rank, 1, str(moe_dir), prompts,
                                          max(LOCKSTEP_NEW))[0]
    i = 0
    for group, n in enumerate(LOCKSTEP_NEW):
        for padded in (True, False):
            tokens, logits, _ = runs[padded][group]
            for j, (toks, lgs) in enumerate(zip(tokens, logits)):
                what = f"group {group} request {j} {'padded' if padded else 'eager'}"
                assert toks == ref_tokens[i + j][:n], what
                for step, (a, b) in enumerate(zip(lgs, ref_logits[i + j])):
                    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5,
                                               err_msg=f"{what} step {step}")
        i += len(LOCKSTEP_PROMPTS[group])
