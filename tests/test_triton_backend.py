"""The triton attention backend against torch_native through ModelRunner.step (tiny random Llama).

Without CUDA the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set here before
tokenspeed_kernels is first imported). If another test module imported tokenspeed_kernels
earlier in this process without the interpreter, the checks re-run in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

_PREIMPORTED = "tokenspeed_kernels" in sys.modules
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
from transformers import Qwen3Config, Qwen3ForCausalLM

from tokenspeed.worker.cuda_graph import ExtendGraphRunner
from tokenspeed.worker.model_runner import ModelRunner
from tokenspeed.worker.offline_scheduler import OfflineScheduler
from tokenspeed.worker.plan import PLAN_DTYPES, StepPlan

U32 = np.uint32
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PREFIX = [(11 * i) % 190 + 5 for i in range(12)]
TAIL_A, TAIL_B = [7, 8, 9], [21, 22, 23, 24, 25]
PROMPTS = [PREFIX + TAIL_A, TAIL_B * 3, [3, 1, 4, 1, 5], PREFIX[:7]]


def _needs_subprocess() -> bool:
    return _PREIMPORTED and DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"


def _rerun_in_subprocess(test_name: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          f"{__file__}::{test_name}"], check=False, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen3: q/k RMSNorm before RoPE, head_dim != hidden / heads. Norm weights are
    random: with unit weights RMSNorm and RoPE commute and a wrong order would go unseen."""
    cfg = Qwen3Config(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=256, initializer_range=0.2)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape))
    path = tmp_path_factory.mktemp("tiny_qwen3_triton")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> str:
    """GPT-OSS: attention sinks (large, so they take much of the softmax), sliding (window 8) and
    full layers, 8 experts top-2 with biases and the clamped SwiGLU (a limit that bites)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=200, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                       num_local_experts=8, num_experts_per_tok=2, swiglu_limit=0.5,
                       max_position_embeddings=256, initializer_range=0.2)
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "_bias")):
                p.copy_(torch.randn(p.shape) * (2.0 if name.endswith("sinks") else 0.3))
    path = tmp_path_factory.mktemp("tiny_gpt_oss_triton")
    model.save_pretrained(path)
    return str(path)


def runner_for(path: str, backend: str, page_size: int = 4) -> ModelRunner:
    """backend: the attention backend, and the MoE backend of an MoE model (triton: fused_moe)."""
    return ModelRunner(path, page_size=page_size, max_slots=8, max_context_len=128, device=DEVICE,
                       dtype="float32", attention_backend=backend, moe_backend=backend,
                       disable_cuda_graph=True)


def new_requests(slots: list[int], temperature: float = 0.0, seed: int = -1,
                 top_logprobs: int = 0) -> dict[str, np.ndarray]:
    rows = [{"slot": s, "temperature": temperature, "seed": seed, "top_logprobs": top_logprobs}
            for s in slots]
    plan = StepPlan.build(new=rows)
    return {n: getattr(plan, n) for n in PLAN_DTYPES if n.startswith("new_")}

def pages(slot: int, first: int, ids: list[int]) -> dict[str, np.ndarray]:
    return {"pt_slot": np.asarray([slot], U32), "pt_first": np.asarray([first], U32),
            "pt_pages_len": np.asarray([len(ids)], U32), "pt_pages": np.asarray(ids, U32)}


def schedule(reqs: list[tuple[int, int, list[int], int]]) -> dict[str, np.ndarray]:
    return {"sched_slot": np.asarray([r[0] for r in reqs], U32),
            "sched_tokens_len": np.asarray([len(r[2]) for r in reqs], U32),
            "sched_start_pos": np.asarray([r[1] for r in reqs], U32),
            "sched_sample": np.asarray([r[3] for r in reqs], np.uint8),
            "sched_tokens": np.asarray([t for r in reqs for t in r[2]], U32)}


def prefix_sharing_run(runner: ModelRunner) -> tuple[list[int], list[torch.Tensor]]:
    """A computes PREFIX + TAIL_A; B joins on A's three prefix pages in the same step as A
    decodes (a mixed step), then both decode together (pure-decode steps)."""
    tokens: list[int] = []
    logits: list[torch.Tensor] = []

    def run(plan: StepPlan) -> list[int]:
        lg = runner.forward(plan)
        out = runner.sample(plan, lg).tokens.tolist()
        tokens.extend(out)
        logits.extend(lg.float().cpu())
        return out

    (a,) = run(StepPlan.of(**new_requests([0]), **pages(0, 0, [9, 3, 6, 1]),
                        **schedule([(0, 0, PREFIX + TAIL_A, 1)])))
    a, b = run(StepPlan.of(**new_requests([5]), pt_slot=np.asarray([5], U32),
                        pt_first=np.asarray([0], U32), pt_pages_len=np.asarray([5], U32),
                        pt_pages=np.asarray([9, 3, 6, 12, 13], U32),
                        **schedule([(0, 15, [a], 1), (5, 12, TAIL_B, 1)])))
    pos_a, pos_b = 16, 17
    for _ in range(6):
        kw = schedule([(0, pos_a, [a], 1), (5, pos_b, [b], 1)])
        new_pages = [(s, p // 4) for s, p in ((0, pos_a), (5, pos_b)) if p % 4 == 0]
        if new_pages:  # a page fills up: hand out the next one
            kw |= {"pt_slot": np.asarray([s for s, _ in new_pages], U32),
                   "pt_first": np.asarray([j for _, j in new_pages], U32),
                   "pt_pages_len": np.ones(len(new_pages), U32),
                   "pt_pages": np.asarray([100 + 10 * s + j for s, j in new_pages], U32)}
        a, b = run(StepPlan.of(**kw))
        pos_a, pos_b = pos_a + 1, pos_b + 1
    return tokens, logits


def test_prefix_sharing_and_mixed_steps_match_torch_native(tiny_llama: str) -> None:
    if _needs_subprocess():
        _rerun_in_subprocess("test_prefix_sharing_and_mixed_steps_match_torch_native")
        return
    ref_tokens, ref_logits = prefix_sharing_run(runner_for(tiny_llama, "torch_native"))
    tri_tokens, tri_logits = prefix_sharing_run(runner_for(tiny_llama, "triton"))
    assert tri_tokens == ref_tokens
    for a, b in zip(tri_logits, ref_logits):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("decode_after_all_prefills", [True, False])
def test_chunked_prefill_and_batched_decode_match_torch_native(
        tiny_llama: str, decode_after_all_prefills: bool) -> None:
    if _needs_subprocess():
        _rerun_in_subprocess("test_chunked_prefill_and_batched_decode_match_torch_native")
        return
    results = {}
    for backend in ("torch_native", "triton"):
        results[backend] = OfflineScheduler(runner_for(tiny_llama, backend)).generate(
            PROMPTS, 10, chunk_size=6, decode_after_all_prefills=decode_after_all_prefills,
            keep_logits=True)
    ref, tri = results["torch_native"], results["triton"]
    assert tri.tokens == ref.tokens
    for req_a, req_b in zip(tri.logits, ref.logits):
        for a, b in zip(req_a, req_b):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)


def test_qwen3_qk_norm_then_fused_rope_matches_torch_native(tiny_qwen3: str) -> None:
    """The triton backend applies RoPE inside its KV write: q/k norms must still come first."""
    if _needs_subprocess():
        _rerun_in_subprocess("test_qwen3_qk_norm_then_fused_rope_matches_torch_native")
        return
    results = {backend: OfflineScheduler(runner_for(tiny_qwen3, backend)).generate(
        PROMPTS, 6, chunk_size=6, keep_logits=True) for backend in ("torch_native", "triton")}
    ref, tri = results["torch_native"], results["triton"]
    assert tri.tokens == ref.tokens
    for req_a, req_b in zip(tri.logits, ref.logits):
        for a, b in zip(req_a, req_b):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("decodes_first", [True, False])
def test_mixed_step_decodes_run_the_decode_kernel_and_match_torch_native(
        tiny_llama: str, decodes_first: bool) -> None:
    """Decodes leading a step with a prefill chunk go through the decode kernel; a decode after
    the chunk stays in the extend kernel. Either way the logits match torch_native."""
    if _needs_subprocess():
        _rerun_in_subprocess("test_mixed_step_decodes_run_the_decode_kernel_and_match_torch_native")
        return
    logits = {}
    for backend in ("torch_native", "triton"):
        runner = runner_for(tiny_llama, backend)
        # Two requests prefill 6 and 9 tokens (pages 1-2 and 3-5), then decode in the same step
        # as a third request's 7-token prefill (pages 6-7).
        runner.forward(StepPlan.of(**new_requests([0, 1]), pt_slot=np.asarray([0, 1], U32),
                                pt_first=np.asarray([0, 0], U32), pt_pages_len=np.asarray([2, 3], U32),
                                pt_pages=np.asarray([1, 2, 3, 4, 5], U32),
                                **schedule([(0, 0, TAIL_B + [7], 1), (1, 0, PREFIX[:9], 1)])))
        decodes = [(0, 6, [40], 1), (1, 9, [41], 1)]
        chunk = [(2, 0, PREFIX[2:9], 1)]
        plan = StepPlan.of(**new_requests([2]), **pages(2, 0, [6, 7]),
                        **schedule(decodes + chunk if decodes_first else chunk + decodes))
        seen: list[object] = []
        prepare = runner.backend.prepare

        def spy(batch: object, prepare: object = prepare, seen: list[object] = seen) -> None:
            prepare(batch)  # type: ignore[operator]
            seen.append(batch.metadata)  # type: ignore[attr-defined]

        runner.backend.prepare = spy  # type: ignore[method-assign]
        logits[backend] = runner.forward(plan)
        if backend == "triton":
            (meta,) = seen
            lead = meta.leading_decodes
            assert (lead is not None and lead.page_table.shape[0] == 2) == decodes_first
            assert meta.page_table.shape[0] == (1 if decodes_first else 3)
    torch.testing.assert_close(logits["triton"], logits["torch_native"], atol=2e-4, rtol=1e-4)


def with_extend_graphs(runner: ModelRunner, sizes: list[int], max_requests: int) -> list[int]:
    """Give the runner an extend-graph runner that is never captured (no CUDA here): each step
    it takes runs the graph's body eagerly, with its padding and tiled attention. Returns the
    list of the token counts it ran, appended per step."""
    graphs = ExtendGraphRunner(runner.model, runner.kv_cache, runner.backend, sizes, max_requests,
                               runner.config.hidden_size, runner.device, runner.last_tokens,
                               runner.dtype, runner.config.head_dim)
    ran: list[int] = []
    body = graphs._run

    def counted(shape: tuple[int, int]) -> None:
        ran.append(shape[0])
        body(shape)

    graphs._run = counted  # type: ignore[method-assign]
    runner.extend_graphs = graphs
    return ran


@pytest.mark.parametrize("decode_after_all_prefills", [True, False])
def test_extend_graph_body_matches_torch_native(tiny_llama: str,
                                                decode_after_all_prefills: bool) -> None:
    """Steps padded to an extend graph's token count and request rows (prefill chunks, mixed
    steps, decodes through the decode kernel beside the tiled extend launch) give torch_native's
    tokens and logits;
    steps over the graph's limits (more than 3 requests or 32 tokens) still run eagerly."""
    if _needs_subprocess():
        _rerun_in_subprocess("test_extend_graph_body_matches_torch_native")
        return
    ref = OfflineScheduler(runner_for(tiny_llama, "torch_native")).generate(
        PROMPTS, 8, chunk_size=6, decode_after_all_prefills=decode_after_all_prefills,
        keep_logits=True)
    runner = runner_for(tiny_llama, "triton")
    ran = with_extend_graphs(runner, [16, 32], max_requests=3)
    eager = runner.backend.prepare
    eager_steps: list[int] = []

    def spy(batch: object) -> None:
        eager_steps.append(1)
        eager(batch)  # type: ignore[arg-type]

    runner.backend.prepare = spy  # type: ignore[method-assign]
    got = OfflineScheduler(runner).generate(
        PROMPTS, 8, chunk_size=6, decode_after_all_prefills=decode_after_all_prefills,
        keep_logits=True)
    assert got.tokens == ref.tokens
    for req_a, req_b in zip(got.logits, ref.logits):
        for a, b in zip(req_a, req_b):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    assert ran and set(ran) <= {16, 32}, ran
    assert eager_steps, "4 requests decoding together exceed the graph's 3 rows: eager"


def test_gpt_oss_sinks_and_experts_through_every_path(tiny_gpt_oss: str) -> None:
    """GPT-OSS on the triton attention (sinks, sliding and full layers) and MoE (biases, clamped
    SwiGLU) backends: eager chunked prefill and batched decode, then the same through the extend
    graph's body (tiled extend + decode kernel), give torch_native's tokens and logits."""
    if _needs_subprocess():
        _rerun_in_subprocess("test_gpt_oss_sinks_and_experts_through_every_path")
        return
    ref = OfflineScheduler(runner_for(tiny_gpt_oss, "torch_native")).generate(
        PROMPTS, 6, chunk_size=6, keep_logits=True)
    eager = runner_for(tiny_gpt_oss, "triton")
    assert eager.moe_backend == "triton" and eager.model.model.layers[0].self_attn.attn.has_sinks
    graphed = runner_for(tiny_gpt_oss, "triton")
    ran = with_extend_graphs(graphed, [16, 32], max_requests=4)
    for runner in (eager, graphed):
        got = OfflineScheduler(runner).generate(PROMPTS, 6, chunk_size=6, keep_logits=True)
        assert got.tokens == ref.tokens
        for req_a, req_b in zip(got.logits, ref.logits):
            for a, b in zip(req_a, req_b):
                torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    assert ran, "the graph body ran"


def test_prefix_sharing_through_the_extend_graph_body(tiny_llama: str) -> None:
    """A request joining on cached pages beside a decode (mixed step), in the graph body."""
    if _needs_subprocess():
        _rerun_in_subprocess("test_prefix_sharing_through_the_extend_graph_body")
        return
    ref_tokens, ref_logits = prefix_sharing_run(runner_for(tiny_llama, "torch_native"))
    runner = runner_for(tiny_llama, "triton")
    ran = with_extend_graphs(runner, [16, 32], max_requests=8)
    tokens, logits = prefix_sharing_run(runner)
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    assert ran[:2] == [16, 16] and len(ran) == 8, ran  # 15, then 1 + 5, then 2 tokens a step


def test_backend_selection(tiny_llama: str) -> None:
    auto = ModelRunner(tiny_llama, page_size=4, max_slots=2, max_context_len=64, device="cpu")
    assert auto.attention_backend == "torch_native"  # "auto" on CPU
    with pytest.raises(ValueError, match="flashinfer"):
        ModelRunner(tiny_llama, page_size=4, max_slots=2, max_context_len=64, device="cpu",
                    attention_backend="flashinfer")
    with pytest.raises(ValueError, match="unknown attention_backend"):
        ModelRunner(tiny_llama, page_size=4, max_slots=2, max_context_len=64, device="cpu",
                    attention_backend="nope")
