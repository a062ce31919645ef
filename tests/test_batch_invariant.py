"""The batch-invariant ops (layers/batch_invariant.py, --enable-deterministic-inference): one
row's result computed alone and inside batches of other sizes, positions and chunkings is
bit-equal, and still the right result (close to the plain op). The plain ops are checked to
differ where the mode matters, so the tests can tell a no-op from a fix."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tokenspeed.layers import batch_invariant as bi

SIZES = (1, 2, 3, 7, 16, 17, 40)


@pytest.mark.parametrize("k, n", [(576, 576), (576, 1536), (1536, 576)])
def test_linear_row_does_not_depend_on_the_batch(k: int, n: int) -> None:
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = torch.randn(64, k, generator=g)
    alone = bi.linear(x[:1], w, b)[0]
    torch.testing.assert_close(alone, F.linear(x[:1], w, b)[0], rtol=1e-4, atol=1e-4)
    for m in SIZES:
        for pos in {0, m - 1, m // 2}:
            batch = torch.randn(m, k, generator=g)
            batch[pos] = x[0]
            assert torch.equal(bi.linear(batch, w, b)[pos], alone), (m, pos)


def test_plain_linear_does_depend_on_the_batch() -> None:
    """The reason for the mode (MKL: a GEMV for one row, GEMM blockings for more)."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(576, 576, generator=g), torch.randn(40, 576, generator=g)
    alone = F.linear(x[:1], w)[0]
    if all(torch.equal(F.linear(x[:m], w)[0], alone) for m in SIZES):
        pytest.skip("this BLAS happens to be batch-invariant for these shapes")


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: int | None) -> torch.Tensor:
    """Plain causal SDPA of the last n positions, [n, Hk, G, D]."""
    n = q.shape[0]
    length = k.shape[0]
    pos = torch.arange(length - n, length)[:, None]
    kp = torch.arange(length)[None, :]
    mask = kp <= pos
    if window is not None:
        mask &= kp > pos - window
    qh = q.permute(1, 2, 0, 3)  # [Hk, G, n, D]
    o = F.scaled_dot_product_attention(qh, k.transpose(0, 1)[:, None], v.transpose(0, 1)[:, None],
                                       attn_mask=mask, scale=scale)
    return o.permute(2, 0, 1, 3)


@pytest.mark.parametrize("window", [None, 50])
def test_attention_row_does_not_depend_on_chunking(window: int | None) -> None:
    """A prompt of 150 tokens attended in one piece, in chunks of 64 and 7 (a prefix already
    cached), and token by token (decode): every row bit-equal, and close to SDPA."""
    g = torch.Generator().manual_seed(1)
    length, hk, grp, d = 150, 3, 3, 64
    q = torch.randn(length, hk, grp, d, generator=g)
    k, v = torch.randn(length, hk, d, generator=g), torch.randn(length, hk, d, generator=g)
    scale = d ** -0.5
    whole = bi.attend(q, k, v, scale, window)
    torch.testing.assert_close(whole, _reference(q, k, v, scale, window), rtol=1e-4, atol=1e-5)
    for chunk in (64, 7, 1):
        for start in range(0, length, chunk):
            end = min(start + chunk, length)
            part = bi.attend(q[start:end], k[:end], v[:end], scale, window)
            assert torch.equal(part, whole[start:end]), (chunk, start)


def test_attention_with_sinks_is_invariant() -> None:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(70, 2, 2, 32, generator=g)
    k, v = torch.randn(70, 2, 32, generator=g), torch.randn(70, 2, 32, generator=g)
    sinks = torch.randn(2, 2, generator=g)
    whole = bi.attend(q, k, v, 0.2, None, sinks)
    assert torch.equal(bi.attend(q[69:], k, v, 0.2, None, sinks), whole[69:])
    assert torch.equal(bi.attend(q[30:41], k[:41], v[:41], 0.2, None, sinks), whole[30:41])


def test_logprobs_row_does_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(40, 49152, generator=g) * 4
    tokens = logits.argmax(-1)
    alone, _ = bi.chosen_logprobs(logits[:1], tokens[:1])
    for m in SIZES:
        got, _ = bi.chosen_logprobs(logits[:m], tokens[:m])
        assert torch.equal(got[0], alone[0]), m
    ref = logits[0, tokens[0]] - torch.logsumexp(logits[0], -1)
    torch.testing.assert_close(alone[0], ref)


def test_rmsnorm_row_does_not_depend_on_the_batch() -> None:
    """RMSNorm's CPU path is used as it is: check that it needs no invariant form."""
    from tokenspeed.layers.norm import RMSNorm

    norm = RMSNorm(576)
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(4))
    alone = norm(x[:1])[0]
    for m in (*SIZES, 300):
        assert torch.equal(norm(x[:m])[0], alone), m


def test_mode_switch() -> None:
    assert not bi.enabled()
    bi.enable()
    try:
        from tokenspeed.layers.linear import linear

        w, x = torch.randn(64, 32), torch.randn(5, 32)
        assert torch.equal(linear(x, w)[2], bi.linear(x, w, None)[2])
    finally:
        bi.enable(False)


@pytest.mark.parametrize("flags", [("--attention-backend", "flashinfer"), ("--enable-lora",),
                                   ("--quantization", "fp8"), ("--tp-size", "2"),
                                   ("--speculative-algorithm", "NGRAM",
                                    "--speculative-num-draft-tokens", "4")])
def test_refuses_combinations_it_cannot_make_deterministic(flags: tuple[str, ...]) -> None:
    from tokenspeed.config.errors import NotSupportedError
    from tokenspeed.config.parser import parse_serve_args

    with pytest.raises(NotSupportedError, match="not supported yet with --enable-deterministic"):
        parse_serve_args(["model", "--enable-deterministic-inference", *flags])
    parse_serve_args(["model", *flags])  # fine without the mode


@pytest.mark.parametrize("backend, graphs", [("torch_native", False), ("triton", False),
                                             ("triton", True)])
def test_runner_request_is_bit_identical_alone_and_in_a_batch(tiny_llama: str, backend: str,
                                                               graphs: bool) -> None:
    """Through ModelRunner (the backend's metadata, the sampler): a 70-token prompt prefilled
    in 16-token chunks alone, then in 5-token chunks among three other requests with decodes
    mixed into its prefill steps; its logits and tokens are bit-equal (triton: the Triton
    kernels, in the interpreter without CUDA). `graphs`: the batch's decode steps take the
    decode-graph path (its body run eagerly on the CPU: the graph metadata, padding rows)."""
    from tokenspeed.worker.cuda_graph import DecodeGraphRunner
    from tokenspeed.worker.model_runner import ModelRunner
    from tokenspeed.worker.offline_scheduler import OfflineScheduler

    prompt = [(7 * i) % 190 + 3 for i in range(70)]
    others = [[5, 6, 7], [(3 * i) % 150 + 9 for i in range(20)], [11] * 9]
    graph_steps: list[int] = []  # decode steps that took the graph path (padded sizes)
    bi.enable()
    try:
        def run(prompts: list[list[int]], chunk: int, after: bool) -> tuple[list, list]:
            runner = ModelRunner(tiny_llama, page_size=4, max_slots=8, max_context_len=128,
                                 dtype="float32", attention_backend=backend,
                                 disable_cuda_graph=True)
            if graphs and len(prompts) > 1:
                runner.graphs = g = DecodeGraphRunner(runner.model, runner.kv_cache,
                                                      runner.backend, 8,
                                                      runner.config.vocab_size, runner.device,
                                                      runner.last_tokens)
                body = g._run
                g._run = lambda bs: (graph_steps.append(bs), body(bs))[1]  # type: ignore[method-assign]
            out = OfflineScheduler(runner).generate(prompts, 4, chunk_size=chunk,
                                                    decode_after_all_prefills=after,
                                                    keep_logits=True)
            i = prompts.index(prompt)
            return out.tokens[i], out.logits[i]

        tokens, logits = run([prompt], 16, True)
        batch_tokens, batch_logits = run([*others, prompt], 5, False)
    finally:
        bi.enable(False)
    assert batch_tokens == tokens
    assert all(torch.equal(a, b) for a, b in zip(batch_logits, logits))
    assert bool(graph_steps) == graphs
