"""`--enable-deterministic-inference` end to end: a greedy request's tokens and logprob floats
are bit-identical alone, inside a batch of 31 other requests of different prompt lengths sent at
the same moment (a 64-token --chunked-prefill-size, so its prompt is chunked differently and
steps mix prefill with decode), and after a prefix-cache hit on part of its prompt.

Without the flag the same setup gives different logprobs (BLAS picks other kernels for other
row counts): `python tests/test_e2e_deterministic.py` prints the comparison for both servers."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from server_harness import Server, start_server, stop_server

if TYPE_CHECKING:  # imported when used: the GPU test reuses the prompts without openai
    import openai

FLAGS = ("--page-size", "4", "--max-running-requests", "32", "--max-total-tokens", "16384",
         "--chunked-prefill-size", "64")
STORY = ("Once upon a time in a small village by the sea, there lived an old fisherman who "
         "told stories about the stars, the tides and the strange lights he saw far out on the "
         "water every autumn. The children of the village gathered around him each evening")
R = STORY + ". One evening a girl asked him what the lights really were, and he said"
SHARER = STORY + ", and one of them, a quiet boy named Tom, wrote every story down in a book"
SEEDED = "Write a short poem about the autumn sea and the old lighthouse"
MAX_TOKENS = 8


def others() -> list[str]:
    """31 prompts of different lengths, one sharing R's first sentence (the batch takes 30)."""
    words = ["apple", "river", "mountain", "cloud", "engine", "silver", "garden", "window",
             "music", "thunder"]
    out = [SHARER]
    for i in range(30):
        out.append(f"Request {i}: " + " ".join(words[(i + j) % len(words)] for j in range(3 + 3 * i)))
    return out


@pytest.fixture(scope="module")
def det_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(str(tmp_path_factory.mktemp("det")), *FLAGS,
                       "--enable-deterministic-inference")
    try:
        yield srv
    finally:
        stop_server(srv)


def complete(client: openai.OpenAI, prompt: str,
             seed: int | None = None) -> tuple[list[str], list[float]]:
    """Greedy, or sampled (temperature 0.9) from the request's own `seed`."""
    sampling = {"temperature": 0} if seed is None else {"temperature": 0.9, "seed": seed}
    out = client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                    max_tokens=MAX_TOKENS, logprobs=1, **sampling)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs
    return list(lp.tokens), [float(x) for x in lp.token_logprobs]


def runs(server: Server) -> dict[str, tuple[list[str], list[float]]]:
    """R alone (empty cache), R after SHARER cached part of its prompt, and R inside a batch;
    the same for a seeded sampled request S (alone, then in the batch in place of a prompt)."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)

    def flush() -> None:
        httpx.post(f"{server.url}/flush_cache", timeout=30).raise_for_status()

    flush()
    alone = complete(client, R)
    sampled_alone = complete(client, SEEDED, seed=7)
    flush()
    complete(client, SHARER)
    prefix_hit = complete(client, R)
    flush()
    batch = [*others()[:16], R, *others()[16:30], SEEDED]
    with ThreadPoolExecutor(len(batch)) as pool:
        results = list(pool.map(lambda p: complete(client, p, 7 if p == SEEDED else None), batch))
    return {"alone": alone, "prefix_hit": prefix_hit, "batch": results[16],
            "sampled_alone": sampled_alone, "sampled_batch": results[-1]}


def test_flag_logs_what_it_changes(det_server: Server) -> None:
    assert "deterministic inference: batch-invariant linear layers" in det_server.log()


def test_request_is_bit_identical_alone_in_a_batch_and_after_a_prefix_hit(
        det_server: Server) -> None:
    got = runs(det_server)
    alone_tokens, alone_lps = got["alone"]
    for name in ("prefix_hit", "batch"):
        tokens, lps = got[name]
        assert tokens == alone_tokens, name
        assert lps == alone_lps, (name, [a - b for a, b in zip(lps, alone_lps)])
    assert got["sampled_batch"] == got["sampled_alone"]


def test_refuses_what_it_cannot_make_deterministic(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="not supported yet with --enable-deterministic"):
        start_server(str(tmp_path), "--enable-deterministic-inference", "--enable-lora",
                     "--max-lora-rank", "8", timeout_s=60)


if __name__ == "__main__":  # by hand: with and without the flag
    import tempfile

    for extra in ((), ("--enable-deterministic-inference",)):
        srv = start_server(tempfile.mkdtemp(), *FLAGS, *extra)
        try:
            got = runs(srv)
            for name, base in (("prefix_hit", "alone"), ("batch", "alone"),
                               ("sampled_batch", "sampled_alone")):
                d = [x - y for x, y in zip(got[name][1], got[base][1])]
                print(extra, name, "tokens equal:", got[name][0] == got[base][0],
                      "max |logprob diff|:", max(map(abs, d)), file=sys.stderr)
        finally:
            stop_server(srv)
