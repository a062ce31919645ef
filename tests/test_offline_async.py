"""`tokenspeed.AsyncLLM` on CPU with the default model: `async for` streams the same greedy
tokens as a whole generation, requests run concurrently, abort ends a stream with
finish_reason "abort" and frees its slot, and shutdown ends it all."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tokenspeed import AsyncLLM, SamplingParams


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncLLM]:
    with AsyncLLM(device="cpu", max_total_tokens=4096, max_running_requests=8) as e:
        yield e


async def _collect(engine: AsyncLLM, prompt: str, sp: SamplingParams, rid: str) -> tuple[str, list[int], list]:
    text, ids, outs = "", [], []
    async for out in engine.generate(prompt, sp, request_id=rid):
        text += out.outputs[0].text
        ids += out.outputs[0].token_ids
        outs.append(out)
    return text, ids, outs


def test_streams_concurrently_and_in_order(engine: AsyncLLM) -> None:
    sp = SamplingParams(temperature=0, max_tokens=6)

    async def main() -> list:
        return await asyncio.gather(*(_collect(engine, p, sp, f"r{i}")
                                      for i, p in enumerate(["Hello", "The sky is", "Hello"])))

    (a_text, a_ids, a_outs), (_, b_ids, _), (c_text, c_ids, _) = asyncio.run(main())
    assert len(a_outs) > 1  # streamed, not one final output
    assert a_outs[-1].finished and a_outs[-1].outputs[0].finish_reason == "length"
    assert len(a_ids) == len(b_ids) == 6
    assert (a_text, a_ids) == (c_text, c_ids)  # the same prompt, greedy: the same tokens
    assert a_outs[0].prompt_token_ids  # the first output names the prompt's tokens


def test_abort_ends_the_stream(engine: AsyncLLM) -> None:
    async def main() -> tuple[list, str]:
        outs = []
        async for out in engine.generate("Count:", SamplingParams(max_tokens=2000, ignore_eos=True),
                                         request_id="long"):
            outs.append(out)
            if len(outs) == 3:
                await engine.abort("long")
        # The engine serves the next request (the aborted one's slot is free).
        text, _, _ = await _collect(engine, "Hi", SamplingParams(temperature=0, max_tokens=2), "after")
        return outs, text

    outs, text = asyncio.run(asyncio.wait_for(main(), timeout=120))
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs) < 100
    assert text


def test_breaking_out_of_the_loop_aborts(engine: AsyncLLM) -> None:
    async def main() -> int:
        async for _ in engine.generate("Count:", SamplingParams(max_tokens=2000, ignore_eos=True),
                                       request_id="left"):
            break
        await asyncio.sleep(0.5)
        return engine.engine.core.in_flight()

    assert asyncio.run(main()) == 0


def test_a_duplicate_request_id_is_refused(engine: AsyncLLM) -> None:
    async def main() -> None:
        gen = engine.generate("Count:", SamplingParams(max_tokens=50), request_id="dup")
        await gen.__anext__()
        with pytest.raises(ValueError, match="already in flight"):
            async for _ in engine.generate("x", request_id="dup"):
                pass
        await gen.aclose()

    asyncio.run(main())
