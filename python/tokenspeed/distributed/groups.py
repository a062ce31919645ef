"""torch.distributed for the worker ranks of one replica: start-up with fail-fast timeouts, the
process groups (world, attention TP, dense TP, MoE TP, EP) and the collectives layers call.

Every rank of a replica reads the same plan from the shm ring; ranks talk to each other only
through these groups: NCCL on CUDA, gloo on CPU (so tensor parallelism runs in CI). NCCL
collectives are capturable, so the all-reduces inside the model and the LM head's all-gather
replay inside the decode CUDA graphs like any other kernel.

Group layout (consecutive ranks, as in SGLang): attention TP and dense TP are blocks of
`attn_tp` / `dense_tp` consecutive ranks; MoE TP blocks of `moe_tp` consecutive ranks and EP
groups stride over them (`moe_tp * ep == world`), so EP rank e owns experts [e::ep] or a block
of them and an MoE layer reduces first inside its moe-TP block.

Data-parallel attention (`attn_tp < world`): the world holds `world / attn_tp` attention groups,
each served by its own engine (scheduler, radix cache, KV pool) and reading its own plan ring;
dense layers stay inside a group (`dense_tp` divides `attn_tp`) and only the MoE layers span the
world: `MoeAllGather` (layers/moe_exchange.py) gathers every group's tokens over `attn_dp` (the
ranks with the same attention-TP index), each rank computes its experts' partial output for all
of them, and the sum over the world comes back to each group's own rows. Every rank must
therefore run every forward pass together: `lockstep_tick` (worker/loop.py) decides each step,
over a CPU (gloo) group, which groups run a plan and which run an idle forward, and gives every
group's token count. When every group's plan is decode-only, every rank replays the decode CUDA
graph of one size instead (`Tick.graph_batch`), each group padded to it: `MoeAllGather` with
equal counts has static shapes and reads nothing on the host. Steps with prompt tokens run
eagerly.

`--all2all-backend torch_all2all` (layers/moe_all2all.py) replaces either exchange: each token
goes only to the ranks holding its experts, with and without data-parallel attention.

A process that never called `init_distributed` is a world of one: every group has size 1 and
every collective returns its input, so single-GPU code pays nothing.
"""

from __future__ import annotations

import bisect
import logging
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class ParallelConfigError(ValueError):
    """Sizes that cannot work together; the message names both values."""


# The `--all2all-backend` values built (config/table_parallel.py names them all).
ALL2ALL_BACKENDS = ("naive", "allgather_reducescatter", "torch_all2all")


@dataclass(frozen=True)
class ParallelSizes:
    """Sizes of one replica's worker group, and how its MoE layers exchange tokens
    (`--all2all-backend`; naive under data-parallel attention is allgather_reducescatter, since
    no rank holds every token). `world_size` counts ranks across all nodes."""

    world_size: int = 1
    attn_tp: int = 1
    dense_tp: int = 1
    moe_tp: int = 1
    ep: int = 1
    nnodes: int = 1
    all2all_backend: str = "naive"

    @property
    def nprocs_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def attn_dp(self) -> int:
        """Attention groups in the world (data-parallel attention when > 1)."""
        return self.world_size // self.attn_tp

    def lockstep(self, moe: bool) -> bool:
        """Whether every rank must run every forward pass together (`lockstep_tick`): under
        data-parallel attention with MoE layers, the only layers that span attention groups."""
        return moe and self.attn_dp > 1

    def graph_capturable(self, moe: bool) -> bool:
        """Whether a decode step's collectives can replay in a CUDA graph: not for MoE layers
        under torch_all2all (its split sizes are read on the host every step). Under lockstep,
        every rank replays the same padded size (`Tick.graph_batch`) and `MoeAllGather` gathers
        that many rows from every group (static counts)."""
        return self.world_size == 1 or not (moe and self.all2all_backend == "torch_all2all")

    def extend_graph_capturable(self, moe: bool) -> bool:
        """Whether steps with prompt tokens can replay a graph: as decode steps, except under
        lockstep, where each group's own token count reaches the MoE exchange (eager)."""
        return self.graph_capturable(moe) and not self.lockstep(moe)

    def check(self) -> None:
        """Raise ParallelConfigError for combinations that cannot be served."""
        w = self.world_size
        for name, size in (("--attn-tp-size", self.attn_tp), ("--dense-tp-size", self.dense_tp),
                           ("--moe-tp-size", self.moe_tp), ("--ep-size", self.ep)):
            if size < 1 or w % size:
                raise ParallelConfigError(f"{name} {size} does not divide --world-size {w}")
        if self.dense_tp > self.attn_tp:
            # Dense TP across attention groups would need the groups' tokens gathered for every
            # dense MLP (SGLang's default under DP attention); only MoE layers span groups here.
            raise ParallelConfigError(f"--dense-tp-size {self.dense_tp} is larger than "
                                      f"--attn-tp-size {self.attn_tp}")
        if self.attn_tp % self.dense_tp:
            raise ParallelConfigError(f"--dense-tp-size {self.dense_tp} does not divide "
                                      f"--attn-tp-size {self.attn_tp}")
        if self.attn_tp != w and self.nnodes > 1:
            raise ParallelConfigError(
                f"--attn-tp-size {self.attn_tp} with --world-size {w} on --nnodes {self.nnodes}: "
                "data-parallel attention across nodes is not built yet (the relay carries one "
                "plan ring)")
        if self.moe_tp * self.ep != w:
            raise ParallelConfigError(f"--moe-tp-size {self.moe_tp} times --ep-size {self.ep} "
                                      f"must equal --world-size {w}")
        if self.nnodes < 1 or w % self.nnodes:
            raise ParallelConfigError(f"--world-size {w} is not a multiple of --nnodes "
                                      f"{self.nnodes}")
        if self.all2all_backend not in ALL2ALL_BACKENDS:
            raise ParallelConfigError(f"--all2all-backend {self.all2all_backend!r} is not one of "
                                      f"{', '.join(ALL2ALL_BACKENDS)}")

    def check_model(self, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
        """Raise ParallelConfigError when the model's heads or MLP do not split over the ranks.
        KV heads may be fewer than the ranks (then each is replicated), never uneven."""
        tp = self.attn_tp
        if num_heads % tp:
            raise ParallelConfigError(f"the model's {num_heads} attention heads do not split "
                                      f"over --tp-size {tp}")
        if num_kv_heads >= tp and num_kv_heads % tp:
            raise ParallelConfigError(f"the model's {num_kv_heads} KV heads do not split over "
                                      f"--tp-size {tp}")
        if num_kv_heads < tp and tp % num_kv_heads:
            raise ParallelConfigError(f"--tp-size {tp} is not a multiple of the model's "
                                      f"{num_kv_heads} KV heads (needed to replicate them)")
        if intermediate_size % self.dense_tp:
            raise ParallelConfigError(f"the model's intermediate size {intermediate_size} does "
                                      f"not split over --dense-tp-size {self.dense_tp}")


def resolve_sizes(tp_size: int = 1, dense_tp_size: int | None = None,
                  moe_tp_size: int | None = None, world_size: int | None = None,
                  nprocs_per_node: int | None = None, nnodes: int = 1,
                  ep_size: int = 1, enable_expert_parallel: bool = False,
                  dp_attention: int = 1, all2all_backend: str = "naive") -> ParallelSizes:
    """The flags (seed 001) → checked sizes. `--tp`/`--tensor-parallel-size` is attention TP;
    `--world-size` alone also sets it; dense TP defaults to attention TP, MoE TP to
    world / EP; `--nprocs-per-node` times `--nnodes` must be the world.
    `--enable-expert-parallel` (vLLM) is EP over the whole world: `--ep-size` may repeat it.
    `dp_attention` D > 1 is SGLang's `--tp T --dp D --enable-dp-attention`: a world of T ranks
    (or `--world-size`) in D attention groups of T / D ranks. `--all2all-backend naive` (the
    default) means allgather_reducescatter under data-parallel attention: no rank there holds
    every token."""
    attn = world_size if (world_size and tp_size == 1) else tp_size
    world = world_size or (nprocs_per_node * nnodes if nprocs_per_node else attn)
    if dp_attention > 1:
        if world % dp_attention:
            raise ParallelConfigError(f"--enable-dp-attention with --dp-size {dp_attention}: "
                                      f"it does not divide the world of {world} ranks (--tp-size)")
        attn = world // dp_attention
    if nprocs_per_node and nprocs_per_node * nnodes != world:
        raise ParallelConfigError(f"--nprocs-per-node {nprocs_per_node} on --nnodes {nnodes} "
                                  f"does not make --world-size {world}")
    if enable_expert_parallel:
        if ep_size not in (1, world):
            raise ParallelConfigError(f"--enable-expert-parallel spreads the experts over all "
                                      f"--world-size {world} ranks, but --ep-size is {ep_size}")
        ep_size = world
    if ep_size < 1 or world % ep_size:
        raise ParallelConfigError(f"--ep-size {ep_size} does not divide --world-size {world}")
    if world > attn and all2all_backend == "naive":
        all2all_backend = "allgather_reducescatter"
    sizes = ParallelSizes(world_size=world, attn_tp=attn, dense_tp=dense_tp_size or attn,
                          moe_tp=moe_tp_size or world // ep_size, ep=ep_size, nnodes=nnodes,
                          all2all_backend=all2all_backend)
    sizes.check()
    return sizes


@dataclass
class ParallelGroup:
    """One process group as a rank sees it: its index in the group, the group's size and the
    collectives. A group of size 1 has no process group and its collectives are no-ops."""

    name: str
    rank: int = 0
    size: int = 1
    ranks: tuple[int, ...] = (0,)
    pg: dist.ProcessGroup | None = field(default=None, repr=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns x."""
        if self.size > 1:
            dist.all_reduce(x, group=self.pg)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's x along `dim`, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        out = torch.empty(self.size * x.numel(), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.view(-1), group=self.pg)  # flat: gloo wants 1-D
        return torch.cat(out.view(self.size, *x.shape).unbind(0), dim=dim)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group of x [size * n, ...], and keep block `rank` of it: [n, ...]."""
        if self.size == 1:
            return x
        x = x.contiguous()
        out = torch.empty(x.shape[0] // self.size, *x.shape[1:], dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x, group=self.pg)
        return out

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows x[sum(send[:j]) : sum(send[:j + 1])] go to the group's rank j; returns the rows
        received, rank i's `recv[i]` of them after rank i - 1's."""
        out = x.new_empty(sum(recv), *x.shape[1:])
        if self.size == 1:
            return out.copy_(x)
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=self.pg)
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite x with rank `src`'s (index in the group), in place; returns x."""
        if self.size > 1:
            dist.broadcast(x, src=self.ranks[src], group=self.pg)
        return x


@dataclass
class ParallelState:
    sizes: ParallelSizes
    rank: int  # global rank
    world: ParallelGroup
    attn_tp: ParallelGroup
    dense_tp: ParallelGroup
    moe_tp: ParallelGroup
    ep: ParallelGroup
    # The ranks with this rank's attention-TP index, one per attention group (data-parallel
    # attention: the MoE layers gather tokens over it).
    attn_dp: ParallelGroup
    # The whole world on gloo (data-parallel attention only: the lockstep tick, host values).
    world_cpu: ParallelGroup | None = None

    @property
    def attn_group(self) -> int:
        """Index of this rank's attention group (its engine)."""
        return self.rank // self.sizes.attn_tp

    def group(self, name: str) -> ParallelGroup:
        if name not in GROUP_NAMES:
            raise KeyError(f"no process group {name!r}")
        return getattr(self, name)


GROUP_NAMES = ("world", "attn_tp", "dense_tp", "moe_tp", "ep", "attn_dp")


def single_rank() -> ParallelState:
    """A world of one: every group of size 1."""
    return ParallelState(ParallelSizes(), 0, *(ParallelGroup(n) for n in GROUP_NAMES))


_STATE: ParallelState = single_rank()


def state() -> ParallelState:
    """This process's groups (a world of one before `init_distributed`)."""
    return _STATE


def free_tcp_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(rank: int, sizes: ParallelSizes, init_method: str, device: torch.device,
                     timeout_s: float) -> ParallelState:
    """Join the replica's process group and build the sub-groups. Every rank calls this with
    the same sizes; `init_method` is "tcp://host:port" of rank 0. A rank that does not join
    within `timeout_s`, and any collective that waits longer than that later, raises instead
    of hanging (NCCL: the watchdog aborts the communicator)."""
    global _STATE
    sizes.check()
    if sizes.world_size == 1:
        _STATE = single_rank()
        return _STATE
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:  # the node's ranks share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // sizes.nprocs_per_node))
    # NCCL errors and timeouts abort the process instead of leaving a rank stuck in a kernel.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    timeout = timedelta(seconds=timeout_s)
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=sizes.world_size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    except Exception as e:  # name the rank and where it waited
        raise RuntimeError(
            f"rank {rank} of {sizes.world_size}: could not form the process group at "
            f"{init_method} within {timeout_s:.0f}s (another rank died or never started?): "
            f"{type(e).__name__}: {e}") from e
    w = sizes.world_size

    def blocks(size: int) -> list[list[int]]:
        return [list(range(s, s + size)) for s in range(0, w, size)]

    moe_blocks = blocks(sizes.moe_tp)
    ep_groups = [list(range(i, w, sizes.moe_tp)) for i in range(sizes.moe_tp)]
    groups: dict[str, ParallelGroup] = {}
    # new_group is collective over the world: every rank creates every group, in one order.
    attn_dp_groups = [list(range(i, w, sizes.attn_tp)) for i in range(sizes.attn_tp)]
    for name, layout in (("world", [list(range(w))]), ("attn_tp", blocks(sizes.attn_tp)),
                         ("dense_tp", blocks(sizes.dense_tp)), ("moe_tp", moe_blocks),
                         ("ep", ep_groups), ("attn_dp", attn_dp_groups)):
        for ranks in layout:
            pg = (None if len(ranks) == 1 else dist.group.WORLD if len(ranks) == w
                  else dist.new_group(ranks, timeout=timeout, backend=backend))
            if rank in ranks:
                groups[name] = ParallelGroup(name, ranks.index(rank), len(ranks), tuple(ranks),
                                             pg if len(ranks) > 1 else None)
    world_cpu = None
    if sizes.attn_dp > 1:  # the lockstep tick exchanges host values: gloo even beside NCCL
        pg = (dist.group.WORLD if backend == "gloo"
              else dist.new_group(list(range(w)), timeout=timeout, backend="gloo"))
        world_cpu = ParallelGroup("world_cpu", rank, w, tuple(range(w)), pg)
    _STATE = ParallelState(sizes, rank, **groups, world_cpu=world_cpu)
    logger.info("rank %d/%d joined (%s): attn_tp %d/%d, dense_tp %d/%d, moe_tp %d/%d, ep %d/%d%s",
                rank, w, backend, _STATE.attn_tp.rank, sizes.attn_tp, _STATE.dense_tp.rank,
                sizes.dense_tp, _STATE.moe_tp.rank, sizes.moe_tp, _STATE.ep.rank, sizes.ep,
                f", attention group {_STATE.attn_group}/{sizes.attn_dp}" if sizes.attn_dp > 1
                else "")
    return _STATE


def destroy_distributed() -> None:
    global _STATE
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE = single_rank()


# --- helpers for layers ----------------------------------------------------------------------


def tp_all_reduce(x: torch.Tensor, group: str = "attn_tp") -> torch.Tensor:
    """Sum partial results over a TP group (row-parallel outputs), in place."""
    return _STATE.group(group).all_reduce(x)


def tp_all_gather(x: torch.Tensor, dim: int = -1, group: str = "attn_tp") -> torch.Tensor:
    """Concatenate per-rank shards along `dim` (vocab-parallel logits)."""
    return _STATE.group(group).all_gather(x, dim)


def world_min(value: int) -> int:
    """The smallest of every rank's `value` (every rank calls it at the same point): sizes that
    shape collectives, such as the captured CUDA graphs', must agree across the world."""
    st = _STATE
    if st.world.size == 1:
        return value
    pg = st.world_cpu.pg if st.world_cpu is not None else st.world.pg
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend(pg) == "nccl" else torch.device("cpu"))
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=pg)
    return int(t.item())


# Data-parallel attention: every attention group's token count in the forward pass being run,
# set by the worker's lockstep tick around each forward (`dp_token_counts`), and the decode
# graph size every rank replays in it (None: eager).
_DP_COUNTS: list[int] | None = None
_DP_GRAPH_BATCH: int | None = None


@contextmanager
def dp_token_counts(counts: list[int] | None, graph_batch: int | None = None) -> Iterator[None]:
    """Run the forward passes inside with these per-group token counts (`MoeAllGather`);
    `graph_batch`: every rank replays its decode graph of this size, every count being it."""
    global _DP_COUNTS, _DP_GRAPH_BATCH
    if graph_batch is not None and counts != [graph_batch] * len(counts or ()):
        raise ValueError(f"a padded decode step of {graph_batch} rows per group with counts "
                         f"{counts}")
    saved, _DP_COUNTS, _DP_GRAPH_BATCH = (_DP_COUNTS, _DP_GRAPH_BATCH), counts, graph_batch
    try:
        yield
    finally:
        _DP_COUNTS, _DP_GRAPH_BATCH = saved


def dp_counts() -> list[int] | None:
    """Every attention group's token count in the forward pass being run (None: outside a
    lockstep step)."""
    return _DP_COUNTS


def dp_graph_batch() -> int | None:
    """The decode graph size the current lockstep step replays on every rank (None: eager)."""
    return _DP_GRAPH_BATCH


@dataclass(frozen=True)
class Tick:
    """One lockstep step as every rank sees it, per attention group: whether the group runs a
    plan this step, its token count, whether that plan is decode-only (one token per request,
    no prompt to score: `worker.cuda_graph.decode_only`; True for a group without tokens), and
    whether some rank is leaving (channel closed)."""

    runs_plan: list[bool]
    tokens: list[int]
    stop: bool
    decode: list[bool]

    @property
    def forward(self) -> bool:
        """Whether this step runs a forward pass: then every group runs one, an idle group on
        one padding token (`ModelRunner.idle_forward`)."""
        return any(t > 0 for t in self.tokens)

    def forward_counts(self) -> list[int]:
        """The token count of each group's eager forward pass (an idle group's: its padding
        token)."""
        return [max(t, 1) for t in self.tokens]

    def graph_batch(self, graph_sizes: list[int]) -> int | None:
        """The decode graph size every rank replays this step: the smallest captured size that
        holds the largest group's requests, when every group's plan is decode-only (an idle
        group replays it on padding rows); None: every rank runs eagerly."""
        if not self.forward or not graph_sizes or not all(self.decode):
            return None
        most = max(self.tokens)  # decode-only: one token per request
        if most > graph_sizes[-1]:
            return None
        return graph_sizes[bisect.bisect_left(graph_sizes, most)]


def lockstep_tick(has_plan: bool, tokens: int, stop: bool, decode: bool = False) -> Tick:
    """Data-parallel attention: what every rank holds for the next step, gathered over the
    world on the CPU. A group runs a plan when any of its ranks received one (its other ranks
    then wait for the same plan on their ring); its tokens, and whether it is decode-only, are
    that plan's (a rank without a plan has no say in either)."""
    st = _STATE
    assert st.world_cpu is not None, "lockstep_tick outside data-parallel attention"
    decode = decode or tokens == 0
    mine = torch.tensor([int(has_plan), int(tokens), int(stop), int(decode)], dtype=torch.int64)
    rows = st.world_cpu.all_gather(mine, dim=0).view(-1, 4).tolist()
    tp = st.sizes.attn_tp
    groups = [rows[g * tp:(g + 1) * tp] for g in range(st.sizes.attn_dp)]
    return Tick(runs_plan=[any(r[0] for r in g) for g in groups],
                tokens=[max(r[1] for r in g) for g in groups],
                stop=any(r[2] for r in rows),
                decode=[all(r[3] for r in g if r[0]) for g in groups])


def group_counts(*values: int) -> list[list[int]]:
    """Data-parallel attention: every attention group's `values` (the largest of its ranks';
    they agree), gathered over the world on the CPU, per value: [value][group]. Every rank calls
    it at the same point (a lockstep step's draft passes, worker/draft_chain.py)."""
    st = _STATE
    assert st.world_cpu is not None, "group_counts outside data-parallel attention"
    mine = torch.tensor(values, dtype=torch.int64)
    rows = st.world_cpu.all_gather(mine, dim=0).view(-1, len(values)).tolist()
    tp = st.sizes.attn_tp
    return [[max(r[i] for r in rows[g * tp:(g + 1) * tp]) for g in range(st.sizes.attn_dp)]
            for i in range(len(values))]


def lockstep_forward(tick: Tick, graph_sizes: list[int]) -> AbstractContextManager[None]:
    """The context of a lockstep step's forward passes (`dp_token_counts`): every group padded
    to `tick.graph_batch` rows for a decode graph replay, else each group's own count."""
    bs = tick.graph_batch(graph_sizes)
    if bs is not None:
        return dp_token_counts([bs] * len(tick.tokens), graph_batch=bs)
    return dp_token_counts(tick.forward_counts() if tick.forward else None)


def sync_sampled_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """Rank 0 samples for the replica; every rank keeps rank 0's ids (they feed LAST_SAMPLED
    inputs of the next step). All ranks see identical logits and sampler state, but a sampled
    draw is only guaranteed identical by copying it: broadcast [B] int64, in place."""
    return _STATE.attn_tp.broadcast(tokens, src=0)
