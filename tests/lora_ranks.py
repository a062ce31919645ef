"""Per-rank body of the LoRA tensor-parallel test (spawned ranks import only this module and
tp_ranks, not transformers): adapted q/k/v, o, gate/up and down layers sharded over the ranks
give the unsharded y = x W^T + scale (x A^T) B^T."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from torch import nn

from tokenspeed.distributed.groups import state, tp_all_gather
from tokenspeed.layers import lora as lora_layer
from tokenspeed.layers.linear import GateUpLinear, QKVLinear, RowLinear
from tokenspeed.worker.lora import LoraPool
from tokenspeed.worker.plan import StepPlan

HIDDEN, HEAD_DIM, HEADS, KV_HEADS, INTER = 16, 4, 4, 2, 24


def _block(tp_rank: int, tp_size: int, g: torch.Generator) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """One decoder layer's linear layers (named as in LlamaForCausalLM), loaded from full
    random weights; returns the module tree and the full weights by HF name."""
    full = {"q_proj": (HEADS * HEAD_DIM, HIDDEN), "k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
            "v_proj": (KV_HEADS * HEAD_DIM, HIDDEN), "o_proj": (HIDDEN, HEADS * HEAD_DIM),
            "gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN), "down_proj": (HIDDEN, INTER)}
    w = {k: torch.randn(*s, generator=g) for k, s in full.items()}
    attn, mlp = nn.Module(), nn.Module()
    attn.qkv_proj = QKVLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, tp_rank=tp_rank, tp_size=tp_size)
    attn.o_proj = RowLinear(HEADS * HEAD_DIM, HIDDEN, tp_rank=tp_rank, tp_size=tp_size)
    mlp.gate_up_proj = GateUpLinear(HIDDEN, INTER, tp_rank=tp_rank, tp_size=tp_size)
    mlp.down_proj = RowLinear(INTER, HIDDEN, tp_rank=tp_rank, tp_size=tp_size, group="dense_tp")
    for i, k in enumerate(("q_proj", "k_proj", "v_proj")):
        attn.qkv_proj.weight_loader(attn.qkv_proj.weight, w[k], i)
    attn.o_proj.weight_loader(attn.o_proj.weight, w["o_proj"])
    mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, w["gate_proj"], 0)
    mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, w["up_proj"], 1)
    mlp.down_proj.weight_loader(mlp.down_proj.weight, w["down_proj"])
    layer = nn.Module()
    layer.self_attn, layer.mlp = attn, mlp
    root = nn.Module()
    root.layers = nn.ModuleList([layer])
    return root, w


def lora_layers_on_rank(rank: int, adapter_dir: str, scale: float, stacked: bool = False) -> str:
    """`stacked`: every layer keeps the pool's A under its weight shard and runs the per-token
    path (stacked GEMM + merge kernel, Triton's interpreter: TRITON_INTERPRET=1)."""
    tp = state().attn_tp
    g = torch.Generator().manual_seed(0)
    root, w = _block(tp.rank, tp.size, g)
    if stacked:  # these tiny layers are narrower than the pool's A: stack them all the same
        lora_layer.STACK_MAX_FRACTION = float("inf")
    pool = LoraPool(root, eviction="lru", targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                   "down_proj"], max_rank=8, pool_slots=2, max_loaded=None,
                    max_slots=4, max_tokens=16, dtype=torch.float32, device=torch.device("cpu"))
    # Requests in slots 0 (base model) and 1 (the adapter), 3 tokens each.
    pool.admit(0, 0, "")
    pool.admit(1, 5, adapter_dir)
    pool.batch.kernels = stacked
    assert all((layer.lora.stacked is not None) == stacked for layer in pool.layers.values())
    pool.prepare(StepPlan.of(sched_slot=[0, 1], sched_tokens_len=[3, 3]), per_token=stacked)
    ab = {k.split(".")[-3]: v for k, v in load_file(f"{adapter_dir}/adapter_model.safetensors").items()
          if ".lora_A." in k}
    bb = {k.split(".")[-3]: v for k, v in load_file(f"{adapter_dir}/adapter_model.safetensors").items()
          if ".lora_B." in k}
    x = torch.randn(6, HIDDEN, generator=g)
    xi = torch.randn(6, INTER, generator=g)
    xo = torch.randn(6, HEADS * HEAD_DIM, generator=g)

    def want(name: str, inp: torch.Tensor) -> torch.Tensor:
        y = inp @ w[name].T
        y[3:] += scale * (inp[3:] @ ab[name].T) @ bb[name].T  # rows 3..5 run the adapter
        return y

    attn, mlp = root.layers[0].self_attn, root.layers[0].mlp
    q_local, k_local, v_local = attn.qkv_proj.split(attn.qkv_proj(x))
    gathered = [tp_all_gather(t.contiguous()) for t in (q_local, k_local, v_local)]
    for got, name in zip(gathered, ("q_proj", "k_proj", "v_proj")):
        torch.testing.assert_close(got, want(name, x), rtol=1e-4, atol=1e-4, msg=name)
    gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
    torch.testing.assert_close(tp_all_gather(gate.contiguous()), want("gate_proj", x), rtol=1e-4,
                               atol=1e-4)
    torch.testing.assert_close(tp_all_gather(up.contiguous()), want("up_proj", x), rtol=1e-4, atol=1e-4)
    # Row-parallel: each rank feeds its columns of the input; the all-reduce sums both parts.
    def cols(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp.size, dim=-1)[tp.rank]

    torch.testing.assert_close(attn.o_proj(cols(xo).contiguous()), want("o_proj", xo), rtol=1e-4,
                               atol=1e-4)
    torch.testing.assert_close(mlp.down_proj(cols(xi).contiguous()), want("down_proj", xi),
                               rtol=1e-4, atol=1e-4)
    return "ok"
