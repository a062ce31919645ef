"""Block-wise FP8 checkpoints as DeepSeek-V3 ships them (weight_block_size [128, 128],
`weight_scale_inv` per 128x128 tile), on CPU: a tiny random DeepSeek-V3 saved by transformers,
its linears and routed experts block-quantised here into a checkpoint with V3's
quantization_config, served by ModelRunner against HF transformers on the dequantised weights
(fp32). The weights stay fp8 in memory; what is refused (other block sizes, formats, layouts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_models_numerics import hf_greedy, randomize
from transformers import AutoModelForCausalLM, DeepseekV3Config

from tokenspeed.layers.linear import ColumnLinear, RowLinear
from tokenspeed.layers.moe import FusedMoE
from tokenspeed.layers.quantization.fp8 import FP8, fp8_linear, quantize_blocks, reference_block_linear
from tokenspeed.layers.quantization.methods import QuantizationError, resolve_quantization
from tokenspeed.worker.model_runner import ModelRunner
from tokenspeed.worker.offline_scheduler import OfflineScheduler

V3_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]}
# hidden 192 (K off the 128 grid, two K-blocks), MLP and expert widths 128 (gate/up fuse on the
# grid), MLA projections narrower than a block (kv_a_proj_with_mqa: 40 rows, q_b_proj: 96).
CONFIG = DeepseekV3Config(
    vocab_size=256, hidden_size=192, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, moe_intermediate_size=128,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
    first_k_dense_replace=1, q_lora_rank=24, routed_scaling_factor=2.5, norm_topk_prob=True,
    pad_token_id=0, eos_token_id=2, bos_token_id=1)
PROMPT = [(7 * j) % 250 + 3 for j in range(13)]


def tiles(n: int, k: int, grid: torch.Tensor) -> torch.Tensor:
    """A [ceil(N/128), ceil(K/128)] grid spread over its [N, K] tiles."""
    return grid.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]


def quantize_tiled(t: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(fp8, scale_inv, dequantised) of `t` with each 128x128 tile first scaled by its own
    power of two (1/8 ... 8), so that a scale read for the wrong tile shows in the output."""
    n, k = t.shape
    grid = 2.0 ** torch.randint(-3, 4, (-(-n // 128), -(-k // 128)), generator=gen).float()
    q, s = quantize_blocks(t * tiles(n, k, grid))
    return q, s, q.float() * tiles(n, k, s)


def _quantised(name: str) -> bool:
    """V3's FP8 tensors: every projection in the layers; not the router, norms, embeddings, head."""
    return name.startswith("model.layers.") and name.endswith(("_proj.weight", "_with_mqa.weight"))


@pytest.fixture(scope="module")
def v3_fp8(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.nn.Module, int]:
    """(FP8 checkpoint dir, HF model holding exactly the dequantised weights, fp8 element count).
    Each tile is scaled by its own factor (x1/8 .. x8) before quantising, so a scale applied to
    the wrong tile shows."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG).eval()
    randomize(model, seed=1)
    src = tmp_path_factory.mktemp("v3_src")
    model.save_pretrained(src)
    gen = torch.Generator().manual_seed(7)
    tensors, out, deq, fp8_elems = load_file(str(src / "model.safetensors")), {}, {}, 0
    for name, t in tensors.items():
        if not _quantised(name):
            out[name] = t
            continue
        q, s, deq[name] = quantize_tiled(t, gen)
        out[name], out[name + "_scale_inv"] = q, s
        fp8_elems += q.numel()
    dst = tmp_path_factory.mktemp("v3_fp8")
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = V3_QUANT
    (dst / "config.json").write_text(json.dumps(cfg))
    # The reference: HF on exactly the dequantised weights, fp32 (loaded through from_pretrained:
    # transformers fuses the per-expert tensors of the checkpoint in memory).
    save_file({**tensors, **deq}, str(src / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    return str(dst), model, fp8_elems


def _fp8_modules(runner: ModelRunner) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in runner.model.named_modules()
            if isinstance(m, (ColumnLinear, RowLinear, FusedMoE)) and
            getattr(m, "weight", getattr(m, "gate_up_proj", None)).dtype == FP8}


def test_weights_stay_fp8_with_their_block_scales(v3_fp8: tuple) -> None:
    path, _, fp8_elems = v3_fp8
    runner = ModelRunner(path, page_size=4, max_slots=4, max_context_len=64, seed=0)
    assert runner.fp8 is not None and runner.fp8.weight_block == (128, 128)
    layers = runner.model.model.layers
    attn = layers[0].self_attn
    assert attn.kv_a_proj_with_mqa.weight.dtype == FP8
    assert attn.kv_a_proj_with_mqa.weight_scale.shape == (1, 2)  # 40 x 192: one row, two columns
    assert layers[0].mlp.gate_up_proj.weight_scale.shape == (2, 2)  # gate's block row, then up's
    experts = layers[1].mlp.experts
    assert experts.gate_up_proj.dtype == FP8 and experts.down_proj.dtype == FP8
    assert experts.gate_up_proj_scale.shape == (8, 2, 2) and experts.down_proj_scale.shape == (8, 2, 1)
    assert layers[1].mlp.shared_experts.down_proj.weight.dtype == FP8
    # kv_b_proj is read as W_UK / W_UV matrices: dequantised once loaded; the router stays fp32.
    assert attn.kv_b_proj.weight.dtype == torch.float32 and attn.kv_b_proj.weight_scale is None
    assert layers[1].mlp.gate.weight.dtype == torch.float32
    assert runner.model.lm_head.weight.dtype == torch.float32
    # Every fp8 byte of the checkpoint is an fp8 byte in memory, but kv_b_proj's.
    held = sum(p.numel() for m in _fp8_modules(runner).values() for p in m.parameters(recurse=False)
               if p.dtype == FP8)
    kv_b = CONFIG.num_hidden_layers * 4 * (16 + 12) * 32
    assert held == fp8_elems - kv_b


def test_without_activation_rounding_the_model_is_hf_on_the_dequantised_weights(
        v3_fp8: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """The weight path alone (block scales on the right tiles, fused gate/up, the experts, the
    dequantised kv_b_proj): with the activations' fp8 rounding taken out of the reference GEMM,
    HF's greedy tokens and logits to fp32 rounding. A scale on the wrong tile (tiles x1/8 .. x8
    apart) is off by far more."""
    import tokenspeed_kernels.fp8_block as blocks

    def unrounded(x: torch.Tensor, group: int = 128, dtype: object = None) -> tuple:
        return x.float(), torch.ones(x.shape[0], -(-x.shape[1] // group))

    monkeypatch.setattr(blocks, "ref_per_token_group_quant_fp8", unrounded)
    path, model, _ = v3_fp8
    ref_tokens, ref_logits = hf_greedy(model, [PROMPT], 6)
    runner = ModelRunner(path, page_size=4, max_slots=4, max_context_len=64, seed=0)
    res = OfflineScheduler(runner).generate([PROMPT], 6, chunk_size=8, keep_logits=True)
    assert res.tokens[0] == ref_tokens[0]
    worst = max((a - b).abs().max().item() for a, b in zip(res.logits[0], ref_logits[0]))
    assert worst < 1e-4, worst


def test_logits_track_hf_within_the_activation_rounding(v3_fp8: tuple) -> None:
    """The real path: every GEMM input rounded to e4m3 per token per 128-group (relative error
    <= 2^-4 an element, ~3.6% rms), ~5 GEMMs a layer over 3 layers. Teacher-forced on HF's
    greedy continuation (8 positions): relative logit error per position seen 0.05..0.13, bound
    0.2; top-1 agrees at 7 of 8 (the flip a near-tie: margin 0.06 logit std); every flip must be
    a near-tie (margin < 0.3 std) and at least 6 of 8 agree."""
    path, model, _ = v3_fp8
    ref_tokens, ref_logits = hf_greedy(model, [PROMPT], 8)
    runner = ModelRunner(path, page_size=4, max_slots=8, max_context_len=64, seed=0)
    prompts = [PROMPT + ref_tokens[0][:i] for i in range(8)]  # each position once, teacher-forced
    res = OfflineScheduler(runner).generate(prompts, 1, chunk_size=64, keep_logits=True)
    agree = 0
    for i, ref in enumerate(ref_logits[0]):
        got = res.logits[i][0]
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < 0.2, (i, err)
        if res.tokens[i][0] == ref_tokens[0][i]:
            agree += 1
        else:
            top2 = ref.topk(2).values
            assert (top2[0] - top2[1]).item() < 0.3 * ref.std().item(), i
    assert agree >= 6


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter's check (CPU-only "
                    "machines); test_gpu_kernels_give_the_reference_logits covers the GPU")
def test_triton_moe_backend_gives_the_torch_native_logits(v3_fp8: tuple) -> None:
    """The routed experts through fused_moe's block-scaled GEMMs (under the interpreter) against
    the per-expert reference GEMMs: the same roundings, so fp32 summation order is all that
    differs (an activation landing on the other side of an fp8 rounding boundary: rare, small)."""
    path, _, _ = v3_fp8
    logits = {}
    for backend in ("torch_native", "triton"):
        runner = ModelRunner(path, page_size=4, max_slots=4, max_context_len=64, seed=0,
                             moe_backend=backend)
        res = OfflineScheduler(runner).generate([PROMPT[:9]], 2, chunk_size=16, keep_logits=True)
        logits[backend] = torch.stack(res.logits[0])
    ref = logits["torch_native"]
    assert ((logits["triton"] - ref).norm() / ref.norm()).item() < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_kernels_give_the_reference_logits(v3_fp8: tuple, dtype: str) -> None:
    """On CUDA the dense linears run w8a8_block_matmul and the experts fused_moe's block GEMMs
    (decode steps inside CUDA graphs): the CPU reference's logits, up to the tensor cores' fp8
    partial sums (fp32 model) or bf16 activations, whose rounding moves activations across
    fp8 rounding boundaries layer after layer (an H100, session 25: bf16 0.112; bounds 2% / 15%)."""
    path, _, _ = v3_fp8
    out = {}
    for device in ("cpu", "cuda"):
        runner = ModelRunner(path, page_size=4, max_slots=4, max_context_len=64, seed=0,
                             device=device, dtype=dtype)
        res = OfflineScheduler(runner).generate([PROMPT], 4, chunk_size=8, keep_logits=True)
        out[device] = (res.tokens[0], [lg.float().cpu() for lg in res.logits[0]])
    (ref_tokens, ref), (tokens, got) = out["cpu"], out["cuda"]
    same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
    for a, b in zip(got[: same + 1], ref[: same + 1]):  # the steps that saw the same context
        assert ((a - b).norm() / b.norm()).item() < (0.02 if dtype == "float32" else 0.15)


def test_block_linear_is_the_reference_and_uses_each_tiles_scale() -> None:
    gen = torch.Generator().manual_seed(3)
    q, s = quantize_blocks(torch.randn(200, 300, generator=gen))
    x = torch.randn(5, 300, generator=gen)
    out = fp8_linear(x, q, s)  # CPU: the torch reference
    torch.testing.assert_close(out, reference_block_linear(x, q, s), rtol=0, atol=0)
    w = q.float() * s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert ((out - x @ w.T).norm() / (x @ w.T).norm()).item() < 0.05  # activation rounding only
    s2 = s.clone()
    s2[1, 2] *= 2  # one tile's scale: only rows 128.. move
    moved = (fp8_linear(x, q, s2) - out).abs().amax(dim=0)
    assert moved[:128].eq(0).all() and moved[128:].gt(0).any()


def _deq(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    n, k = q.shape[-2:]
    return q.float() * s.repeat_interleave(128, -2)[..., :n, :].repeat_interleave(128, -1)[..., :k]


def test_tensor_parallel_shards_take_their_block_rows_and_columns() -> None:
    """Rank 1 of 2: a fused gate/up's rows of each half, a row-parallel layer's columns, an
    expert's moe-TP slice; each dequantises to its slice of the full dequantised weight."""
    from tokenspeed.layers.linear import GateUpLinear
    from tokenspeed.layers.moe import MoeOptions, MoeParallel
    from tokenspeed.layers.quantization.fp8_model import prepare_fp8_checkpoint
    from tokenspeed.layers.quantization.methods import Fp8Config

    gen = torch.Generator().manual_seed(5)
    gate, up, down = (quantize_blocks(torch.randn(*shape, generator=gen) * 2.0 ** torch.randint(
        -3, 4, (1,), generator=gen)) for shape in ((512, 300), (512, 300), (300, 512)))
    gate_up, row = GateUpLinear(300, 512, tp_rank=1, tp_size=2), RowLinear(512, 300, tp_rank=1, tp_size=2)
    experts = FusedMoE(2, 1, 300, 512, False, MoeOptions(parallel=MoeParallel(tp_rank=1, tp_size=2)))
    for module in (gate_up, row):
        prepare_fp8_checkpoint(module, Fp8Config("fp8", weight_block=(128, 128)))
    experts.make_fp8_block((128, 128))
    for shard, (q, s) in enumerate((gate, up)):
        gate_up.weight_loader(gate_up.weight, q, shard)
        gate_up.weight_loader(gate_up.weight_scale, s, shard)
        experts.load_expert(1, ("gate", "up")[shard], q)
        experts.load_expert(1, ("gate_scale", "up_scale")[shard], s)
    row.weight_loader(row.weight, down[0])
    row.weight_loader(row.weight_scale, down[1])
    experts.load_expert(1, "down", down[0])
    experts.load_expert(1, "down_scale", down[1])
    halves = torch.cat([_deq(*gate)[256:], _deq(*up)[256:]])
    assert torch.equal(_deq(gate_up.weight, gate_up.weight_scale), halves)
    assert torch.equal(_deq(experts.gate_up_proj[1], experts.gate_up_proj_scale[1]), halves)
    assert torch.equal(_deq(row.weight, row.weight_scale), _deq(*down)[:, 256:])
    assert torch.equal(_deq(experts.down_proj[1], experts.down_proj_scale[1]), _deq(*down)[:, 256:])


@pytest.mark.parametrize("change,match", [
    ({"weight_block_size": [64, 64]}, r"\[128, 128\] blocks only"),
    ({"fmt": "e5m2"}, "only e4m3"),
    ({"activation_scheme": "static"}, "only dynamic"),
])
def test_other_block_layouts_are_refused(change: dict, match: str) -> None:
    hf = {"quantization_config": {**V3_QUANT, **change}}
    with pytest.raises(QuantizationError, match=match):
        resolve_quantization(None, hf)


def test_v3_config_resolves_with_or_without_the_flag() -> None:
    hf = {"quantization_config": dict(V3_QUANT)}
    for flag in (None, "fp8"):
        cfg = resolve_quantization(flag, hf)
        assert cfg is not None and cfg.checkpoint_format == "fp8" and cfg.weight_block == (128, 128)
        assert not cfg.lm_head  # V3's head is bf16: it stays so under 'auto'


def test_a_fused_layer_off_the_block_grid_is_refused(v3_fp8: tuple, tmp_path: Path) -> None:
    """Gate and up of 96 rows each would share a block row of scales: refused, naming it."""
    path, _, _ = v3_fp8
    cfg = json.loads((Path(path) / "config.json").read_text())
    cfg["intermediate_size"] = 96
    tensors = load_file(str(Path(path) / "model.safetensors"))
    for part in ("gate", "up", "down"):
        name = f"model.layers.0.mlp.{part}_proj.weight"
        w = tensors[name].float()[:96] if part != "down" else tensors[name].float()[:, :96]
        tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(w)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantizationError, match="block grid"):
        ModelRunner(str(tmp_path), page_size=4, max_slots=4, max_context_len=64, seed=0)
