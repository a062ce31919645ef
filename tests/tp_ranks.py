"""Runs a function on N CPU ranks (spawned processes joined through gloo) and returns what each
rank returned: the test harness for tensor parallelism without GPUs. The per-rank test bodies
live here too, so that a spawned rank imports only this module (not transformers)."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from collections.abc import Callable
from typing import Any

import torch

from tokenspeed.distributed.groups import (
    ParallelSizes,
    destroy_distributed,
    free_tcp_port,
    init_distributed,
    state,
)
from tokenspeed.layers.embedding import LMHead, VocabEmbedding
from tokenspeed.layers.linear import GateUpLinear, QKVLinear, RowLinear


def _rank_main(fn: Callable[..., Any], rank: int, sizes: ParallelSizes, init: str,
               args: tuple, out: Any) -> None:
    torch.set_num_threads(1)  # N ranks share CI's two cores
    try:
        init_distributed(rank, sizes, init, torch.device("cpu"), timeout_s=120)
        result = fn(rank, *args)
        destroy_distributed()
        out.put((rank, True, result))
    except BaseException:  # noqa: BLE001  (the parent re-raises it with the traceback)
        out.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 600,
              sizes: ParallelSizes | None = None) -> list[Any]:
    """fn(rank, *args) on `world` ranks; fn must be importable (module level)."""
    sizes = sizes or ParallelSizes(world_size=world, attn_tp=world, dense_tp=world,
                                   moe_tp=world, ep=1)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_tcp_port()}"
    procs = [ctx.Process(target=_rank_main, args=(fn, r, sizes, init, args, out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, ok, value = out.get(timeout=timeout_s)
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return [results[r] for r in range(world)]


# --- per-rank test bodies -----------------------------------------------------------------------


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    # Sums split over ranks round differently from one matmul: fp32 rounding only.
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def layers_on_rank(rank: int, kv_options: list[int]) -> str:
    tp = state().attn_tp
    g = torch.Generator().manual_seed(0)
    hidden, head_dim, heads, inter, vocab = 12, 4, 6, 18, 37  # 37: vocab padded per rank
    x = torch.randn(5, hidden, generator=g)
    for kv in kv_options:
        q_w = torch.randn(heads * head_dim, hidden, generator=g)
        k_w, v_w = (torch.randn(kv * head_dim, hidden, generator=g) for _ in range(2))
        qkv = QKVLinear(hidden, head_dim, heads, kv, bias=False, tp_rank=tp.rank, tp_size=tp.size)
        for shard, w in enumerate((q_w, k_w, v_w)):
            qkv.weight_loader(qkv.weight, w, shard)
        q, k, v = qkv.split(qkv(x))
        hq = heads // tp.size
        kv_head = rank * hq // (heads // kv)  # the KV head this rank's first query head reads
        hk = max(1, kv // tp.size)
        assert torch.equal(qkv.weight[: hq * head_dim], q_w[rank * hq * head_dim:][: hq * head_dim])
        _close(q, x @ q_w[rank * hq * head_dim:][: hq * head_dim].T, f"q kv={kv}")
        ks = slice(kv_head * head_dim, (kv_head + hk) * head_dim)
        _close(k, x @ k_w[ks].T, f"k kv={kv}")
        _close(v, x @ v_w[ks].T, f"v kv={kv}")
    # gate_up (column) then down (row, with bias): the MLP shards sum to the full MLP.
    gate, up = (torch.randn(inter, hidden, generator=g) for _ in range(2))
    down, bias = torch.randn(hidden, inter, generator=g), torch.randn(hidden, generator=g)
    gu = GateUpLinear(hidden, inter, tp_rank=tp.rank, tp_size=tp.size)
    gu.weight_loader(gu.weight, gate, 0)
    gu.weight_loader(gu.weight, up, 1)
    row = RowLinear(inter, hidden, bias=True, tp_rank=tp.rank, tp_size=tp.size)
    row.weight_loader(row.weight, down, 0)
    row.weight_loader(row.bias, bias, 0)
    g_local, u_local = gu(x).chunk(2, dim=-1)
    full = torch.nn.functional.silu(x @ gate.T) * (x @ up.T) @ down.T + bias
    _close(row(torch.nn.functional.silu(g_local) * u_local), full, "mlp")
    # Vocab-parallel embedding and LM head (tied), vocab not a multiple of the ranks.
    table = torch.randn(vocab, hidden, generator=g)
    emb = VocabEmbedding(vocab, hidden, tp.rank, tp.size)
    emb.weight_loader(emb.weight, table)
    ids = torch.tensor([0, 1, 12, 13, 25, 36, 36, 5])
    assert torch.equal(emb(ids), table[ids])  # one owner per id, zeros elsewhere: exact
    head = LMHead(vocab, hidden, tp.rank, tp.size)
    head.tie(emb)
    logits = head(x)
    assert logits.shape == (5, vocab)
    _close(logits, x @ table.T, "lm head")
    return "ok"


def generate_on_rank(rank: int, path: str, prompts: list[list[int]], n: int,
                     sampling: dict | None = None, seed_by_rank: bool = False,
                     load_format: str = "auto") -> tuple:
    """Greedy (or `sampling`) generation through ModelRunner. `seed_by_rank`: each rank's
    sampler gets its own seed, so only the broadcast of rank 0's ids keeps the ranks in step."""
    from tokenspeed.worker.model_runner import ModelRunner
    from tokenspeed.worker.offline_scheduler import OfflineScheduler

    runner = ModelRunner(path, page_size=4, max_slots=4, max_context_len=128,
                         seed=rank if seed_by_rank else 0, load_format=load_format)
    res = OfflineScheduler(runner).generate(prompts, n, chunk_size=8, keep_logits=True,
                                            sampling=sampling)
    # numpy, not tensors: a queued tensor is shared by file descriptor, gone once the rank exits.
    logits = [[x.numpy() for x in req] for req in res.logits]
    return res.tokens, logits, runner.last_tokens.tolist()


def moe_all_gather_on_rank(rank: int, counts: list[int]) -> str:
    """Data-parallel attention's MoE exchange (layers/moe_exchange.py MoeAllGather): each rank passes only
    its attention group's tokens (`counts[group]` of them, the counts unequal) and must get back
    exactly those rows of one rank's output over all experts, whatever the EP x MoE-TP split.
    A count that disagrees with the tokens fails."""
    from tokenspeed.distributed.groups import dp_token_counts
    from tokenspeed.layers.moe import FusedMoE, MoeOptions
    from tokenspeed.layers.moe_exchange import MoeAllGather, moe_parallel

    experts, top_k, hidden, inter = 8, 2, 16, 12
    g = torch.Generator().manual_seed(0)
    x_all = torch.randn(sum(counts), hidden, generator=g)
    router = torch.randn(experts, hidden, generator=g)
    full = FusedMoE(experts, top_k, hidden, inter, renormalize=True)
    full.gate_up_proj.data.copy_(0.3 * torch.randn(full.gate_up_proj.shape, generator=g))
    full.down_proj.data.copy_(0.3 * torch.randn(full.down_proj.shape, generator=g))
    ref = full(x_all, x_all @ router.T)
    mine = FusedMoE(experts, top_k, hidden, inter, renormalize=True,
                    options=MoeOptions(parallel=moe_parallel()))
    mine.weight_loader(mine.gate_up_proj, full.gate_up_proj.data)
    mine.weight_loader(mine.down_proj, full.down_proj.data)
    group = state().attn_group
    lo = sum(counts[:group])
    x = x_all[lo:lo + counts[group]]
    comm = MoeAllGather()
    with dp_token_counts(counts):
        xs, routing = comm.dispatch(x, mine.route(x @ router.T))
        out = comm.combine(mine(xs, routing))
    _close(out, ref[lo:lo + counts[group]], f"rank {rank} rows of the MoE output")
    with dp_token_counts([c + 1 for c in counts]):
        try:
            comm.dispatch(x, mine.route(x @ router.T))
        except RuntimeError as e:
            assert "the lockstep tick announced" in str(e), e
        else:
            raise AssertionError("a token count that disagrees with the tokens was accepted")
    return "ok"


def moe_all_to_all_on_rank(rank: int, cases: list[tuple[list[int], str]]) -> str:
    """`--all2all-backend torch_all2all` (layers/moe_all2all.py) against one rank's FusedMoE
    over every token. Per case: `counts[g]` tokens in attention group g (one entry without
    data-parallel attention), routed at random or all to the first / last EP rank's experts
    ("first" / "last": the other EP ranks receive nothing). Each rank must get back exactly its
    group's rows of the one-rank output, and receive exactly the tokens that have one of its
    experts: each token once from one rank of its group, none for experts held elsewhere."""
    from tokenspeed.layers.moe import FusedMoE, MoeOptions, Routing
    from tokenspeed.layers.moe_all2all import MoeAllToAll
    from tokenspeed.layers.moe_exchange import moe_communication, moe_parallel

    st = state()
    experts, top_k, hidden, inter = 8, 2, 16, 12
    g = torch.Generator().manual_seed(0)
    router = torch.randn(experts, hidden, generator=g)
    full = FusedMoE(experts, top_k, hidden, inter, renormalize=True)
    full.gate_up_proj.data.copy_(0.3 * torch.randn(full.gate_up_proj.shape, generator=g))
    full.down_proj.data.copy_(0.3 * torch.randn(full.down_proj.shape, generator=g))
    mine = FusedMoE(experts, top_k, hidden, inter, renormalize=True,
                    options=MoeOptions(parallel=moe_parallel()))
    mine.weight_loader(mine.gate_up_proj, full.gate_up_proj.data)
    mine.weight_loader(mine.down_proj, full.down_proj.data)
    comm = moe_communication(st, mine)
    assert isinstance(comm, MoeAllToAll), comm
    held = range(mine.expert_start, mine.expert_start + mine.num_local)
    per_ep = experts // st.sizes.ep
    for counts, skew in cases:
        x_all = torch.randn(sum(counts), hidden, generator=g)
        logits_all = x_all @ router.T
        if skew != "random":
            first = 0 if skew == "first" else experts - per_ep
            logits_all[:, first:first + per_ep] += 20.0
        ref = full(x_all, logits_all)
        ids_all = full.route(logits_all).ids
        expected = sum(any(int(e) in held for e in row) for row in ids_all)
        group = st.attn_group
        lo = sum(counts[:group])
        x, logits = x_all[lo:lo + counts[group]], logits_all[lo:lo + counts[group]]
        xs, routing = comm.dispatch(x, mine.route(logits))
        assert isinstance(routing, Routing) and xs.shape == (expected, hidden), \
            f"rank {rank} {counts} {skew}: received {tuple(xs.shape)}, expected {expected} rows"
        out = comm.combine(mine(xs, routing))
        _close(out, ref[lo:lo + counts[group]], f"rank {rank} {counts} {skew}")
    return "ok"


class _LockstepRunner:
    """A ModelRunner driven as `worker.serve_plans_lockstep` drives it, for OfflineScheduler:
    each plan is one lockstep tick (its decode-only flag included), run inside the tick's
    `lockstep_forward`, with an idle forward pass when this group has no tokens. Records the
    decode graph size each forward step chose (None: eager)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.page_size, self.num_pages = runner.page_size, runner.num_pages
        self.sizes = runner.graphs.sizes if runner.graphs is not None else []
        self.chosen: list[int | None] = []

    def tick(self, plan: Any) -> torch.Tensor | None:
        from tokenspeed.distributed.groups import lockstep_forward, lockstep_tick
        from tokenspeed.worker.cuda_graph import decode_only

        tokens = int(plan.sched_tokens_len.sum()) if plan is not None else 0
        tick = lockstep_tick(plan is not None, tokens, False,
                             plan is not None and decode_only(plan, self.runner.sampler))
        if tick.forward:
            self.chosen.append(tick.graph_batch(self.sizes))
        logits = None
        with lockstep_forward(tick, self.sizes):
            if plan is not None:
                logits = self.runner.forward(plan)
            if tick.forward and tick.tokens[state().attn_group] == 0:
                self.runner.idle_forward()
        if plan is None and not any(tick.runs_plan):
            raise StopIteration  # every group is done
        return logits

    def forward(self, plan: Any) -> torch.Tensor:
        return self.tick(plan)

    def sample(self, plan: Any, logits: torch.Tensor) -> Any:
        return self.runner.sample(plan, logits)

    def drain(self) -> None:
        """This group is done: idle through the other groups' steps until every group is."""
        try:
            while True:
                self.tick(None)
        except StopIteration:
            pass


def lockstep_generate_on_rank(rank: int, path: str, prompts: list[list[list[int]]],
                              new_tokens: list[int], padded: bool, num_pages: int) -> tuple:
    """Data-parallel attention: attention group g generates `new_tokens[g]` greedy tokens for
    its `prompts[g]` in lockstep with the other groups. `padded`: decode steps take the decode
    graph path (`DecodeGraphRunner` of sizes 1, 2, 4, its body run eagerly: no capture on the
    CPU), every group padded to one size and an idle group replaying it on padding rows;
    else every step is eager with each group's own token count."""
    from tokenspeed.worker.cuda_graph import DecodeGraphRunner
    from tokenspeed.worker.model_runner import ModelRunner
    from tokenspeed.worker.offline_scheduler import OfflineScheduler

    runner = ModelRunner(path, page_size=4, num_pages=num_pages, max_slots=4,
                         max_context_len=128)
    assert runner.lockstep and runner.graphs is None  # CPU: nothing captured
    if padded:
        runner.graphs = DecodeGraphRunner(runner.model, runner.kv_cache, runner.backend, 4,
                                          runner.config.vocab_size, runner.device,
                                          runner.last_tokens)
    group = state().attn_group
    driver = _LockstepRunner(runner)
    res = OfflineScheduler(driver, seed=group).generate(
        prompts[group], new_tokens[group], chunk_size=8, keep_logits=True)
    driver.drain()
    logits = [[x.numpy() for x in req] for req in res.logits]
    return res.tokens, logits, driver.chosen


def lockstep_tick_on_rank(rank: int, rows: list[tuple[bool, int, bool]]) -> tuple:
    """Each rank says (has a plan, its tokens, decode-only) = rows[rank]; returns the tick."""
    from tokenspeed.distributed.groups import lockstep_tick

    has_plan, tokens, decode = rows[rank]
    t = lockstep_tick(has_plan, tokens, False, decode)
    return t.runs_plan, t.tokens, t.decode, t.stop


def world_min_on_rank(rank: int) -> int:
    """Each rank offers 7 - rank (a graph size its own pool allows): all must get the least."""
    from tokenspeed.distributed.groups import world_min

    return world_min(7 - rank)


def eagle3_drafts_on_rank(rank: int, target: str, head: str | None, prompt: list[int],
                          steps: int, algorithm: str = "EAGLE3") -> tuple:
    """EAGLE-3 (or NEXTN: `head` None, the target's MTP layer) drafting through ModelRunner: a
    prompt, then three verify steps of the head's own drafts. Returns (tokens, drafts) per step
    and the head's weight shapes (EAGLE-3's whole on each rank, NEXTN's decoder layer sharded)."""
    from tokenspeed.worker.draft_chain import DraftSpec
    from tokenspeed.worker.model_runner import ModelRunner
    from tokenspeed.worker.plan import StepPlan

    runner = ModelRunner(target, page_size=4, max_slots=2, max_context_len=64,
                         draft=DraftSpec(algorithm, head, steps))
    plan = StepPlan.build(new=[{"slot": 0, "temperature": 0.0}],
                          page_tables=[(0, 0, list(range(1, 17)))], scheduled=[(0, 0, prompt, True)])
    seq, trace = list(prompt), []
    for _ in range(4):
        out = runner.launch(plan).wait()
        assert out.draft_tokens is not None
        toks, drafts = [int(t) for t in out.tokens], out.draft_tokens[0].tolist()
        seq += toks
        trace.append((toks, drafts))
        plan = StepPlan.build(scheduled=[(0, len(seq) - 1, [seq[-1], *drafts], True, len(drafts))])
    shapes = {n: tuple(p.shape) for n, p in runner.drafter.head.named_parameters()}  # type: ignore[union-attr]
    return trace, shapes
