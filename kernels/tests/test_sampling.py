"""greedy_logprobs against torch: argmax (first index among equal maxima) and log_softmax there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenspeed_kernels.sampling import GREEDY_BLOCK, greedy_logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 16383, 16384, 20000])
def test_greedy_logprobs_matches_torch(dtype: torch.dtype, vocab: int, device: str) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(5, vocab, generator=gen) * 4).to(dtype)
    if vocab > GREEDY_BLOCK:
        logits[1, GREEDY_BLOCK + 4] = logits[1].max() + 30  # the max in the second block
        logits[2, GREEDY_BLOCK + 7] = logits[2, 3] = logits[2].max() + 1  # a tie across blocks: the first wins
        logits[3, 10] = logits[3, 11] = logits[3].max() + 1  # a tie inside a block
        logits[4, :] = -50.0  # all equal: index 0, logprob -log(vocab)
    logits = logits.to(device)
    tokens, logprobs = greedy_logprobs(logits)
    ref = logits.float()
    want = ref.argmax(dim=-1)
    assert torch.equal(tokens.cpu(), want.cpu())
    want_lp = torch.log_softmax(ref.double(), dim=-1).gather(1, want[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs.double().cpu(), want_lp.cpu(), rtol=1e-5, atol=1e-5)


def test_greedy_logprobs_strided_rows_and_empty(device: str) -> None:
    """Rows of a wider buffer (the logits of a step's sampling rows), and a batch of none."""
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(3, 300, generator=gen).to(device)
    tokens, logprobs = greedy_logprobs(wide[:, :257])
    assert torch.equal(tokens.cpu(), wide[:, :257].argmax(-1).cpu())
    assert logprobs.shape == (3,)
    empty_tokens, empty_lp = greedy_logprobs(wide[:0])
    assert empty_tokens.shape == (0,) and empty_lp.shape == (0,)


def test_kernels_compile_for_sm90() -> None:
    """compile_sm90.py: the kernels met only by the interpreter here compile for the H100, and
    the fp8 decode attention kernel keeps its double-buffered K/V copies."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia import compiler  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_sm90.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          timeout=600, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.count("ok ") >= 6, done.stdout
