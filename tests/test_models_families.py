"""Phi-3/Phi-4, Gemma 3, GPT-OSS (and DeepSeek-V2/V3) through ModelRunner vs HF transformers on
tiny random checkpoints, fp32 CPU: greedy tokens and logits over chunked prefill and decode,
dummy loading, and TP=2 giving TP=1's tokens. test_e2e_model_families.py serves them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from test_models_numerics import assert_matches_hf, hf_greedy, hf_model_from_config, randomize
from tp_ranks import generate_on_rank, lockstep_generate_on_rank, run_ranks
from transformers import (
    DeepseekV2Config,
    DeepseekV3Config,
    Gemma3TextConfig,
    GptOssConfig,
    Phi3Config,
    PretrainedConfig,
)

from tokenspeed.distributed.groups import ParallelSizes
from tokenspeed.worker.model_runner import ModelRunner
from tokenspeed.worker.offline_scheduler import OfflineScheduler
from tokenspeed_kernels._utils import interpreting

_BASE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}

# LongRoPE: short factors below position 32, long ones from there (the prompts fit the
# original window and the generation crosses it), partial rotary (Phi-4-mini: 0.75).
PHI3_LONGROPE = Phi3Config(
    **_BASE, original_max_position_embeddings=32, partial_rotary_factor=0.75,
    pad_token_id=0, eos_token_id=2,
    rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                     "short_factor": [1.0 + 0.1 * i for i in range(6)],
                     "long_factor": [2.0 + 0.7 * i for i in range(6)]})

# Local layers (window 8, so the prompts outgrow it) around a global one, each with its own
# rope (global: linear-scaled theta 1e5), q/k norm, query_pre_attn_scalar != head_dim, logit
# soft-capping; tied embeddings (Gemma's default).
GEMMA3 = Gemma3TextConfig(
    **{**_BASE, "num_hidden_layers": 4}, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
    final_logit_softcapping=3.0, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})

# Sliding (window 8) and full layers, sinks, YaRN (untruncated correction range, as shipped),
# 8 experts top-2 with biases and the clamped SwiGLU (a low limit, so the clamp bites).
GPT_OSS = GptOssConfig(
    **{**_BASE, "intermediate_size": 32}, head_dim=16, sliding_window=8, num_local_experts=8,
    num_experts_per_tok=2, swiglu_limit=0.5, pad_token_id=0, eos_token_id=2,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                     "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False})

# MLA with a low-rank q (V3) or a plain q_proj (V2), YaRN with mscale; a dense first layer then
# routed + shared experts: V3 sigmoid scores, grouped top-k (4 groups, 2 kept), correction
# bias, renormalised and scaled; V2 softmax, group-limited greedy, scaled.
_DEEPSEEK = {**_BASE, "num_hidden_layers": 3, "num_key_value_heads": 4, "kv_lora_rank": 32,
             "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
             "moe_intermediate_size": 32, "n_routed_experts": 8, "n_shared_experts": 1,
             "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
             "pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1,
             "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 32, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}}
DEEPSEEK_V3 = DeepseekV3Config(**_DEEPSEEK, q_lora_rank=24, routed_scaling_factor=2.5,
                               norm_topk_prob=True)
DEEPSEEK_V2 = DeepseekV2Config(**_DEEPSEEK, q_lora_rank=None, routed_scaling_factor=1.5,
                               topk_method="group_limited_greedy")

FAMILY_CONFIGS: dict[str, PretrainedConfig] = {
    "phi3_longrope": PHI3_LONGROPE,
    "gemma3": GEMMA3,
    "gpt_oss": GPT_OSS,
    "deepseek_v3": DEEPSEEK_V3,
    "deepseek_v2": DEEPSEEK_V2,
}


def _prompts(lengths: list[int]) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate(lengths)]


PROMPTS = _prompts([3, 17, 40, 1, 26])
NEW_TOKENS = 16


@dataclass(frozen=True)
class Case:
    """A config served with `max_context_len` on `prompts`, `new_tokens` each, by the
    `backend` attention backend and the `moe_backend` MoE backend (triton: under the Triton
    interpreter on the CPU)."""

    config: str
    max_context_len: int = 128
    prompts: tuple[tuple[int, ...], ...] = tuple(map(tuple, PROMPTS))
    new_tokens: int = NEW_TOKENS
    backend: str = "torch_native"
    moe_backend: str = "auto"


CASES: dict[str, Case] = {
    # A server context beyond the original window: long factors at every position, as
    # transformers has them for sequences longer than that window (prompts of 33+ tokens).
    "phi3_longrope_long": Case("phi3_longrope", 128, tuple(map(tuple, _prompts([33, 40, 47, 64])))),
    # A server context within the window: short factors, sequences up to 32 tokens.
    "phi3_longrope_short": Case("phi3_longrope", 32, tuple(map(tuple, _prompts([3, 17, 9, 1]))), 12),
    "gemma3": Case("gemma3"),
    # The triton kernels' sliding window (layer by layer): prefill chunks past the window, decode.
    "gemma3_triton": Case("gemma3", prompts=tuple(map(tuple, _prompts([19, 11]))), new_tokens=4,
                          backend="triton"),
    "gpt_oss": Case("gpt_oss"),
    # Sinks in the triton decode / extend kernels, with and without the sliding window (layer by
    # layer), experts through fused_moe (biases, clamped SwiGLU): prefill chunks past the window.
    "gpt_oss_triton": Case("gpt_oss", prompts=tuple(map(tuple, _prompts([19, 11]))), new_tokens=4,
                           backend="triton", moe_backend="triton"),
    "deepseek_v3": Case("deepseek_v3"),
    "deepseek_v2": Case("deepseek_v2"),
    # MLA through tokenspeed_kernels: prefill chunks (mla_extend_attention) and decode.
    "deepseek_v3_triton": Case("deepseek_v3", prompts=tuple(map(tuple, _prompts([19, 11]))),
                               new_tokens=4, backend="triton"),
}


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple]:
    """Per config: (checkpoint dir, HF model), built on first use."""
    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in cache:
            torch.manual_seed(0)
            model = hf_model_from_config(FAMILY_CONFIGS[name])
            randomize(model, seed=1)
            for module in model.modules():  # DeepSeek-V3's routing bias is a buffer
                bias = getattr(module, "e_score_correction_bias", None)
                if bias is not None:
                    bias.copy_(0.3 * torch.randn(bias.shape, generator=torch.Generator().manual_seed(4)))
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            cache[name] = (str(path), model)
        return cache[name]

    return get


def hf_one_by_one(model: torch.nn.Module, prompts: list[list[int]], n: int) -> tuple[list, list]:
    """HF greedy one prompt at a time (a left-padded batch would put the longest prompt's
    positions, and its sliding-window / rope choices, on every row)."""
    tokens, logits = [], []
    for p in prompts:
        t, lg = hf_greedy(model, [p], n)
        tokens += t
        logits += lg
    return tokens, logits


@pytest.mark.parametrize("case", list(CASES))
def test_family_greedy_matches_hf(family_models: Callable[[str], tuple], case: str) -> None:
    c = CASES[case]
    if "triton" in (c.backend, c.moe_backend) and not interpreting():
        # conftest.py sets TRITON_INTERPRET=1 only without CUDA
        pytest.skip("the triton kernels on the CPU need TRITON_INTERPRET=1 (set only without "
                    "CUDA); on a GPU test_family_on_gpu_gives_the_cpu_runs_tokens runs them")
    path, model = family_models(c.config)
    prompts = [list(p) for p in c.prompts]
    ref_tokens, ref_logits = hf_one_by_one(model, prompts, c.new_tokens)
    runner = ModelRunner(path, page_size=4, max_slots=8, max_context_len=c.max_context_len, seed=0,
                         attention_backend=c.backend, moe_backend=c.moe_backend)
    assert runner.config.architecture == type(model).__name__
    assert runner.attention_backend == c.backend
    assert c.moe_backend == "auto" or runner.moe_backend == c.moe_backend
    assert_matches_hf(runner, prompts, ref_tokens, ref_logits, chunk_size=8)


# On the GPU the Triton kernels are compiled (MLA decode and extend, sliding windows), decode steps
# replay CUDA graphs, and fp32 dots may round through TF32: the same tokens, logits a little looser.
GPU_LOGIT_ATOL = 2e-2


def gpu_check_runner(path: str, c: Case, device: str) -> ModelRunner:
    """The GPU check's runner: the case's backends on CUDA; on the CPU (the reference) torch_native
    attention and MoE, "auto" there: with CUDA present conftest.py leaves TRITON_INTERPRET unset,
    and compiled Triton kernels cannot read CPU tensors."""
    backends = (c.backend, c.moe_backend) if device == "cuda" else ("auto", "auto")
    # A fixed pool (not 85% of the GPU): the module's earlier runners may still hold theirs.
    return ModelRunner(path, device=device, page_size=4, num_pages=256, max_slots=8,
                       max_context_len=c.max_context_len, seed=0, attention_backend=backends[0],
                       moe_backend=backends[1])


TRITON_CASES = [k for k, c in CASES.items() if "triton" in (c.backend, c.moe_backend)]


@pytest.mark.parametrize("case", TRITON_CASES)
def test_gpu_checks_cpu_reference_needs_no_interpreter(family_models: Callable[[str], tuple],
                                                       case: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """As on the GPU machine (TRITON_INTERPRET unset): the triton backends on the CPU fail at
    start-up, naming the interpreter (not at the first step: "cpu tensor?"), and the GPU check's
    CPU reference asks for neither."""
    c = CASES[case]
    path, _ = family_models(c.config)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device.*TRITON_INTERPRET=1"):
        ModelRunner(path, page_size=4, max_slots=4, max_context_len=c.max_context_len, seed=0,
                    attention_backend=c.backend, moe_backend=c.moe_backend)
    runner = gpu_check_runner(path, c, "cpu")
    assert (runner.attention_backend, runner.moe_backend) == ("torch_native", "torch_native")


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_family_on_gpu_gives_the_cpu_runs_tokens(family_models: Callable[[str], tuple],
                                                case: str) -> None:
    """The CUDA run (the case's backends) against a torch_native CPU run of the same checkpoint,
    which the test above ties to HF: the GPU machine's transformers may be older than this one
    (GPT-OSS on 5.17 needs hf_model_from_config's fix to be a reference at all)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    c = CASES[case]
    path, _ = family_models(c.config)
    prompts = [list(p) for p in c.prompts]
    res = {}
    for device in ("cpu", "cuda"):
        runner = gpu_check_runner(path, c, device)
        res[device] = OfflineScheduler(runner).generate(prompts, c.new_tokens, chunk_size=8,
                                                        keep_logits=True)
    worst = max((a - b).abs().max().item() for ours, ref in zip(res["cuda"].logits, res["cpu"].logits)
                for a, b in zip(ours, ref))
    print(f"{case}: max |logit diff| CUDA vs CPU {worst:.2e}, cuda graphs up to "
          f"{runner.cuda_graph_max_bs}")
    assert res["cuda"].tokens == res["cpu"].tokens
    assert worst < GPU_LOGIT_ATOL, worst


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_family_dummy_weights_generate(family_models: Callable[[str], tuple], name: str) -> None:
    path, _ = family_models(name)
    runner = ModelRunner(path, page_size=4, max_slots=4, max_context_len=128, seed=0,
                         load_format="dummy")
    res = OfflineScheduler(runner).generate(PROMPTS[:2], 4, chunk_size=8, keep_logits=True)
    assert all(len(t) == 4 for t in res.tokens)
    assert all(torch.isfinite(x).all() for req in res.logits for x in req)


_EP2_A2A = ParallelSizes(world_size=2, attn_tp=2, dense_tp=2, moe_tp=1, ep=2,
                        all2all_backend="torch_all2all")


@pytest.mark.parametrize("name, sizes", [
    ("phi3_longrope", None), ("gemma3", None), ("deepseek_v3", None),
    ("deepseek_v3", ParallelSizes(world_size=2, attn_tp=2, dense_tp=2, moe_tp=1, ep=2)),
    ("deepseek_v2", None), ("deepseek_v3", _EP2_A2A), ("deepseek_v2", _EP2_A2A)],
    ids=["phi3_longrope", "gemma3", "deepseek_v3", "deepseek_v3-ep2", "deepseek_v2",
         "deepseek_v3-ep2-a2a", "deepseek_v2-ep2-a2a"])
def test_family_tp2_matches_tp1(family_models: Callable[[str], tuple], name: str,
                                sizes: ParallelSizes | None) -> None:
    """Phi-3's fused checkpoint tensors (qkv_proj / gate_up_proj) cut per rank; Gemma 3's
    per-head q/k norms on each rank's heads; DeepSeek's MLA heads per rank and its routed
    experts' partial outputs combined across ranks (MoE-TP 2, EP 2, or EP 2 through
    torch_all2all: tokens sent, with DeepSeek's routing, only to their experts' ranks),
    shared experts sharded like a dense MLP."""
    path, _ = family_models(name)
    prompts = PROMPTS[:3]
    ref_tokens, ref_logits, _ = generate_on_rank(0, path, prompts, 8)
    tokens, logits, _ = run_ranks(generate_on_rank, 2, path, prompts, 8, sizes=sizes)[0]
    assert tokens == ref_tokens
    worst = max(abs(a - b).max() for o, r in zip(logits, ref_logits) for a, b in zip(o, r))
    assert worst < 1e-3, worst


# Data-parallel attention: two attention groups with prompts of their own (unequal counts,
# so the MoE all-gather pads and drops rows), decode steps padded to one graph size (the graph's
# body run eagerly) with an idle group replaying it once its requests are done.
DP_GROUPS = [[PROMPTS[0], PROMPTS[2], PROMPTS[3]], [PROMPTS[1]]]
DP_NEW = [8, 5]
DP_LAYOUTS = {
    "dp2-ep2": ParallelSizes(world_size=2, attn_tp=1, dense_tp=1, moe_tp=1, ep=2,
                             all2all_backend="allgather_reducescatter"),
    "dp2-moetp2": ParallelSizes(world_size=2, attn_tp=1, dense_tp=1, moe_tp=2, ep=1,
                                all2all_backend="allgather_reducescatter"),
    "dp2-ep2-a2a": ParallelSizes(world_size=2, attn_tp=1, dense_tp=1, moe_tp=1, ep=2,
                                 all2all_backend="torch_all2all"),
    # MLA's heads split over each group's two ranks, experts over EP 2 x MoE-TP 2.
    "dp2-attntp2-ep2-moetp2": ParallelSizes(world_size=4, attn_tp=2, dense_tp=2, moe_tp=2, ep=2,
                                            all2all_backend="allgather_reducescatter"),
}


@pytest.mark.parametrize("layout", list(DP_LAYOUTS))
@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
def test_deepseek_dp_attention_matches_tp1(family_models: Callable[[str], tuple], name: str,
                                           layout: str) -> None:
    """DeepSeek's routing (V3: sigmoid, bias, grouped top-k, renormalised, scaled; V2: softmax,
    group-limited greedy, scaled) travels with the tokens through data-parallel attention's
    exchanges; each group's MLA runs its own requests over its own cache."""
    path, _ = family_models(name)
    sizes = DP_LAYOUTS[layout]
    ref_tokens, ref_logits, _ = generate_on_rank(0, path, [p for g in DP_GROUPS for p in g],
                                                 max(DP_NEW))
    runs = run_ranks(lockstep_generate_on_rank, sizes.world_size, path, DP_GROUPS, DP_NEW,
                     sizes.all2all_backend != "torch_all2all", 64, sizes=sizes)
    for rank, (tokens, logits, _) in enumerate(runs):
        group = rank // sizes.attn_tp
        first = sum(len(g) for g in DP_GROUPS[:group])
        n = DP_NEW[group]
        assert tokens == [t[:n] for t in ref_tokens[first:first + len(tokens)]], f"rank {rank}"
        worst = max(abs(a - b).max() for o, r in zip(logits, ref_logits[first:])
                    for a, b in zip(o, r))
        assert worst < 1e-3, (rank, worst)


# --- Gemma 3 multimodal checkpoints (Gemma3ForConditionalGeneration: gemma-3-4b/12b/27b) -------

@pytest.mark.parametrize("layout", ["as saved", "hub config, new tensor names"])
def test_gemma3_multimodal_checkpoint_serves_its_text_tower(tmp_path: Path, layout: str) -> None:
    """The text tower of a multimodal checkpoint gives HF's tokens (the vision tower is not
    read). "hub config": text_config lists only what differs from transformers' defaults, as
    Google's configs do; "new tensor names": `model.language_model.*` (transformers >= 4.52)
    rather than the published `language_model.model.*`."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig

    # No final soft-capping: the released multimodal configs have none, and HF's
    # Gemma3ForConditionalGeneration would not apply it.
    text = {k: v for k, v in GEMMA3.to_dict().items() if k in Gemma3TextConfig().to_dict()}
    text["final_logit_softcapping"] = None
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=255,
        boi_token_index=253, eoi_token_index=254)).eval()
    randomize(model, seed=3)
    model.save_pretrained(tmp_path)
    if layout != "as saved":
        cfg = json.loads((tmp_path / "config.json").read_text())
        defaults = Gemma3TextConfig().to_dict()
        cfg["text_config"] = {k: v for k, v in cfg["text_config"].items()
                              if k not in defaults or defaults[k] != v}
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        tensors = load_file(tmp_path / "model.safetensors")
        save_file({k.replace("language_model.model.", "model.language_model."): v
                   for k, v in tensors.items()}, tmp_path / "model.safetensors",
                  metadata={"format": "pt"})
    prompts = PROMPTS[:3]
    ref_tokens, ref_logits = hf_one_by_one(model, prompts, 8)
    runner = ModelRunner(str(tmp_path), page_size=4, max_slots=4, max_context_len=128, seed=0)
    assert runner.config.architecture == "Gemma3ForCausalLM"
    assert runner.config.sliding_windows == [8, 8, None, 8]
    assert_matches_hf(runner, prompts, ref_tokens, ref_logits, chunk_size=8)


# --- GPT-OSS MXFP4 -----------------------------------------------------------------------------

_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0,
                     -4.0, -6.0])


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] float → (blocks uint8 [..., out, in / 32, 16], scales uint8 [..., out, in / 32]),
    OpenAI's layout: per 32 values a power-of-two scale, each value the nearest E2M1."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1).clamp(min=1e-12)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exp).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - _FP4).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def test_mxfp4_dequantisation_matches_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tokenspeed.models.gpt_oss import dequantize_mxfp4

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 134, (3, 8, 2), generator=g, dtype=torch.uint8)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    torch.testing.assert_close(dequantize_mxfp4(blocks, scales), ref.transpose(1, 2))
    w = torch.randn(2, 4, 64, generator=g)
    back = dequantize_mxfp4(*quantize_mxfp4(w))
    # Within half the widest step (4 → 6) of the largest group's scale, amax / 6 <= 2^e < amax / 3.
    assert (back - w).abs().max() <= w.abs().max() / 3
    assert (back - w).abs().mean() < 0.05 * w.abs().mean() * 6


def test_gpt_oss_mxfp4_checkpoint_matches_hf(tmp_path: Path) -> None:
    """Experts stored as OpenAI ships them (MXFP4 blocks + scales, biases in the clear): served
    with HF's greedy tokens on the dequantised weights."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    model = hf_model_from_config(GPT_OSS)
    randomize(model, seed=2)
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = quantize_mxfp4(p.data.transpose(1, 2))  # [E, out, in]
                from tokenspeed.models.gpt_oss import dequantize_mxfp4

                p.copy_(dequantize_mxfp4(blocks, scales).transpose(1, 2))
                tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    saved = {k: v for k, v in saved.items()
             if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**saved, **tensors}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    prompts = PROMPTS[:3]
    ref_tokens, ref_logits = hf_one_by_one(model, prompts, 8)
    runner = ModelRunner(str(tmp_path), page_size=4, max_slots=4, max_context_len=128, seed=0)
    assert_matches_hf(runner, prompts, ref_tokens, ref_logits, chunk_size=8)


def test_gpt_oss_gets_the_triton_backends_by_default() -> None:
    """On a GPU "auto" means triton for every model: its kernels have GPT-OSS's sinks and
    biased, clamped-SwiGLU experts (gpt_oss_triton above), so GPT-OSS runs graph-captured."""
    from tokenspeed.layers.attention import resolve_backend_name
    from tokenspeed.layers.moe import GRAPH_SAFE_MOE_BACKENDS, resolve_moe_backend

    gpu = torch.device("cuda")
    assert resolve_backend_name("auto", gpu) == resolve_moe_backend(None, gpu) == "triton"
    assert "triton" in GRAPH_SAFE_MOE_BACKENDS


def test_gpt_oss_refuses_backends_without_sinks(family_models: Callable[[str], tuple]) -> None:
    """FlashInfer has no attention sinks: a GPT-OSS model on it fails at start-up, naming them
    and the backends that have them (flashinfer itself is not needed to check the layers)."""
    from tokenspeed.layers.attention import check_layers
    from tokenspeed.layers.flashinfer_attention import FlashInferBackend

    path, _ = family_models("gpt_oss")
    runner = ModelRunner(path, page_size=4, max_slots=4, max_context_len=128, seed=0)
    with pytest.raises(ValueError, match="'flashinfer' has no attention sinks.*triton or torch_native"):
        check_layers(object.__new__(FlashInferBackend), runner.model)
    check_layers(runner.backend, runner.model)  # torch_native (the CPU's "auto") has them
