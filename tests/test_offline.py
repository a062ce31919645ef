"""`tokenspeed.LLM` (the offline engine API) on CPU with the default model: greedy outputs equal
the server's for the same prompts, chat, n > 1, logprobs, structured outputs, the server's
validation errors, one engine per process, and the lifetime: interpreter exit, Ctrl-C and a
worker crash leave no worker process or shared-memory segment and never hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tokenspeed import LLM, SamplingParams, StructuredOutputsParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    # The shared server's settings (tests/conftest.py), so both schedule alike.
    with LLM(device="cpu", page_size=4, max_running_requests=32, max_total_tokens=16384) as engine:
        yield engine


def test_greedy_generate_equals_the_server(llm: LLM, client: openai.OpenAI, model: str) -> None:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS
    for prompt, out in zip(PROMPTS, outs):
        served = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                           logprobs=0)
        assert out.outputs[0].text == served.choices[0].text
        assert out.outputs[0].finish_reason == served.choices[0].finish_reason
        assert len(out.outputs[0].token_ids) == served.usage.completion_tokens
        assert len(out.prompt_token_ids) == served.usage.prompt_tokens
        assert out.finished


def test_token_id_prompts_and_per_prompt_params(llm: LLM) -> None:
    text = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0]
    ids = text.prompt_token_ids
    by_ids = llm.generate([ids, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_ids] == [text.outputs[0].token_ids] * 2
    outs = llm.generate(PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=2),
                                      SamplingParams(temperature=0, max_tokens=5)], use_tqdm=True)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_chat_equals_the_server(llm: LLM, client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    served = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert out.outputs[0].text == served.choices[0].message.content
    assert "Name a colour." in out.prompt  # the rendered template
    two = llm.chat([messages, [{"role": "user", "content": "Hi"}]], GREEDY, use_tqdm=False,
                   chat_template_kwargs={"enable_thinking": False})
    assert len(two) == 2 and two[0].outputs[0].text == out.outputs[0].text


def test_n_samples_logprobs_and_prompt_logprobs(llm: LLM) -> None:
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=4, logprobs=2, prompt_logprobs=1)
    out = llm.generate(PROMPTS[0], sp, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # seeded samples differ
    for c in out.outputs:
        assert len(c.token_ids) == len(c.logprobs) == 4
        for token, position in zip(c.token_ids, c.logprobs):
            assert token in position and len(position) <= 3
            assert position[token].decoded_token is not None
        assert c.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs)))
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert out.prompt_token_ids[1] in out.prompt_logprobs[1]
    # Without logprobs asked for, vLLM's outputs carry none.
    plain = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_structured_outputs(llm: LLM) -> None:
    choice = SamplingParams(temperature=0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert llm.generate("Is the sky blue?", choice, use_tqdm=False)[0].outputs[0].text in ("yes", "no")
    regex = SamplingParams(temperature=0, max_tokens=8, guided_decoding={"regex": "[0-9]{3}"})
    assert len(llm.generate("A number:", regex, use_tqdm=False)[0].outputs[0].text) == 3
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"],
              "additionalProperties": False}
    js = SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(json=schema))
    text = llm.chat([{"role": "user", "content": "Give an age as JSON."}], js, use_tqdm=False)[0].outputs[0].text
    assert isinstance(json.loads(text)["age"], int)


def test_the_servers_validation_errors(llm: LLM) -> None:
    with pytest.raises(ValueError, match="temperature"):
        llm.generate("x", SamplingParams(temperature=-1), use_tqdm=False)
    with pytest.raises(ValueError, match="regex"):
        llm.generate("x", SamplingParams(guided_decoding={"regex": "("}), use_tqdm=False)
    with pytest.raises(ValueError, match="not supported yet"):
        SamplingParams(bad_words=["x"])
    with pytest.raises(ValueError, match="is-embedding"):  # a generating engine pools nothing
        llm.embed("x")
    # The engine still serves after refused requests.
    assert llm.generate("x", SamplingParams(max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids


def test_a_second_engine_is_refused(llm: LLM) -> None:
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="already running in this process"):
        LLM(device="cpu")
    assert time.monotonic() - started < 5  # refused before any worker starts


def test_serve_flags_are_keyword_arguments() -> None:
    from tokenspeed.config import ConfigError
    from tokenspeed.offline.engine import make_config

    cfg = make_config("/m", {"max_model_len": 512, "max_running_requests": 4})
    assert (cfg.model_path, cfg.context_length, cfg.max_running_requests) == ("/m", 512, 4)
    with pytest.raises(ConfigError, match="did you mean 'max_running_requests'"):
        make_config(None, {"max_runing_requests": 4})


def _child(mode: str, tmp_path: Path) -> tuple[subprocess.Popen, dict]:
    log = open(tmp_path / f"{mode}.log", "w")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("offline_child.py")), mode],
                            stdout=subprocess.PIPE, stderr=log, text=True)
    first = _report(proc)
    if first is None:
        proc.wait(timeout=30)
        pytest.fail(f"the child ended: {(tmp_path / f'{mode}.log').read_text()[-3000:]}")
    return proc, first


def _report(proc: subprocess.Popen) -> dict | None:
    """The child's next JSON line (the engine's log lines share its stdout)."""
    for line in proc.stdout:
        if line.startswith("{"):
            return json.loads(line)
    return None


def _last_report(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in state  # exited, not yet reaped by init


def _assert_clean(info: dict) -> None:
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in info["workers"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in info["workers"]), "a worker outlived the engine"
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"tokenspeed-{info['pid']}")]
    assert left == [], f"shared memory left behind: {left}"


def test_exit_without_shutdown_cleans_up(tmp_path: Path) -> None:
    proc, info = _child("exit", tmp_path)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and _last_report(out)["text"]
    _assert_clean(info)


def test_ctrl_c_while_generating_cleans_up(tmp_path: Path) -> None:
    proc, info = _child("sigint", tmp_path)
    assert _report(proc)["generating"]
    time.sleep(2)
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    try:
        proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # say where it stuck: its log and its threads' stacks
        proc.kill()
        pytest.fail(f"no exit {time.monotonic() - sent:.0f} s after SIGINT; child log:\n"
                    + (tmp_path / "sigint.log").read_text()[-6000:])
    assert "KeyboardInterrupt" in (tmp_path / "sigint.log").read_text()
    _assert_clean(info)


def test_a_worker_crash_raises_in_the_caller(tmp_path: Path) -> None:
    proc, info = _child("crash", tmp_path)
    out, _ = proc.communicate(timeout=120)
    report = _last_report(out)
    assert report["error"] == "EngineDeadError", report
    assert "worker rank 0" in report["message"] or "worker" in report["message"]
    _assert_clean(info)
