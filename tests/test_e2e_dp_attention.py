"""Data-parallel attention end to end on CPU (gloo): `tokenspeed serve --tp 2 --dp 2
--enable-dp-attention --ep-size 2` is one world of two ranks in two attention groups (one engine,
radix cache and KV pool each) sharing a tiny random Qwen3-MoE's experts. Its greedy text equals
one rank's for a concurrent batch that lands on both groups and for a lone request (the other
group runs idle forward passes every step); a dense tiny Llama under it too; a killed rank stops
the server; the sizes resolve as seed 001's split example says; and the MoE exchange itself, on
two gloo ranks with unequal token counts, gives each group exactly its rows of one rank's output.
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
import openai
import pytest
from test_e2e_expert_parallel import moe_dir  # noqa: F401  (the tiny Qwen3-MoE fixture)
from test_models_numerics import save_tiny_checkpoint
from tp_ranks import moe_all_gather_on_rank, moe_all_to_all_on_rank, run_ranks
from transformers import LlamaConfig

from server_harness import Server, start_server, stop_server
from tokenspeed.distributed import ParallelConfigError, ParallelSizes, resolve_sizes

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
    assert resolve_sizes(tp_size=2, ep_size=2).all2all_backend == "naive"
    assert resolve_sizes(tp_size=2, ep_size=2).graph_capturable
    # naive under data-parallel attention gathers the groups' tokens: no rank holds them all.
    s = resolve_sizes(tp_size=2, ep_size=2, dp_attention=2)
    assert s.all2all_backend == "allgather_reducescatter" and not s.graph_capturable
    for dp in (1, 2):  # split sizes read on the host every layer: eager either way
        s = resolve_sizes(tp_size=2, ep_size=2, dp_attention=dp, all2all_backend="torch_all2all")
        assert s.all2all_backend == "torch_all2all" and not s.graph_capturable
    assert resolve_sizes(all2all_backend="torch_all2all").graph_capturable  # one rank: no exchange
    with pytest.raises(ParallelConfigError, match="--all2all-backend 'pplx' is not one of"):
        resolve_sizes(tp_size=2, all2all_backend="pplx")


# A grammar-constrained request: its masks come from the engine after the step in flight, so
# the worker waits for them between its forward pass and sampling, inside a lockstep step.
REGEX = {"regex": "[a-z]{2,5}-[0-9]{3}"}


def _serve_fails(*args: str) -> str:
    cmd = [sys.executable, "-m", "tokenspeed.cli", "serve", "--device", "cpu", *args]
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
