"""MoE models (Qwen3-MoE, Mixtral) through the ModelRunner vs HF transformers, fp32 CPU: greedy
tokens and logits with both MoE backends (triton under the interpreter), GGUF loading, and the
expert/MoE-tensor-parallel split: simulated ranks' partial outputs sum to the one-rank output."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from test_models_numerics import TINY_NEW_TOKENS, TINY_PROMPTS, assert_matches_hf, hf_greedy, randomize
from test_models_weights import llama_cpp_permute
from transformers import AutoModelForCausalLM, MixtralConfig, PretrainedConfig, Qwen3MoeConfig

from tokenspeed.distributed.groups import ParallelSizes
from tokenspeed.layers.moe import FusedMoE, MoeOptions, MoeParallel, Routing
from tokenspeed.models.config import check_expert_parallel, config_from_hf_dict
from tokenspeed.models.moe_base import SparseMoeBlock
from tokenspeed.worker.model_runner import ModelRunner
from tokenspeed.worker.offline_scheduler import OfflineScheduler

_BASE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}

TINY_MOE_CONFIGS: dict[str, PretrainedConfig] = {
    # 3 layers: layer 1 is dense (mlp_only_layers), so dense and sparse layers mix.
    "qwen3_moe_norm_topk": Qwen3MoeConfig(**_BASE, head_dim=32, num_experts=16, num_experts_per_tok=4,
                                          moe_intermediate_size=32, norm_topk_prob=True,
                                          mlp_only_layers=[1]),
    # decoder_sparse_step 2: only layer 1 is sparse; unnormalised top-k weights.
    "qwen3_moe_sparse_step": Qwen3MoeConfig(**_BASE, num_experts=8, num_experts_per_tok=2,
                                            moe_intermediate_size=48, norm_topk_prob=False,
                                            decoder_sparse_step=2),
    "mixtral": MixtralConfig(**_BASE, num_local_experts=8, num_experts_per_tok=2),
}


@pytest.fixture(scope="module")
def tiny_moe_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple]:
    """Per config: (checkpoint dir, HF model, HF tokens, HF logits), built on first use."""
    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in cache:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(TINY_MOE_CONFIGS[name]).eval()
            randomize(model, seed=1)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            cache[name] = (str(path), model, *hf_greedy(model, TINY_PROMPTS, TINY_NEW_TOKENS))
        return cache[name]

    return get


# The triton backend runs under the Triton interpreter here (~0.3 s per MoE layer call): one config
# through the runner; kernels/tests/test_moe.py covers its shapes, test_moe_layer_* below the layer.
CASES = [(name, "torch_native") for name in TINY_MOE_CONFIGS] + [("qwen3_moe_sparse_step", "triton")]


@pytest.mark.parametrize(("name", "backend"), CASES)
def test_tiny_moe_greedy_matches_hf(tiny_moe_models: Callable[[str], tuple], name: str,
                                    backend: str) -> None:
    path, _, ref_tokens, ref_logits = tiny_moe_models(name)
    runner = ModelRunner(path, page_size=16, max_slots=8, max_context_len=128, seed=0,
                         moe_backend=backend)
    assert runner.config.num_experts == TINY_MOE_CONFIGS[name].num_local_experts
    assert_matches_hf(runner, TINY_PROMPTS, ref_tokens, ref_logits, chunk_size=8)


# --- GGUF ------------------------------------------------------------------------------------

def write_gguf(hf: torch.nn.Module, path: Path, arch: str) -> None:
    """A float32 GGUF of `hf` laid out as llama.cpp's convert_hf_to_gguf.py writes MoE models:
    experts stacked per layer ([E, I, H], down [E, H, I]); `llama` (Mixtral) q/k rows permuted."""
    import gguf

    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        for hf_name, gguf_name in names.items():
            if pre + hf_name + ".weight" not in sd:
                continue
            t = sd[pre + hf_name + ".weight"]
            if arch == "llama" and hf_name in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = c.num_attention_heads if "q_proj" in hf_name else c.num_key_value_heads
                t = llama_cpp_permute(t, heads)
            w.add_tensor(f"blk.{i}.{gguf_name}.weight", t)
        gate_up, down = sd[pre + "mlp.experts.gate_up_proj"], sd[pre + "mlp.experts.down_proj"]
        inter = gate_up.shape[1] // 2
        w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gate_up[:, :inter]))
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(gate_up[:, inter:]))
        w.add_tensor(f"blk.{i}.ffn_down_exps.weight", down)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


GGUF_CONFIGS = {
    # llama.cpp's qwen3moe: every layer sparse, top-k weights renormalised.
    "qwen3moe": Qwen3MoeConfig(**{**_BASE, "num_hidden_layers": 2}, num_experts=8, num_experts_per_tok=2,
                               moe_intermediate_size=32, norm_topk_prob=True),
    "llama": MixtralConfig(**{**_BASE, "num_hidden_layers": 2}, num_local_experts=4,
                           num_experts_per_tok=2),
}


@pytest.mark.parametrize("arch", list(GGUF_CONFIGS))
def test_moe_gguf_loads_like_safetensors(tmp_path: Path, arch: str) -> None:
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(GGUF_CONFIGS[arch]).eval()
    randomize(hf, seed=2)
    hf.save_pretrained(tmp_path / "st")
    (tmp_path / "gguf").mkdir()
    write_gguf(hf, tmp_path / "gguf" / "model.gguf", arch)
    prompts, n = TINY_PROMPTS[:3], 6
    kw = {"page_size": 16, "max_slots": 4, "max_context_len": 128}
    st = ModelRunner(str(tmp_path / "st"), **kw)
    gg = ModelRunner(str(tmp_path / "gguf"), **kw)
    assert gg.config.architecture == st.config.architecture
    assert (gg.config.num_experts, gg.config.num_experts_per_tok, gg.config.moe_intermediate_size,
            gg.config.norm_topk_prob) == (st.config.num_experts, st.config.num_experts_per_tok,
                                          st.config.moe_intermediate_size, True)
    ours = dict(gg.model.named_parameters())
    for name, p in st.model.named_parameters():
        torch.testing.assert_close(ours[name], p, rtol=0, atol=0, msg=name)
    a = OfflineScheduler(st).generate(prompts, n, chunk_size=8, keep_logits=True)
    b = OfflineScheduler(gg).generate(prompts, n, chunk_size=8, keep_logits=True)
    assert a.tokens == b.tokens
    if arch == "qwen3moe":  # transformers reads qwen3moe GGUF tensors too: an independent reading of
        # the layout (given the config: it does not map expert_feed_forward_length)
        ref = AutoModelForCausalLM.from_pretrained(tmp_path / "gguf", gguf_file="model.gguf",
                                                   config=hf.config, dtype=torch.float32).eval()
        for name, p in hf.state_dict().items():
            torch.testing.assert_close(ref.state_dict()[name], p, msg=name)


# --- expert parallel x MoE tensor parallel, simulated on one process ----------------------------

GRID = [MoeParallel(ep_rank=e, ep_size=2, tp_rank=t, tp_size=2) for e in range(2) for t in range(2)]


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_moe_layer_rank_partials_sum_to_one_rank(backend: str) -> None:
    """EP=2 x moe-TP=2: every rank loads its slice of the same HF expert tensors; the four partial
    outputs add up to the one-rank output (what the all-reduce in SparseMoeBlock.comm computes)."""
    experts, top_k, hidden, inter, tokens = 8, 2, 32, 24, 13
    gen = torch.Generator().manual_seed(0)
    hf = {(e, s): torch.randn((hidden, inter) if s == "down" else (inter, hidden), generator=gen)
          for e in range(experts) for s in ("gate", "up", "down")}
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)

    def layer(parallel: MoeParallel) -> FusedMoE:
        moe = FusedMoE(experts, top_k, hidden, inter, True, MoeOptions(backend, parallel))
        held = [e for e in range(experts) if moe.load_expert(e, "gate", hf[e, "gate"])]
        for e in held:
            moe.load_expert(e, "up", hf[e, "up"])
            moe.load_expert(e, "down", hf[e, "down"])
        assert len(held) == experts // parallel.ep_size
        return moe

    whole = layer(MoeParallel())(x, logits)
    parts = [layer(p)(x, logits) for p in GRID]
    torch.testing.assert_close(sum(parts), whole, rtol=1e-4, atol=1e-4)
    assert all(not torch.allclose(p, whole, atol=1e-3) for p in parts)  # each rank really is partial


def test_gpt_oss_experts_triton_matches_torch_native() -> None:
    """GPT-OSS's experts (biases on both projections, the clamped SwiGLU with a limit that bites)
    on the triton backend (fused_moe) against torch_native, whole and as EP=2 x moe-TP=2 slices
    (the down bias on moe-TP rank 0 only)."""
    from tokenspeed.layers.moe import ExpertActivation

    experts, top_k, hidden, inter, tokens = 8, 4, 32, 24, 13
    gen = torch.Generator().manual_seed(1)
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter),
              "gate_bias": (inter,), "up_bias": (inter,), "down_bias": (hidden,)}
    hf = {(e, s): torch.randn(shape, generator=gen) * (0.5 if s.endswith("bias") else 0.3)
          for e in range(experts) for s, shape in shapes.items()}
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    act = ExpertActivation("swiglu_oai", 1.702, 0.8)

    def layer(backend: str, parallel: MoeParallel) -> FusedMoE:
        moe = FusedMoE(experts, top_k, hidden, inter, True, MoeOptions(backend, parallel), bias=True,
                       activation=act)
        for e in range(experts):
            for s in shapes:
                moe.load_expert(e, s, hf[e, s])
        return moe

    for parallel in [MoeParallel(), *GRID]:
        ref = layer("torch_native", parallel)(x, logits)
        got = layer("triton", parallel)(x, logits)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    silu = FusedMoE(experts, top_k, hidden, inter, True, MoeOptions("torch_native"), bias=True)
    silu.load_state_dict(layer("torch_native", MoeParallel()).state_dict())
    assert not torch.allclose(silu(x, logits), layer("triton", MoeParallel())(x, logits), atol=1e-3)


class ThreadAllReduce:
    """A MoeCommunication for ranks that are threads of one process: combine = sum over ranks,
    in rank order (so every rank gets bitwise the same result, as NCCL's all-reduce gives)."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world)
        self.slots: list[torch.Tensor | None] = [None] * world

    def rank(self, r: int) -> object:
        outer = self

        class Rank:
            def dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, Routing]:
                return x, routing

            def combine(self, partial: torch.Tensor) -> torch.Tensor:
                outer.slots[r] = partial
                outer.barrier.wait()
                total = sum(outer.slots[1:], outer.slots[0].clone())  # type: ignore[union-attr]
                outer.barrier.wait()  # nobody overwrites a slot before all have summed
                return total

        return Rank()


def test_moe_model_ep2_tp2_tokens_match_one_rank(tiny_moe_models: Callable[[str], tuple]) -> None:
    """A whole Qwen3-MoE model on 4 simulated ranks (threads, all-reduce at the SparseMoeBlock hook)
    gives the one-rank greedy tokens and logits."""
    path = tiny_moe_models("qwen3_moe_norm_topk")[0]
    prompts, n = TINY_PROMPTS[:4], 8
    kw = {"page_size": 16, "max_slots": 4, "max_context_len": 128, "moe_backend": "torch_native"}
    ref = OfflineScheduler(ModelRunner(path, **kw)).generate(prompts, n, chunk_size=8, keep_logits=True)
    comm = ThreadAllReduce(len(GRID))
    runners = [ModelRunner(path, moe_parallel=p, **kw) for p in GRID]
    for r, runner in enumerate(runners):
        blocks = [m for m in runner.model.modules() if isinstance(m, SparseMoeBlock)]
        assert len(blocks) == 2 and blocks[0].experts.num_local == 8
        for b in blocks:
            b.comm = comm.rank(r)  # type: ignore[assignment]
    results: list[object] = [None] * len(GRID)

    def run(r: int) -> None:
        results[r] = OfflineScheduler(runners[r]).generate(prompts, n, chunk_size=8, keep_logits=True)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(GRID))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for res in results:
        assert res is not None and res.tokens == ref.tokens  # type: ignore[attr-defined]
        worst = max((a - b).abs().max().item() for ours, theirs in zip(res.logits, ref.logits)  # type: ignore[attr-defined]
                    for a, b in zip(ours, theirs))
        assert worst < 1e-4


def test_expert_parallel_size_is_checked_against_the_model(tmp_path: Path) -> None:
    TINY_MOE_CONFIGS["mixtral"].save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"--ep-size 3 does not divide the model's 8 experts "
                                         r"\(MixtralForCausalLM\)"):
        ModelRunner(str(tmp_path), load_format="dummy", page_size=16, max_slots=2, max_context_len=32,
                    moe_parallel=MoeParallel(ep_size=3))
    dense = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
             "num_attention_heads": 4, "architectures": ["LlamaForCausalLM"]}
    with pytest.raises(ValueError, match=r"--ep-size 2: model LlamaForCausalLM has no experts"):
        check_expert_parallel(config_from_hf_dict(dense), 2)


def test_moe_flags_reach_the_worker_and_are_checked_at_launch(tmp_path: Path) -> None:
    from tokenspeed.config import ConfigError, parse_serve_args
    from tokenspeed.launch.serve import LaunchError, check_moe_settings

    cfg = parse_serve_args(["m", "--moe-backend", "torch_native", "--dry-run"])
    assert cfg.worker_dict()["moe_backend"] == "torch_native" and cfg.ep_size == 1
    with pytest.raises(ConfigError, match="moe-backend"):
        parse_serve_args(["m", "--moe-backend", "cutlass"])
    with pytest.raises(ConfigError, match="'pplx' is not built into TokenSpeed: .* Instead, use "
                       "--all2all-backend allgather_reducescatter"):
        parse_serve_args(["m", "--all2all-backend", "pplx"])
    # The launcher's model-dependent check (the flag table alone cannot know the expert count).
    TINY_MOE_CONFIGS["mixtral"].save_pretrained(tmp_path / "moe")

    def ep(n: int) -> ParallelSizes:
        return ParallelSizes(world_size=n, attn_tp=n, dense_tp=n, moe_tp=1, ep=n)

    with pytest.raises(LaunchError, match=r"--ep-size 3 does not divide the model's 8 experts \(Mixtral"):
        check_moe_settings(cfg, tmp_path / "moe", "cpu", ep(3))
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
         "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4}))
    with pytest.raises(LaunchError, match=r"--ep-size 2: model LlamaForCausalLM has no experts"):
        check_moe_settings(cfg, tmp_path / "dense", "cpu", ep(2))
    check_moe_settings(cfg, tmp_path / "moe", "cpu", ep(2))
    check_moe_settings(cfg, tmp_path / "moe", "cpu", ep(1))


def test_moe_dummy_weights_are_seeded_and_sane(tmp_path: Path) -> None:
    TINY_MOE_CONFIGS["qwen3_moe_norm_topk"].save_pretrained(tmp_path)
    kw = {"load_format": "dummy", "page_size": 16, "max_slots": 2, "max_context_len": 32}
    a, b = ModelRunner(str(tmp_path), seed=1, **kw), ModelRunner(str(tmp_path), seed=1, **kw)
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert pa[experts].shape == (16, 64, 64)
    torch.testing.assert_close(pa[experts], pb[experts], rtol=0, atol=0)
    assert 0.01 < pa[experts].std().item() < 0.05
    res = OfflineScheduler(a).generate([[1, 2, 3, 4, 5]], 3, keep_logits=True)
    assert torch.isfinite(torch.stack(res.logits[0])).all()
