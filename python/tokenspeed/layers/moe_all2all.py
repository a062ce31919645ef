"""`--all2all-backend torch_all2all`: the MoE exchange that sends each token only to the ranks
holding one of its top-k experts, through torch.distributed.all_to_all_single (NCCL or gloo).

Layout (distributed/groups.py): world rank r is EP rank r // moe_tp and MoE-TP rank r % moe_tp;
EP rank e holds experts [e * L, (e + 1) * L) (L experts per rank), each MoE-TP rank of its block
a slice of their intermediate dimension. The ranks of one attention-TP group hold the same tokens (TP
replicates activations; under data-parallel attention each group has its own), so attention-TP
rank a dispatches only share a of them (ceil(n / attn_tp) rows): every token leaves one rank.

dispatch: the share's tokens arrive routed (by the model's router, on this rank); each goes to
every EP rank holding at least one of its experts, to each MoE-TP rank of it. One all_to_all_single swaps the per-destination row
counts, which are read on the host; a second sends the rows (hidden state, the token's top-k
weights and ids, packed as bytes) with those split sizes. The receiving rank runs its experts on
what it got (the kernels skip ids held elsewhere) and weights them.
combine: the rows' outputs go back along the same splits and are summed per token in fp32 (over
EP ranks and MoE-TP slices); the attention-TP group all-gathers its shares, so each of its ranks
again holds the output of all the group's tokens.

Not capturable in a CUDA graph (the split sizes change every step and are read on the host):
`ParallelSizes.graph_capturable` keeps decode eager. Against `naive` (an all-reduce of every
token's hidden state over the world) it moves about top-k distinct ranks' worth of rows per
token instead of world-many, at the price of three collectives (four with attention TP) and a
host sync per layer: it pays off with many ranks and large batches, not batch-1 decode on two GPUs.
The per-token sum is an index_add_: on CUDA its order is not fixed once a token has three or more
destinations (two adds commute exactly), so such runs may differ in the last bit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tokenspeed.distributed.groups import state
from tokenspeed.layers.moe import FusedMoE, Routing, pack_routed, unpack_routed


class _Sent(NamedTuple):
    """What combine needs of the dispatch it answers."""

    token: torch.Tensor  # [rows sent] index into this rank's share, destination-major
    send: list[int]  # rows sent to each world rank
    recv: list[int]  # rows received from each world rank
    share: tuple[int, int, int]  # (first row of the share, its rows, the group's tokens)


class MoeAllToAll:
    """`SparseMoeBlock.comm` for `--all2all-backend torch_all2all` (see the module docstring)."""

    def __init__(self, experts: FusedMoE) -> None:
        self.experts_per_rank = experts.num_local
        self._sent: _Sent | None = None

    def dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, Routing]:
        st = state()
        sizes, tp = st.sizes, st.attn_tp
        n, hidden = x.shape
        per = -(-n // tp.size)
        lo = min(n, tp.rank * per)
        rows = min(n, lo + per) - lo
        routing = Routing(routing.weights[lo:lo + rows], routing.ids[lo:lo + rows])
        # The world ranks each token goes to: every MoE-TP rank of the EP ranks holding its experts.
        owner = routing.ids.long() // self.experts_per_rank
        holds = torch.zeros(rows, sizes.ep, dtype=torch.bool, device=x.device)
        holds.scatter_(1, owner, True)
        to = holds.repeat_interleave(sizes.moe_tp, dim=1)  # [rows, world]: rank e * moe_tp + t
        send = to.sum(0)
        # The (destination, token) pairs to send first, destination-major as all_to_all_single
        # splits: a stable sort queued before the sync below (nonzero would sync again).
        order = torch.argsort((~to.t().reshape(-1)).to(torch.uint8), stable=True)
        one = [1] * sizes.world_size
        recv = st.world.all_to_all(send, one, one)
        send_n, recv_n = torch.stack([send, recv]).tolist()  # the host sync
        token = order[:sum(send_n)] % max(rows, 1)
        packed = pack_routed(x[lo:lo + rows].index_select(0, token),
                             Routing(routing.weights[token], routing.ids[token]))
        got = st.world.all_to_all(packed, send_n, recv_n)
        self._sent = _Sent(token, send_n, recv_n, (lo, rows, n))
        return unpack_routed(got, hidden, x.dtype, routing.ids.shape[1])

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        st = state()
        sent, self._sent = self._sent, None
        if sent is None:
            raise RuntimeError("MoeAllToAll.combine without a dispatch before it")
        _, rows, n = sent.share
        back = st.world.all_to_all(partial, sent.recv, sent.send)
        out = torch.zeros(rows, partial.shape[1], dtype=torch.float32, device=partial.device)
        out = out.index_add_(0, sent.token, back.float()).to(partial.dtype)
        tp = st.attn_tp
        if tp.size == 1:
            return out
        per = -(-n // tp.size)
        if rows < per:
            out = torch.cat([out, out.new_zeros(per - rows, out.shape[1])])
        return tp.all_gather(out, dim=0)[:n]

