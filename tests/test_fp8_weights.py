"""FP8 weights on CPU: the quantise/dequantise round trip, the FP8 linear against its dequantised
reference, `--quantization fp8` through ModelRunner (the LM head too, tied or not:
--lm-head-quantization), FP8 checkpoints (compressed-tensors and ModelOpt, written here with
safetensors) loaded as they are, and the error for other methods."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_fp8_kv_cache import compare, run, save_tiny_llama

from tokenspeed.layers.embedding import LMHead, VocabEmbedding
from tokenspeed.layers.linear import QKVLinear, RowLinear
from tokenspeed.layers.quantization.fp8 import (
    FP8,
    dequantize,
    fp8_linear,
    quantize_per_channel,
    reference_linear,
)
from tokenspeed.layers.quantization.fp8_model import quantize_model
from tokenspeed.layers.quantization.methods import Fp8Config, QuantizationError, resolve_quantization
from tokenspeed.worker.model_runner import ModelRunner

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_llama(tmp_path_factory, "tiny_llama_w8", seed=5)


def test_per_channel_round_trip_error_is_bounded() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 80, generator=gen) * torch.logspace(-4, 2, 48)[:, None]
    q, s = quantize_per_channel(w)
    assert q.dtype == FP8 and s.shape == (48,)
    assert q.float().abs().amax(dim=1).eq(448.0).all()  # each row's max uses the whole range
    err = (dequantize(q, s, torch.float32) - w).abs()
    # 3 mantissa bits: relative error <= 2^-4; subnormals: half a step of 2^-9 * scale.
    assert (err <= torch.maximum(w.abs() * 2**-4, s[:, None] * 2**-10) * 1.0001).all()


def test_fp8_linear_is_the_dequantised_matmul() -> None:
    gen = torch.Generator().manual_seed(1)
    layer = QKVLinear(64, 16, 4, 2, bias=True)  # q 64 + k 32 + v 32 rows
    layer.weight.data.normal_(0, 0.1, generator=gen)
    layer.bias.data.normal_(0, 1.0, generator=gen)
    x = torch.randn(7, 64, generator=gen)
    before = layer(x)
    assert quantize_model(layer, Fp8Config()) == 1  # the module itself is the linear
    assert layer.weight.dtype == FP8 and layer.weight_scale is not None
    ref = torch.nn.functional.linear(x, dequantize(layer.weight, layer.weight_scale, x.dtype), layer.bias)
    torch.testing.assert_close(layer(x), ref, rtol=0, atol=0)
    torch.testing.assert_close(fp8_linear(x, layer.weight, layer.weight_scale, layer.bias), ref)
    assert ((layer(x) - before).norm() / before.norm()).item() < 0.05  # and close to the original


def test_reference_linear_mirrors_the_cuda_kernels_rules() -> None:
    """GEMV rows (<= SKINNY_MAX_ROWS): weight-only; more rows: per-token fp8 activations too."""
    from tokenspeed_kernels.fp8_gemm import ref_per_token_quant_fp8

    gen = torch.Generator().manual_seed(3)
    q, s = quantize_per_channel(torch.randn(40, 96, generator=gen) * 0.05)
    x = torch.randn(12, 96, generator=gen).to(torch.bfloat16)
    b = torch.randn(40, generator=gen).to(torch.bfloat16)
    w = q.float() * s[:, None]
    few = reference_linear(x[:8], q, s, b)
    torch.testing.assert_close(few, (x[:8].float() @ w.T + b.float()).to(torch.bfloat16), rtol=0, atol=0)
    xq, xs = ref_per_token_quant_fp8(x)
    many = reference_linear(x, q, s, b)
    torch.testing.assert_close(many, ((xq.float() * xs[:, None]) @ w.T + b.float()).to(torch.bfloat16))
    assert not torch.equal(many[:8], few)  # the activations were rounded to fp8


def test_quantization_fp8_tracks_the_full_precision_model(tiny_llama: str) -> None:
    """Every linear's weights carry up to 2^-4 relative rounding error, so the tiny model's flat
    logits (256 random-ish tokens, many near-ties) flip a little more often than with an fp8 KV
    cache alone (seen: 0.875 agreement, min cosine 0.994; with the LM head in fp8 too, the default:
    0.896, 0.993): the bound is 0.85, and every flip must be a near-tie of the reference (margin
    < 0.3 logit std; seen 0.11 / 0.08)."""
    ref = run(tiny_llama)
    runner_fp8 = ModelRunner(tiny_llama, page_size=4, max_slots=8, max_context_len=128,
                             quantization="fp8")
    layer = runner_fp8.model.model.layers[0]
    for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                   layer.mlp.down_proj):
        assert module.weight.dtype == FP8 and module.weight_scale.shape == (module.weight.shape[0],)
    assert runner_fp8.model.model.embed_tokens.weight.dtype == torch.float32  # the lookup table stays
    head = runner_fp8.model.lm_head  # --lm-head-quantization auto: FP8 with --quantization fp8
    assert head.weight.dtype == FP8 and head.weight_scale.shape == (256,)
    got = run(tiny_llama, teacher=ref[0], quantization="fp8")
    agree, cos, margin = compare(ref, got)
    print(f"fp8 weights: agreement {agree:.3f}, min cosine {cos:.4f}, worst margin {margin:.3f}")
    assert agree >= 0.85 and cos >= 0.99 and margin < 0.3
    both = run(tiny_llama, teacher=ref[0], quantization="fp8", kv_cache_dtype="fp8")
    agree, cos, margin = compare(ref, both)
    print(f"fp8 weights + fp8 KV: agreement {agree:.3f}, min cosine {cos:.4f}, worst margin {margin:.3f}")
    assert agree >= 0.8 and cos >= 0.99 and margin < 0.3


def _fp8_checkpoint(src: str, dst: Path, fmt: str, per_tensor: bool,
                    head: bool = False) -> tuple[str, str]:
    """An FP8 copy of `src` in format `fmt` ("compressed-tensors" or "modelopt") and a
    full-precision copy holding exactly the dequantised weights (what the FP8 run must equal).
    head: the LM head is FP8 too (its config then leaves `lm_head` out of the ignore list)."""
    fp8_dir, deq_dir = dst / "fp8", dst / "dequantised"
    fp8_dir.mkdir()
    deq_dir.mkdir()
    cfg = json.loads((Path(src) / "config.json").read_text())
    tensors = load_file(str(Path(src) / "model.safetensors"))
    fp8_tensors, deq = {}, {}
    for name, t in tensors.items():
        if not (any(f".{p}.weight" in name for p in LINEARS) or (head and name == "lm_head.weight")):
            fp8_tensors[name] = deq[name] = t
            continue
        base = name[: -len(".weight")]
        if per_tensor:
            scale = t.abs().max() / 448.0
            q = (t / scale).clamp(-448, 448).to(FP8)
            s = scale.reshape(1) if fmt == "compressed-tensors" else scale.reshape(())
            deq[name] = q.float() * scale
        else:
            q, s = quantize_per_channel(t)
            deq[name] = q.float() * s[:, None]
            s = s[:, None] if fmt == "compressed-tensors" else s
        fp8_tensors[name] = q
        fp8_tensors[base + ".weight_scale"] = s.float()
        fp8_tensors[base + ".input_scale"] = torch.tensor(0.1)  # static: replaced by dynamic
    for layer in range(cfg["num_hidden_layers"]):  # KV cache scales ride along, as in real ones
        fp8_tensors[f"model.layers.{layer}.self_attn.k_proj.k_scale"] = torch.tensor(0.5)
    if fmt == "compressed-tensors":
        strategy = "tensor" if per_tensor else "channel"
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                "dynamic": False}, "input_activations": {"num_bits": 8, "type": "float",
                                                         "strategy": "token", "dynamic": True}}},
            "ignore": [] if head else ["lm_head"], "quantization_status": "compressed"}
        (fp8_dir / "config.json").write_text(json.dumps(cfg))
    else:  # ModelOpt writes its settings to hf_quant_config.json
        (fp8_dir / "config.json").write_text(json.dumps(cfg))
        (fp8_dir / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "modelopt"}, "quantization": {
                "quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                "exclude_modules": [] if head else ["lm_head"]}}))
    (deq_dir / "config.json").write_text((Path(src) / "config.json").read_text())
    save_file(fp8_tensors, str(fp8_dir / "model.safetensors"))
    save_file(deq, str(deq_dir / "model.safetensors"))
    return str(fp8_dir), str(deq_dir)


@pytest.mark.parametrize(("fmt", "per_tensor"), [("compressed-tensors", False),
                                                 ("compressed-tensors", True), ("modelopt", True)])
def test_fp8_checkpoints_load_as_they_are(tiny_llama: str, tmp_path: Path, fmt: str,
                                          per_tensor: bool) -> None:
    fp8_dir, deq_dir = _fp8_checkpoint(tiny_llama, tmp_path, fmt, per_tensor)
    runner = ModelRunner(fp8_dir, page_size=4, max_slots=8, max_context_len=128, kv_cache_dtype="fp8")
    assert runner.fp8 is not None and runner.fp8.checkpoint_format == fmt
    qkv = runner.model.model.layers[1].self_attn.qkv_proj
    ckpt = load_file(str(Path(fp8_dir) / "model.safetensors"))
    k_rows = slice(64, 96)  # k_proj's rows in the fused q/k/v weight
    assert torch.equal(qkv.weight[k_rows].view(torch.uint8),
                       ckpt["model.layers.1.self_attn.k_proj.weight"].view(torch.uint8))
    want = ckpt["model.layers.1.self_attn.k_proj.weight_scale"].float().reshape(-1).expand(32)
    torch.testing.assert_close(qkv.weight_scale[k_rows], want)
    assert runner.kv_cache.k_scale == [0.5, 0.5]  # the checkpoint's KV scales too
    # Exactly the model of the dequantised weights (both dequantise, then matmul, on the CPU).
    ours = run(fp8_dir)
    ref = run(deq_dir)
    assert ours[0] == ref[0]
    for a, b in zip(ours[1], ref[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


@pytest.mark.parametrize(("fmt", "per_tensor"), [("compressed-tensors", False),
                                                 ("compressed-tensors", True), ("modelopt", False)])
def test_fp8_checkpoints_with_an_fp8_lm_head_load_as_they_are(tiny_llama: str, tmp_path: Path,
                                                              fmt: str, per_tensor: bool) -> None:
    """A checkpoint whose config does not ignore lm_head ships it in fp8 with its
    lm_head.weight_scale: it loads as it is (once a KeyError on that scale), and the logits are
    those of the dequantised model, the head included."""
    fp8_dir, deq_dir = _fp8_checkpoint(tiny_llama, tmp_path, fmt, per_tensor, head=True)
    ckpt = load_file(str(Path(fp8_dir) / "model.safetensors"))
    assert ckpt["lm_head.weight"].dtype == FP8 and "lm_head.weight_scale" in ckpt
    runner = ModelRunner(fp8_dir, page_size=4, max_slots=8, max_context_len=128)
    assert runner.fp8 is not None and runner.fp8.checkpoint_lm_head and runner.fp8.lm_head
    head = runner.model.lm_head
    assert torch.equal(head.weight.view(torch.uint8), ckpt["lm_head.weight"].view(torch.uint8))
    want = ckpt["lm_head.weight_scale"].float().reshape(-1).expand(256)
    torch.testing.assert_close(head.weight_scale, want, rtol=0, atol=0)
    # Dequantise-then-compute: the full-precision copy holds exactly W = weight * scale.
    ours, ref = run(fp8_dir), run(deq_dir)
    assert ours[0] == ref[0]
    for a, b in zip(ours[1], ref[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    # --lm-head-quantization none: the head is dequantised once loaded (the same logits).
    plain = ModelRunner(fp8_dir, page_size=4, max_slots=8, max_context_len=128,
                        lm_head_quantization="none")
    assert plain.model.lm_head.weight.dtype == torch.float32 and plain.model.lm_head.weight_scale is None
    torch.testing.assert_close(plain.model.lm_head.weight, load_file(str(Path(deq_dir) / "model.safetensors"))
                               ["lm_head.weight"], rtol=0, atol=0)
    none = run(fp8_dir, lm_head_quantization="none")
    assert none[0] == ref[0]
    for a, b in zip(none[1], ref[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


@pytest.mark.parametrize("scale_shape", [(97,), (97, 1), (1,), ()])
def test_an_fp8_head_loads_each_ranks_rows_and_scales(scale_shape: tuple[int, ...]) -> None:
    """Vocab-parallel: rank r keeps rows [r * 49, r * 49 + 49) of a 97-token head (rank 1's last
    row is padding: zero weight, zero scale); per-row and per-tensor scales alike."""
    from tokenspeed.layers.quantization.fp8_model import prepare_fp8_checkpoint

    gen = torch.Generator().manual_seed(6)
    q, s = quantize_per_channel(torch.randn(97, 48, generator=gen))
    # Per row ([V] or [V, 1]) or per tensor ([1] or a scalar: every row gets it).
    scale = s.reshape(scale_shape) if len(scale_shape) > 1 or scale_shape == (97,) else \
        s[0].reshape(scale_shape)
    full = scale.float().reshape(-1).expand(97)
    for rank in (0, 1):
        lm = torch.nn.Module()
        lm.lm_head = LMHead(97, 48, tp_rank=rank, tp_size=2)
        prepare_fp8_checkpoint(lm, Fp8Config("modelopt", checkpoint_lm_head=True))
        head = lm.lm_head
        head.weight_loader(head.weight, q)
        head.weight_loader(head.weight_scale, scale)
        lo, n = 49 * rank, 49 if rank == 0 else 48
        assert head.weight.dtype == FP8 and head.weight.shape == (49, 48)
        assert torch.equal(head.weight[:n].view(torch.uint8), q[lo:lo + n].view(torch.uint8))
        torch.testing.assert_close(head.weight_scale[:n], full[lo:lo + n], rtol=0, atol=0)
        if rank == 1:
            assert head.weight_scale[48] == 0 and head.weight[48].float().abs().sum() == 0
    bad = torch.nn.Module()
    bad.lm_head = LMHead(97, 48)
    prepare_fp8_checkpoint(bad, Fp8Config("modelopt", checkpoint_lm_head=True))
    with pytest.raises(ValueError, match="lm_head.weight_scale: 96 scales for a vocabulary of 97"):
        bad.lm_head.weight_loader(bad.lm_head.weight_scale, s[:96])


def test_a_sharded_checkpoints_fp8_head_is_found_through_its_index(tiny_llama: str, tmp_path: Path) -> None:
    fp8_dir, _ = _fp8_checkpoint(tiny_llama, tmp_path, "compressed-tensors", False, head=True)
    cfg = json.loads((Path(fp8_dir) / "config.json").read_text())
    names = load_file(str(Path(fp8_dir) / "model.safetensors"))
    index = {"weight_map": {n: "model.safetensors" for n in names}}
    (Path(fp8_dir) / "model.safetensors.index.json").write_text(json.dumps(index))
    assert resolve_quantization(None, cfg, fp8_dir).checkpoint_lm_head
    del index["weight_map"]["lm_head.weight_scale"]
    (Path(fp8_dir) / "model.safetensors.index.json").write_text(json.dumps(index))
    assert not resolve_quantization(None, cfg, fp8_dir).checkpoint_lm_head


@pytest.mark.parametrize(("qc", "named"), [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "'awq'"),
    ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size \\[64, 64\\]"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "'modelopt/NVFP4'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "pack-quantized"),
])
def test_unsupported_checkpoint_quantization_fails_at_start(tiny_llama: str, tmp_path: Path, qc: dict,
                                                            named: str) -> None:
    cfg = json.loads((Path(tiny_llama) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    (tmp_path / "model.safetensors").write_bytes((Path(tiny_llama) / "model.safetensors").read_bytes())
    with pytest.raises(QuantizationError, match=f"{named}.*supported: fp8") as info:
        ModelRunner(str(tmp_path), page_size=4, max_slots=8, max_context_len=128)
    assert "KeyError" not in str(info.value)


def test_unsupported_quantization_flag_fails_at_start(tiny_llama: str) -> None:
    with pytest.raises(QuantizationError, match="'gptq' \\(--quantization\\) is not supported; supported: fp8"):
        ModelRunner(tiny_llama, page_size=4, max_slots=8, max_context_len=128, quantization="gptq")
    assert resolve_quantization("FP8", {}) == Fp8Config(lm_head=True)  # --lm-head-quantization auto
    assert resolve_quantization(None, {}) is None


def test_serve_with_an_unsupported_method_exits_with_one_line(
        tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    from tokenspeed.launch.cli import main

    rc = main(["serve", tiny_llama, "--quantization", "awq", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    assert err.startswith("tokenspeed serve: quantization method 'awq'") and "supported: fp8" in err


def test_row_linear_checkpoint_scale_is_expanded() -> None:
    """A per-tensor scale of a row-parallel layer (o_proj/down_proj) fills every output row."""
    from tokenspeed.layers.quantization.fp8_model import prepare_fp8_checkpoint

    layer = RowLinear(32, 16)
    prepare_fp8_checkpoint(layer, Fp8Config("modelopt"))
    layer.weight_loader(layer.weight_scale, torch.tensor(0.25))
    assert layer.weight_scale.tolist() == [0.25] * 16


class _TiedLM(torch.nn.Module):
    """Just an embedding and a head tied to it, as SmolLM2 has them."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(vocab, hidden)
        self.lm_head = LMHead(vocab, hidden)
        self.lm_head.tie(self.embed_tokens)


def test_tied_lm_head_gets_its_own_fp8_copy_and_the_lookup_keeps_its_table() -> None:
    gen = torch.Generator().manual_seed(4)
    lm = _TiedLM(97, 48)  # a ragged vocab
    lm.embed_tokens.weight.data.normal_(0, 0.2, generator=gen)
    table = lm.embed_tokens.weight.detach().clone()
    ids = torch.tensor([0, 5, 96, 5])
    hidden = torch.randn(3, 48, generator=gen)
    before = lm.lm_head(hidden)
    assert quantize_model(lm, Fp8Config()) == 0  # the head only with lm_head=True
    assert quantize_model(lm, Fp8Config(lm_head=True)) == 1
    head = lm.lm_head
    assert head.weight.dtype == FP8 and head.weight is not lm.embed_tokens.weight
    assert torch.equal(lm.embed_tokens.weight, table) and torch.equal(lm.embed_tokens(ids), table[ids])
    logits = head(hidden)
    want = torch.nn.functional.linear(hidden, dequantize(head.weight, head.weight_scale, torch.float32))
    assert logits.dtype == torch.float32  # the sampler's dtype
    torch.testing.assert_close(logits, want, rtol=0, atol=0)
    assert ((logits - before).norm() / before.norm()).item() < 0.05
    assert quantize_model(lm, Fp8Config(lm_head=True)) == 0  # already fp8: left alone


def test_lm_head_quantization_choices(tiny_llama: str, tmp_path: Path) -> None:
    def head_dtype(path: str, **kw: object) -> torch.dtype:
        runner = ModelRunner(path, page_size=4, max_slots=8, max_context_len=128, **kw)  # type: ignore[arg-type]
        return runner.model.lm_head.weight.dtype

    assert head_dtype(tiny_llama, quantization="fp8", lm_head_quantization="none") == torch.float32
    assert head_dtype(tiny_llama, quantization="fp8", lm_head_quantization="fp8") == FP8
    assert head_dtype(tiny_llama) == torch.float32  # no FP8 weights: auto leaves it
    with pytest.raises(QuantizationError, match="--lm-head-quantization fp8 needs FP8 weights"):
        ModelRunner(tiny_llama, page_size=4, max_slots=8, max_context_len=128, lm_head_quantization="fp8")
    # An FP8 checkpoint's head stays as the checkpoint has it (its config excludes it) unless forced.
    fp8_dir, _ = _fp8_checkpoint(tiny_llama, tmp_path, "compressed-tensors", False)
    assert head_dtype(fp8_dir) == torch.float32
    assert head_dtype(fp8_dir, lm_head_quantization="fp8") == FP8
    assert resolve_quantization("fp8", {}).lm_head and not resolve_quantization("fp8", {}, None, "none").lm_head


@pytest.fixture(scope="module")
def tiny_tied_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_llama(tmp_path_factory, "tiny_tied_llama_w8", seed=6, tie_word_embeddings=True)


def test_fp8_lm_head_tracks_the_full_precision_head(tiny_tied_llama: str) -> None:
    """Tied (SmolLM2-style): the head's own fp8 copy against the same fp8 model with the head in
    fp32, teacher-forced: the head adds one more 2^-4 rounding to the logits, so greedy picks
    change only at near-ties (seen: agreement 0.990, min cosine 0.9996, worst margin 0.009)."""
    ref = run(tiny_tied_llama, quantization="fp8", lm_head_quantization="none")
    got = run(tiny_tied_llama, teacher=ref[0], quantization="fp8")
    agree, cos, margin = compare(ref, got)
    print(f"fp8 lm_head vs fp32 lm_head: agreement {agree:.3f}, min cosine {cos:.4f}, worst margin {margin:.3f}")
    assert agree >= 0.9 and cos >= 0.995 and margin < 0.3
