"""How an MoE layer's tokens meet its experts across ranks (`SparseMoeBlock.comm`, the
`moe.MoeCommunication` hook), built from this rank's process groups (distributed/groups.py):
an all-reduce of every rank's partial output under TP/EP (`MoeAllReduce`), an all-gather and a
reduce-scatter over the attention groups under data-parallel attention (`MoeAllGather`), or
`--all2all-backend torch_all2all`'s exchange (moe_all2all.py). `moe_communication` picks one.
"""

from __future__ import annotations

import torch

from tokenspeed.distributed.groups import ParallelState, dp_counts, state
from tokenspeed.layers.moe import (
    FusedMoE,
    MoeCommunication,
    MoeParallel,
    Routing,
    pack_routed,
    unpack_routed,
)
from tokenspeed.layers.moe_all2all import MoeAllToAll


class MoeAllReduce:
    """`SparseMoeBlock.comm` under TP/EP: every rank holds every token (attention TP replicates
    the activations) and computes a partial output over its experts and intermediate slice; the
    partials of the ep x moe-TP grid, which is the whole world, sum to the layer's output."""

    def dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, Routing]:
        return x, routing

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        return state().world.all_reduce(partial)


class MoeAllGather:
    """`SparseMoeBlock.comm` under data-parallel attention (`--all2all-backend
    allgather_reducescatter`): each attention group holds only its own tokens. `dispatch`
    all-gathers hidden states and their routing over `attn_dp` (padded to the largest group's
    count, known from the lockstep tick, so no extra collective sizes it); every rank computes
    its experts' partial output for every group's real tokens; `combine` puts them back in the
    padded layout, reduce-scatters it over `attn_dp` (each rank keeps its group's block, summed
    over the ranks of its attention-TP index) and all-reduces that block over `attn_tp` (the
    rest of the world), then drops the padding.
    Equal counts (a padded decode graph's [B] * groups, `dp_token_counts(graph_batch=B)`) need
    no row selection: the experts run on every gathered row, padding rows included, and the
    exchange has static shapes and no index built on the host, so it is captured in the graph."""

    def __init__(self) -> None:
        self._rows: torch.Tensor | None = None  # the real rows of the gathered layout
        self._padded = (0, 0)  # (groups * largest count, this group's count)

    def dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, Routing]:
        st = state()
        counts = dp_counts()
        if counts is None or len(counts) != st.sizes.attn_dp:
            raise RuntimeError(f"data-parallel attention: a forward pass without the "
                               f"{st.sizes.attn_dp} groups' token counts (dp_token_counts)")
        g = st.attn_group
        if x.shape[0] != counts[g]:
            raise RuntimeError(f"attention group {g}: {x.shape[0]} tokens in the forward pass, "
                               f"the lockstep tick announced {counts[g]}")
        most = max(counts)
        rows = pack_routed(x, routing)
        if most > rows.shape[0]:  # padding rows route to expert 0 with weight 0
            rows = torch.cat([rows, rows.new_zeros(most - rows.shape[0], rows.shape[1])])
        gathered = st.attn_dp.all_gather(rows, dim=0)  # [groups * most, row bytes]
        self._padded = (len(counts) * most, counts[g])
        self._rows = None
        if min(counts) < most:
            # The real rows (no expert work on padding); host ints only: no device sync.
            self._rows = torch.cat([torch.arange(j * most, j * most + n, device=x.device)
                                    for j, n in enumerate(counts)])
            gathered = gathered.index_select(0, self._rows)
        return unpack_routed(gathered, x.shape[1], x.dtype, routing.ids.shape[1])

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        st = state()
        rows, own = self._padded
        padded = partial if self._rows is None else \
            partial.new_zeros(rows, partial.shape[1]).index_copy_(0, self._rows, partial)
        block = st.attn_dp.reduce_scatter(padded)  # [most, H]: this group's rows
        return st.attn_tp.all_reduce(block)[:own]


def moe_communication(st: ParallelState | None, experts: FusedMoE) -> MoeCommunication | None:
    """The MoE exchange of one layer (`experts`, its FusedMoE) for this rank's groups: None on
    one rank; `MoeAllToAll` with `--all2all-backend torch_all2all`; else `MoeAllGather` under
    data-parallel attention and `MoeAllReduce` otherwise (allgather_reducescatter with one
    attention group gathers nothing: it is naive)."""
    st = st or state()
    if st.world.size == 1:
        return None
    if st.sizes.all2all_backend == "torch_all2all":
        return MoeAllToAll(experts)
    return MoeAllGather() if st.sizes.attn_dp > 1 else MoeAllReduce()


def moe_parallel(st: ParallelState | None = None) -> MoeParallel:
    """This rank's place in the MoE grid (`moe.MoeParallel`) from its groups."""
    st = st or state()
    return MoeParallel(ep_rank=st.ep.rank, ep_size=st.ep.size, tp_rank=st.moe_tp.rank,
                       tp_size=st.moe_tp.size)
