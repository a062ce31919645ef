"""Mixture-of-experts MLP: a router and a bank of gated experts, with expert and MoE tensor
parallelism as parameters.

Parallel layout (split TP of seed 001): the ranks of one MoE layer form an ep_size x tp_size grid.
EP rank r owns the contiguous experts [r * E / ep_size, (r + 1) * E / ep_size); moe-TP rank t owns
the slice [t * I / tp_size, (t + 1) * I / tp_size) of every expert's intermediate dimension (rows
of gate and up, columns of down). Every rank sees every token (attention TP replicates the
activations) and computes a partial output: zero for the experts it does not hold, a partial sum
over its intermediate slice for the ones it does. The partials of all ep_size * tp_size ranks sum
to the full output, so `MoeCommunication.combine` is an all-reduce over that group. With data
parallel attention (DP + EP) `dispatch` all-gathers the replicas' tokens first and `combine`
reduce-scatters instead. With `--all2all-backend torch_all2all` (moe_all2all.py) `dispatch`
sends each token only to the ranks holding its experts. Tokens are routed on the rank that holds
them, before any exchange, by the model's own router (`FusedMoE.route`'s softmax top-k, or
DeepSeek's grouped, biased top-k), and every exchange carries that `Routing` (top-k weights and
ids) with the hidden states: no exchange routes, so one model's routing works under all of them.
The exchanges over the process groups are in moe_exchange.py; the MoE families'
`SparseMoeBlock` (models/moe_base.py) calls the hook.

FP8 experts (block-scaled checkpoints, DeepSeek-V3): `make_fp8_block` turns gate_up_proj /
down_proj into fp8 tensors with one fp32 scale per [128, 128] tile (`gate_up_proj_scale`
[E, 2I / 128, H / 128], `down_proj_scale` [E, H / 128, I / 128]); they stay fp8 in memory and
every expert GEMM is block-scaled W8A8 (torch_native: fp8.py's fp8_block_linear per expert;
triton: fused_moe with the scales).

Backends: `torch_native` (CPU and reference: a loop over the experts that receive tokens, which
reads the per-expert counts on the host, so it cannot run inside a CUDA graph) and `triton`
(tokenspeed_kernels.fused_moe: no host syncs, the default on CUDA, used in decode graphs). Both
take expert biases and GPT-OSS's clamped SwiGLU (`ExpertActivation`; triton: fused into its
grouped GEMMs' epilogues).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import nn

from tokenspeed.layers.linear import linear

MOE_BACKENDS = ("triton", "torch_native")
GRAPH_SAFE_MOE_BACKENDS = ("triton",)


def resolve_moe_backend(name: str | None, device: torch.device) -> str:
    """None/"auto": triton on CUDA, torch_native elsewhere."""
    if name in (None, "", "auto"):
        return "triton" if device.type == "cuda" else "torch_native"
    if name not in MOE_BACKENDS:
        raise ValueError(f"--moe-backend {name!r} is not one of {', '.join(MOE_BACKENDS)}")
    if name == "triton" and device.type != "cuda":
        from tokenspeed_kernels._utils import interpreting

        if not interpreting():
            raise ValueError(f"--moe-backend triton needs a CUDA device (device is {device.type}; "
                             "use torch_native, or TRITON_INTERPRET=1 for a slow CPU run)")
    return name


@dataclass(frozen=True)
class MoeParallel:
    """This rank's place in the MoE grid (see the module docstring)."""

    ep_rank: int = 0
    ep_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1


@dataclass(frozen=True)
class MoeOptions:
    """Runtime choices for the MoE layers of a model (not architecture facts)."""

    backend: str = "torch_native"
    parallel: MoeParallel = MoeParallel()


class Routing(NamedTuple):
    """Tokens already routed: each one's top-k experts and their weights (`moe_route`)."""

    weights: torch.Tensor  # [T, k] float32
    ids: torch.Tensor  # [T, k] int32, global expert ids


def pack_routed(x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Rows of [hidden state | top-k weights fp32 | top-k ids int32] as bytes: one message per
    exchange, the weights unrounded and the ids exact whatever the hidden dtype (bf16 holds
    integers only up to 256; Kimi-K2 has 384 experts)."""
    return torch.cat([x.contiguous().view(torch.uint8),
                      routing.weights.float().contiguous().view(torch.uint8),
                      routing.ids.to(torch.int32).contiguous().view(torch.uint8)], dim=1)


def unpack_routed(rows: torch.Tensor, hidden: int, dtype: torch.dtype,
                  top_k: int) -> tuple[torch.Tensor, Routing]:
    """`pack_routed`'s rows back to (hidden states [T, hidden] of `dtype`, their `Routing`)."""
    h = hidden * torch.empty(0, dtype=dtype).element_size()
    x = rows[:, :h].contiguous().view(dtype)
    weights = rows[:, h:h + 4 * top_k].contiguous().view(torch.float32)
    ids = rows[:, h + 4 * top_k:].contiguous().view(torch.int32)
    return x, Routing(weights, ids)


class MoeCommunication(Protocol):
    """Where tokens meet the experts across ranks; the parallel runtime provides it. `dispatch`
    takes this rank's tokens and their `Routing` and returns the tokens this rank's experts
    compute with theirs; `combine` returns this rank's tokens' outputs from the partials."""

    def dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, Routing]: ...

    def combine(self, partial: torch.Tensor) -> torch.Tensor: ...


class SingleRank:
    """One rank holds every expert whole: nothing to exchange."""

    def dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, Routing]:
        return x, routing

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        return partial


@dataclass(frozen=True)
class ExpertActivation:
    """The experts' gated activation: SiLU(gate) * up (`silu`), or GPT-OSS's clamped SwiGLU
    (`swiglu_oai`): gate clamped above at `limit`, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate). The triton backend's is
    tokenspeed_kernels.activation.gated_act (the same kinds by name)."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return nn.functional.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def moe_torch_native(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     expert_start: int = 0, b13: torch.Tensor | None = None,
                     b2: torch.Tensor | None = None,
                     activation: ExpertActivation = ExpertActivation(),
                     s13: torch.Tensor | None = None, s2: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: per local expert, gather its tokens, gate_up → activation → down (biases
    b13 [E, 2I] / b2 [E, H] when given; fp8 weights with block scales s13 / s2 when given),
    scale by the routing weight and add into the token's output (fp32)."""
    tokens, hidden = x.shape
    num_local, top_k = w13.shape[0], topk_ids.shape[1]
    out = torch.zeros(tokens, hidden, dtype=torch.float32, device=x.device)
    local = topk_ids.reshape(-1).long() - expert_start
    key = torch.where((local >= 0) & (local < num_local), local, num_local)
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=num_local + 1).tolist()  # host sync: eager only
    weights = topk_weights.reshape(-1)
    start = 0
    for e, count in enumerate(counts[:num_local]):
        if count:
            assign = order[start:start + count]
            rows = assign // top_k
            gate, up = linear(x[rows], w13[e], None if b13 is None else b13[e],
                              None if s13 is None else s13[e]).chunk(2, dim=-1)
            h = linear(activation(gate, up), w2[e], None if b2 is None else b2[e],
                       None if s2 is None else s2[e])
            out.index_add_(0, rows, h.float() * weights[assign, None].float())
        start += count
    return out.to(x.dtype)


class FusedMoE(nn.Module):
    """This rank's experts: gate_up_proj [E_local, 2 * I_local, H] (gate rows, then up rows) and
    down_proj [E_local, H, I_local], the layout of HF's fused expert tensors (transformers 5).
    `forward` returns this rank's partial output (see the module docstring)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, options: MoeOptions = MoeOptions(), bias: bool = False,
                 activation: ExpertActivation = ExpertActivation()) -> None:
        super().__init__()
        p = options.parallel
        if num_experts % p.ep_size or intermediate_size % p.tp_size:
            raise ValueError(f"{num_experts} experts x {intermediate_size} intermediate do not "
                             f"split over ep_size {p.ep_size} x moe tp_size {p.tp_size}")
        if options.backend not in MOE_BACKENDS:
            raise ValueError(f"moe backend {options.backend!r} not in {MOE_BACKENDS}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.backend = options.backend
        self.parallel = p
        self.num_local = num_experts // p.ep_size
        self.expert_start = p.ep_rank * self.num_local
        self.inter_local = intermediate_size // p.tp_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(self.num_local, 2 * self.inter_local, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(
            torch.empty(self.num_local, hidden_size, self.inter_local), requires_grad=False)
        self.activation = activation
        # Biases (GPT-OSS): gate_up's split like its rows; down's added once, by moe-TP rank 0
        # (the other ranks' partial sums hold none).
        self.gate_up_proj_bias: nn.Parameter | None = None
        self.down_proj_bias: nn.Parameter | None = None
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(self.num_local, 2 * self.inter_local),
                                                  requires_grad=False)
            self.down_proj_bias = nn.Parameter(torch.empty(self.num_local, hidden_size),
                                               requires_grad=False)
        # FP8 block scales (make_fp8_block): one per [block_n, block_k] tile of each expert.
        self.block: tuple[int, int] | None = None
        self.gate_up_proj_scale: nn.Parameter | None = None
        self.down_proj_scale: nn.Parameter | None = None

    def make_fp8_block(self, block: tuple[int, int]) -> None:
        """fp8 expert weights with block-scale grids, for a block-wise FP8 checkpoint to fill.
        The gate and up halves and each moe-TP slice must cut on the block grid (V3: I = 2048)."""
        bn, bk = block
        i, hidden = self.inter_local, self.down_proj.shape[1]
        if i % bn or i % bk:
            raise ValueError(f"FP8 block-scaled experts: intermediate slice {i} is not a multiple "
                             f"of the {bn}x{bk} weight block")
        if self.gate_up_proj_bias is not None:
            raise NotImplementedError("FP8 block-scaled experts with biases")
        dev = self.gate_up_proj.device

        def param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.ones(shape, dtype=dtype, device=dev), requires_grad=False)

        self.block = block
        self.gate_up_proj = param(tuple(self.gate_up_proj.shape), torch.float8_e4m3fn)
        self.down_proj = param(tuple(self.down_proj.shape), torch.float8_e4m3fn)
        self.gate_up_proj_scale = param((self.num_local, 2 * i // bn, -(-hidden // bk)), torch.float32)
        self.down_proj_scale = param((self.num_local, -(-hidden // bn), i // bk), torch.float32)

    @torch.no_grad()
    def quantize_fp8_block(self, block: tuple[int, int]) -> None:
        """The experts' high-precision weights (dummy ones) block-quantised in place, expert by
        expert, into make_fp8_block's layout: what a block-wise FP8 checkpoint would have given."""
        from tokenspeed.layers.quantization.fp8 import quantize_blocks

        w13, w2 = self.gate_up_proj.data, self.down_proj.data
        self.make_fp8_block(block)
        for e in range(self.num_local):
            for src, dst, scale in ((w13, self.gate_up_proj, self.gate_up_proj_scale),
                                    (w2, self.down_proj, self.down_proj_scale)):
                q, s = quantize_blocks(src[e], block)
                dst.data[e].copy_(q)
                scale.data[e].copy_(s)  # type: ignore[union-attr]

    def _load_target(self, e: int, shard: str, loaded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(destination, source) of one expert's shard: its rows of gate_up / columns of down
        (block rows / columns of their scale grids for the `*_scale` shards)."""
        i, t = self.inter_local, self.parallel.tp_rank
        if shard.endswith("_scale"):
            bn, bk = self.block or (0, 0)
            if shard == "down_scale":
                return self.down_proj_scale.data[e], loaded.narrow(1, t * i // bk, i // bk)  # type: ignore[union-attr]
            offset = 0 if shard == "gate_scale" else i // bn
            return (self.gate_up_proj_scale.data[e].narrow(0, offset, i // bn),  # type: ignore[union-attr]
                    loaded.narrow(0, t * i // bn, i // bn))
        if shard in ("gate_bias", "up_bias") and self.gate_up_proj_bias is not None:
            offset = 0 if shard == "gate_bias" else i
            return self.gate_up_proj_bias.data[e].narrow(0, offset, i), loaded.narrow(0, t * i, i)
        if shard == "down_bias" and self.down_proj_bias is not None:
            return self.down_proj_bias.data[e], loaded if t == 0 else torch.zeros_like(loaded)
        if shard == "down":
            return self.down_proj.data[e], loaded.narrow(1, t * i, i)
        if shard in ("gate", "up"):
            offset = 0 if shard == "gate" else i
            return self.gate_up_proj.data[e].narrow(0, offset, i), loaded.narrow(0, t * i, i)
        raise ValueError(f"unknown expert shard {shard!r}")

    def local_expert(self, expert: int) -> int | None:
        """Index of global expert `expert` on this rank, None when another EP rank holds it."""
        e = expert - self.expert_start
        return e if 0 <= e < self.num_local else None

    def load_expert(self, expert: int, shard: str, loaded: torch.Tensor) -> bool:
        """Copy this rank's slice of one expert's HF tensor: shard "gate"/"up" ([I, H]) or
        "down" ([H, I]), their biases (`*_bias`) or block scales (`*_scale`). False when the expert lives on another EP rank (nothing copied)."""
        e = self.local_expert(expert)
        if e is None:
            return False
        if shard.endswith("_scale") and self.block is None:
            raise ValueError(f"expert {expert} {shard}: FP8 expert weights load from block-wise FP8 "
                             "checkpoints only (weight_block_size [128, 128])")
        dst, src = self._load_target(e, shard, loaded)
        if dst.shape != src.shape:
            raise ValueError(f"expert {expert} {shard}: checkpoint slice {tuple(src.shape)} != "
                             f"parameter {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(src.to(dst.dtype))
        return True

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard: int = 0) -> None:
        """This rank's part of a stacked tensor of all experts, in this module's layout
        (gate_up_proj [E, 2I, H] or down_proj [E, H, I]): dummy weights drawn whole."""
        if param is self.gate_up_proj:
            for e in range(self.expert_start, self.expert_start + self.num_local):
                gate, up = full[e].chunk(2, dim=0)
                self.load_expert(e, "gate", gate)
                self.load_expert(e, "up", up)
        elif param is self.down_proj:
            for e in range(self.expert_start, self.expert_start + self.num_local):
                self.load_expert(e, "down", full[e])
        elif param is self.gate_up_proj_bias:
            for e in range(self.expert_start, self.expert_start + self.num_local):
                gate, up = full[e].chunk(2, dim=0)
                self.load_expert(e, "gate_bias", gate)
                self.load_expert(e, "up_bias", up)
        elif param is self.down_proj_bias:
            for e in range(self.expert_start, self.expert_start + self.num_local):
                self.load_expert(e, "down_bias", full[e])
        else:
            raise ValueError("not a parameter of this expert bank")

    def route(self, router_logits: torch.Tensor) -> Routing:
        """Softmax, top-k (renormalised when the model says so)."""
        from tokenspeed_kernels.moe import moe_route

        return Routing(*moe_route(router_logits, self.top_k, self.renormalize))

    def forward(self, x: torch.Tensor, routing: torch.Tensor | Routing) -> torch.Tensor:
        """This rank's partial output for x, routed by router logits [T, E] or a `Routing`
        (ids of experts held elsewhere contribute nothing)."""
        from tokenspeed_kernels.moe import fused_moe

        weights, ids = routing if isinstance(routing, Routing) else self.route(routing)
        if self.backend == "triton":
            a = self.activation
            return fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids, self.expert_start,
                             w13_scale=self.gate_up_proj_scale, w2_scale=self.down_proj_scale,
                             block=self.block or (128, 128), w13_bias=self.gate_up_proj_bias,
                             w2_bias=self.down_proj_bias, activation=a.kind, alpha=a.alpha,
                             limit=a.limit)
        return moe_torch_native(x, self.gate_up_proj, self.down_proj, weights, ids,
                                self.expert_start, self.gate_up_proj_bias, self.down_proj_bias,
                                self.activation, self.gate_up_proj_scale, self.down_proj_scale)


class Router(nn.Module):
    """Replicated linear hidden → one logit per expert (HF `mlp.gate`; GPT-OSS `mlp.router`,
    with a bias)."""

    def __init__(self, hidden_size: int, num_experts: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def expert_slice(num_experts: int, p: MoeParallel) -> str:
    """This rank's share of the experts, for the start-up log ("" on one rank)."""
    if p.ep_size == 1 and p.tp_size == 1:
        return ""
    n = num_experts // p.ep_size
    return (f"; ep rank {p.ep_rank}/{p.ep_size} holds experts [{p.ep_rank * n}, "
            f"{(p.ep_rank + 1) * n}), moe-tp rank {p.tp_rank}/{p.tp_size}")
