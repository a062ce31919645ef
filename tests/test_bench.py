"""`tokenspeed bench`: datasets, metric definitions, arrivals, verification, and live runs of `bench serve`."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from tokenspeed.bench import main as bench_main
from tokenspeed.bench.client import StreamParser, build_payload, iter_sse_data
from tokenspeed.bench.datasets import (
    BenchRequest,
    LocalTokenizer,
    random_dataset,
    random_lengths,
    shared_prefix_dataset,
    sharegpt_dataset,
)
from tokenspeed.bench.metrics import RequestResult, arrival_offsets, compute_metrics, verify_lengths
from tokenspeed.bench.sender import LoopLag
from tokenspeed.bench.serve import engine_itl, parse_itl_buckets


class WordTokenizer:
    """One token per whitespace-separated word `w<id>`: exact and fast."""

    vocab_size = 1000
    special_ids: ClassVar[set[int]] = {0, 1}
    source = "words"

    def encode(self, text: str) -> list[int]:
        return [int(w[1:]) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)


def smollm2_tokenizer() -> Path | None:
    for root in (os.environ.get("TOKENSPEED_TEST_ASSETS"), "/root/.cache/tokenspeed/test-assets"):
        if root and (Path(root) / "smollm2" / "tokenizer.json").is_file():
            return Path(root) / "smollm2"
    return None


# --- datasets --------------------------------------------------------------------------------

def test_random_lengths_fixed_when_ratio_zero() -> None:
    rng = np.random.default_rng(0)
    assert set(random_lengths(rng, 128, 0.0, 50).tolist()) == {128}


def test_random_lengths_vllm_range_semantics() -> None:
    lens = random_lengths(np.random.default_rng(0), 100, 0.5, 5000)
    assert lens.min() == 50 and lens.max() == 150  # [int(L*(1-R)), int(L*(1+R))], inclusive
    assert abs(lens.mean() - 100) < 2
    assert random_lengths(np.random.default_rng(0), 1, 0.9, 100).min() >= 1
    with pytest.raises(ValueError):
        random_lengths(np.random.default_rng(0), 100, 1.0, 1)


def test_random_dataset_text_and_ids() -> None:
    tok = WordTokenizer()
    text = random_dataset(tok, np.random.default_rng(1), 20, 64, 16, 0.0, as_ids=False)
    assert all(isinstance(r.prompt, str) and len(tok.encode(r.prompt)) == r.prompt_len == 64 for r in text)
    assert {r.output_len for r in text} == {16}
    ids = random_dataset(tok, np.random.default_rng(1), 20, 64, 16, 0.25, as_ids=True)
    for r in ids:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len and 48 <= r.prompt_len <= 80
        assert not set(r.prompt) & tok.special_ids and 12 <= r.output_len <= 20


@pytest.mark.skipif(smollm2_tokenizer() is None, reason="SmolLM2 test tokenizer not prepared")
def test_random_text_retokenizes_to_length_with_a_real_tokenizer() -> None:
    tok = LocalTokenizer(str(smollm2_tokenizer()))
    reqs = random_dataset(tok, np.random.default_rng(0), 10, 100, 8, 0.0, as_ids=False)
    assert all(len(tok.encode(str(r.prompt))) == r.prompt_len for r in reqs)
    assert sum(r.prompt_len == 100 for r in reqs) >= 9


def test_shared_prefix_structure() -> None:
    tok = WordTokenizer()
    reqs = shared_prefix_dataset(tok, np.random.default_rng(0), num_groups=4, prompts_per_group=5,
                                 system_prompt_len=32, question_len=8, output_len=7)
    assert len(reqs) == 20 and {r.output_len for r in reqs} == {7}
    assert [r.group for r in reqs] != sorted(r.group for r in reqs)  # shuffled
    by_group: dict[int, list[list[int]]] = {}
    for r in reqs:
        assert r.prompt_len == 40 == len(tok.encode(str(r.prompt)))
        by_group.setdefault(r.group, []).append(tok.encode(str(r.prompt)))
    systems = {g: ps[0][:32] for g, ps in by_group.items()}
    for g, ps in by_group.items():
        assert len(ps) == 5 and all(p[:32] == systems[g] for p in ps)
        assert len({tuple(p[32:]) for p in ps}) == 5  # distinct questions
    assert len({tuple(s) for s in systems.values()}) == 4


def test_sharegpt_parsing(tmp_path: Path) -> None:
    data = [
        {"conversations": [{"from": "human", "value": "w5 w6 w7"}, {"from": "gpt", "value": "w1 w2 w3 w4"}]},
        {"conversations": [{"from": "human", "value": "w9 w9"}]},  # no answer: skipped
        {"conversations": [{"from": "system", "value": "w8"}, {"from": "human", "value": "w2 w3"},
                           {"from": "gpt", "value": "w4 w5"}, {"from": "human", "value": "w6"}]},
        {"conversations": [{"from": "human", "value": "w3"}, {"from": "gpt", "value": "w4 w5"}]},  # prompt < 2
        {"id": "x"},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    tok = WordTokenizer()
    reqs = sharegpt_dataset(str(path), tok, np.random.default_rng(0), 10)
    assert sorted((r.prompt, r.prompt_len, r.output_len) for r in reqs) == [("w2 w3", 2, 2), ("w5 w6 w7", 3, 4)]
    fixed = sharegpt_dataset(str(path), tok, np.random.default_rng(0), 10, output_len=9)
    assert {r.output_len for r in fixed} == {9} and len(fixed) == 3  # the unanswered one counts now
    assert len(sharegpt_dataset(str(path), tok, np.random.default_rng(0), 1)) == 1
    assert len(sharegpt_dataset(str(path), tok, np.random.default_rng(0), 10, context_len=5)) == 1


# --- metrics ---------------------------------------------------------------------------------

def _result(send: float, chunks: list[float], end: float, out: int, prompt: int = 10) -> RequestResult:
    r = RequestResult(prompt_len=prompt, expected_output_len=out, send_time=send, chunk_times=chunks,
                      end_time=end, ok=True)
    r.output_tokens = out
    return r


def test_metric_definitions() -> None:
    a = _result(0.0, [0.5, 0.6, 0.8, 1.0], 1.1, 4)
    b = _result(1.0, [1.2, 1.5], 2.0, 3, prompt=20)  # one chunk carried two tokens
    assert a.ttft == pytest.approx(0.5) and a.e2e == pytest.approx(1.1)
    assert a.itls == pytest.approx([0.1, 0.2, 0.2])
    assert a.tpot == pytest.approx((1.1 - 0.5) / 3)
    assert b.tpot == pytest.approx((1.0 - 0.2) / 2)
    assert _result(0, [0.3], 0.3, 1).tpot is None
    failed = RequestResult(5, 4, send_time=0.0, end_time=9.0, ok=False, error="boom")
    m = compute_metrics([a, b, failed])
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["duration_s"] == pytest.approx(2.0)  # first send → last completion (successful ones)
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 7
    assert m["output_throughput"] == pytest.approx(3.5) and m["total_throughput"] == pytest.approx(18.5)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["ttft_ms"]["mean"] == pytest.approx(350) and m["ttft_ms"]["median"] == pytest.approx(350)
    assert m["itl_ms"]["mean"] == pytest.approx(np.mean([100, 200, 200, 300]))  # pooled over requests
    assert m["itl_ms"]["max"] == pytest.approx(300)
    assert m["itl_ms"]["p99"] == pytest.approx(np.percentile([100, 200, 200, 300], 99))
    assert m["tpot_ms"]["mean"] == pytest.approx(np.mean([200, 400]))
    assert m["e2e_ms"]["median"] == pytest.approx(1050)
    assert m["concurrency"] == pytest.approx(2.1 / 2.0)
    # The longest gap first: request b's (1.2 -> 1.5), its first, ending 1.5 s after the first
    # send; then a's two gaps of 0.2 s (0.8 - 0.6 rounds a hair above 1.0 - 0.8) and its 0.1.
    slow = m["slowest_itls"]
    assert [(s["request"], s["chunk"]) for s in slow] == [(1, 1), (0, 2), (0, 3), (0, 1)]
    assert slow[0]["ms"] == pytest.approx(300) and slow[0]["at_s"] == pytest.approx(1.5)
    assert slow[0]["clock_s"] == pytest.approx(1.5)


def test_server_prompt_tokens_preferred_when_all_report_them() -> None:
    a, b = _result(0, [0.1], 1, 2), _result(0, [0.1], 1, 2)
    a.usage_prompt_tokens, b.usage_prompt_tokens = 11, 12
    assert compute_metrics([a, b])["total_input_tokens"] == 23
    b.usage_prompt_tokens = None
    assert compute_metrics([a, b])["total_input_tokens"] == 20


def test_engine_itl_from_two_metrics_scrapes() -> None:
    def scrape(counts: list[int]) -> str:
        les = ["0.01", "0.3", "0.5", "+Inf"]
        return "\n".join(f'tokenspeed:inter_token_latency_seconds_bucket{{model_name="m",le="{le}"}} {n}'
                         for le, n in zip(les, counts)) + "\ntokenspeed:other_bucket{le=\"0.3\"} 7\n"

    before = parse_itl_buckets(scrape([5, 5, 5, 5]))
    after = parse_itl_buckets(scrape([95, 98, 99, 100]))  # 95 gaps, 2 over 300 ms, 1 over 500
    assert engine_itl(before, after) == {"gaps": 95, "over_300ms": 2, "max_le_ms": math.inf}
    after = parse_itl_buckets(scrape([95, 98, 100, 100]))
    assert engine_itl(before, after)["max_le_ms"] == 500.0
    assert parse_itl_buckets("# no histogram\n") is None and engine_itl(None, after) is None


def test_poisson_arrivals() -> None:
    off = arrival_offsets(20000, 4.0, np.random.default_rng(7))
    gaps = np.diff(off)
    assert off[0] == 0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1
    np.testing.assert_array_equal(off, arrival_offsets(20000, 4.0, np.random.default_rng(7)))
    assert not arrival_offsets(10, math.inf, np.random.default_rng(0)).any()


def test_verifier_flags_short_response() -> None:
    good, short = _result(0, [0.1, 0.2], 0.3, 8), _result(0, [0.1], 0.2, 8)
    short.output_tokens = 5
    assert verify_lengths([good, short]) == [(1, 8, 5)]


# --- client ----------------------------------------------------------------------------------

def test_sse_parsing_and_payloads() -> None:
    buf = bytearray(b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choi')
    assert iter_sse_data(buf) == [b'{"choices": [{"text": "a"}]}']
    buf += b'ces": []}\r\n\r\n: keepalive\ndata: [DONE]\n\n'
    assert iter_sse_data(buf) == [b'{"choices": []}', b"[DONE]"] and not buf
    r = RequestResult(3, 2)
    p = StreamParser("openai-chat", r)
    p.feed({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, 1.0)  # empty: not a token chunk
    p.feed({"choices": [{"delta": {"content": "x"}}]}, 2.0)
    p.feed({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}, 3.0)
    assert r.chunk_times == [2.0] and r.text == "x" and r.usage_output_tokens == 2
    n = RequestResult(3, 2)
    pn = StreamParser("tokenspeed-native", n)
    pn.feed({"text": "a", "output_ids": [5], "meta_info": {"completion_tokens": 1}}, 1.0)
    pn.feed({"text": "a", "output_ids": [5], "meta_info": {"completion_tokens": 1}}, 1.5)
    pn.feed({"text": "ab", "output_ids": [5, 6], "meta_info": {"completion_tokens": 2, "prompt_tokens": 3}}, 2.0)
    assert n.chunk_times == [1.0, 2.0] and n.usage_output_tokens == 2 and n.usage_prompt_tokens == 3
    path, body = build_payload("tokenspeed-native", None, BenchRequest([1, 2], 2, 4), ignore_eos=True)
    assert path == "/generate" and body["input_ids"] == [1, 2]
    assert body["sampling_params"] == {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    path, body = build_payload("openai-completions", "m", BenchRequest("hi", 1, 4), ignore_eos=False)
    assert path == "/v1/completions" and body["max_tokens"] == 4 and "ignore_eos" not in body
    with pytest.raises(ValueError):
        build_payload("openai-chat", "m", BenchRequest([1], 1, 1), ignore_eos=True)


# --- offline / one-batch plumbing -------------------------------------------------------------

def test_offline_server_command() -> None:
    from tokenspeed.bench.offline import server_command

    cmd, url = server_command(["/m", "--load-format", "dummy", "--port=31234"])
    assert cmd[4:] == ["/m", "--load-format", "dummy", "--port=31234", "--host", "127.0.0.1"]
    assert url == "http://127.0.0.1:31234"
    cmd, url = server_command(["/m", "--host", "0.0.0.0"])
    port = cmd[cmd.index("--port") + 1]
    assert url == f"http://127.0.0.1:{port}" and cmd[2:4] == ["tokenspeed.launch.cli", "serve"]


class _FakeRunner:
    """Checks every plan the one-batch bench builds and echoes token = position."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.live: set[int] = set()
        self.plans: list[object] = []

    def step(self, plan: object) -> object:
        from tokenspeed.worker.plan import StepOutput, StepPlan

        assert isinstance(plan, StepPlan)
        self.plans.append(plan)
        self.live -= set(plan.finished_slot.tolist())
        assert not self.live & set(plan.new_slot.tolist())
        self.live |= set(plan.new_slot.tolist())
        assert set(plan.sched_slot.tolist()) <= self.live
        assert len(plan.pt_pages) == int(plan.pt_pages_len.sum())
        n = len(plan.sched_slot)
        pos = plan.sched_start_pos + plan.sched_tokens_len
        return StepOutput(slots=plan.sched_slot, tokens=pos.astype(np.uint32), logprobs=np.zeros(n, np.float32))


def test_one_batch_plans() -> None:
    from tokenspeed.bench.one_batch import BatchRun

    runner = _FakeRunner(page_size=4)
    bench = BatchRun(runner, lambda: None, pages_per_slot=3)
    prompts = [[1] * 6, [2] * 6]
    prefill_s, steps, tokens = bench.run(prompts, output_len=4)
    assert len(steps) == 3 and prefill_s >= 0 and tokens.shape == (2, 4)
    assert tokens.tolist() == [[6, 7, 8, 9]] * 2  # decode positions advance one per step
    first = runner.plans[0]
    assert first.pt_pages.tolist() == list(range(6)) and first.new_slot.tolist() == [0, 1]
    assert runner.plans[1].sched_tokens.tolist() == [6, 6] and runner.plans[1].sched_start_pos.tolist() == [6, 6]
    bench.run(prompts, output_len=1)  # the next batch finishes the previous slots first
    assert runner.plans[4].finished_slot.tolist() == [0, 1] and len(runner.plans) == 5


# --- live: a fake OpenAI SSE server -----------------------------------------------------------

class _FakeHandler(BaseHTTPRequestHandler):
    short_by = 0  # tokens to drop from every response (to trip the verifier)
    flushed = 0
    info_reads = 0
    prompts: ClassVar[list] = []  # the prompt of every completion request received

    def log_message(self, *args: object) -> None:
        pass

    def _json(self, code: int, obj: object) -> None:
        raw = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            return self._json(200, {"data": [{"id": "fake-model"}]})
        if self.path == "/get_server_info":  # counters that grow by fixed amounts per read
            _FakeHandler.info_reads += 1
            n = _FakeHandler.info_reads
            return self._json(200, {"engine": {"busy_s": 3.0 * n, "stalled_s": 1.0 * n,
                                               "gpu_idle_s": 0.5 * n, "retractions": 3 * n}})
        return self._json(404, {"error": "no route"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        if self.path == "/flush_cache":
            type(self).flushed += 1
            return self._json(200, {})
        if self.path != "/v1/completions":
            return self._json(404, {"error": "no route"})
        _FakeHandler.prompts.append(body["prompt"])
        n = int(body["max_tokens"]) - type(self).short_by
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close")
        self.end_headers()
        prompt_tokens = len(body["prompt"]) if isinstance(body["prompt"], list) else len(body["prompt"].split())
        for i in range(n):
            chunk = {"choices": [{"index": 0, "text": f" w{i + 2}", "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        if body.get("stream_options", {}).get("include_usage"):
            usage = {"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


@pytest.fixture()
def fake_server() -> Iterator[str]:
    _FakeHandler.short_by = 0
    _FakeHandler.flushed = 0
    _FakeHandler.info_reads = 0
    _FakeHandler.prompts = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _FakeHandler)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def _write_word_tokenizer(tmp_path: Path) -> str:
    """A WordLevel tokenizer.json over w0..w999 (whitespace pre-tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(1000)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["w0"])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return str(tmp_path)


def test_bench_serve_against_fake_server(fake_server: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "runs.jsonl"
    args = ["serve", "--base-url", fake_server, "--tokenizer", _write_word_tokenizer(tmp_path),
            "--num-prompts", "8", "--random-input-len", "16", "--random-output-len", "8",
            "--request-rate", "200", "--max-concurrency", "4", "--disable-tqdm", "--output-file", str(out)]
    assert bench_main(args) == 0
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "Median TTFT (ms):" in text and "Max ITL (ms):" in text
    assert "0 mismatches of 8" in text and "mean 16.0 min 16 max 16" in text
    assert _FakeHandler.flushed == 1
    rec = json.loads(out.read_text().splitlines()[-1])
    m = rec["metrics"]
    assert rec["model"] == "fake-model" and rec["request_rate"] == 200 and rec["ignore_eos"] is True
    assert m["completed"] == 8 and m["total_output_tokens"] == 64 and m["total_input_tokens"] == 8 * 16
    assert m["itl_ms"]["max"] >= m["itl_ms"]["median"] >= 0 and rec["length_mismatches"] == 0
    # The server's counters, read before and after the run: one step of each apart.
    idle = m["gpu_idle"]
    assert idle["gpu_idle_s"] == 0.5 and idle["stalled_s"] == 1.0 and idle["engine_stalled_share"] == 0.25
    assert idle["gpu_idle_share"] == pytest.approx(0.5 / idle["window_s"]) and idle["window_s"] > 0
    assert "GPU idle between steps (%):" in text and "Engine stalled, no step in flight (%):" in text
    assert idle["retractions"] == 3 and "Requests retracted (KV pages ran out):" in text
    lag = m["client_loop_lag"]  # the client's own event loop, probed through the run
    assert lag["samples"] > 0 and lag["max_ms"] >= lag["p99_ms"] >= 0
    assert "Client event loop max lateness (ms):" in text

    _FakeHandler.short_by = 2
    assert bench_main([*args[:-2], "--dataset-name", "random-ids", "--disable-cache-flush"]) == 1
    text = capsys.readouterr().out
    assert "MISMATCH, 8 mismatches of 8" in text and _FakeHandler.flushed == 1
    assert bench_main([*args[:-2], "--no-verify"]) == 0


def test_split_and_merge_keep_request_order() -> None:
    from tokenspeed.bench import procs

    parts = procs.split(7, 3)
    assert parts == [[0, 3, 6], [1, 4], [2, 5]]
    assert procs.split(2, 4) == [[0], [1], [], []]
    results = [[RequestResult(i, 10 * i) for i in idx] for idx in parts]
    merged = procs.merge(parts, results, 7)
    assert [r.prompt_len for r in merged] == list(range(7))  # result i is request i's
    assert [r.expected_output_len for r in merged] == [10 * i for i in range(7)]
    with pytest.raises(RuntimeError):
        procs.merge(parts, [results[0], results[1], []], 7)
    assert procs.num_processes("3") == 3 and 1 <= procs.num_processes("auto") <= procs.MAX_AUTO
    for bad in ("0", "x"):
        with pytest.raises(Exception, match="integer >= 1"):
            procs.num_processes(bad)


@pytest.mark.parametrize("rate", ["200", "inf"])
def test_bench_serve_two_client_processes_match_one(
        fake_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rate: str) -> None:
    """--num-client-processes 2 sends the same requests (same dataset, same arrival offsets, each
    once) and reports the same counts and per-request lengths as 1, with the workers' loop lag."""
    from tokenspeed.bench import serve

    seen: list[list[RequestResult]] = []
    real_metrics = serve.compute_metrics

    def capture(results: list[RequestResult]) -> dict:
        seen.append(results)
        return real_metrics(results)

    monkeypatch.setattr(serve, "compute_metrics", capture)
    out = tmp_path / "runs.jsonl"
    n = 10
    args = ["serve", "--base-url", fake_server, "--tokenizer", _write_word_tokenizer(tmp_path),
            "--num-prompts", str(n), "--random-input-len", "12", "--random-output-len", "6",
            "--random-range-ratio", "0.5", "--request-rate", rate, "--disable-tqdm", "--output-file", str(out)]
    sent = []
    for procs_ in ("1", "2"):
        _FakeHandler.prompts = []
        assert bench_main([*args, "--num-client-processes", procs_]) == 0
        sent.append(_FakeHandler.prompts)
    one, two = (json.loads(line) for line in out.read_text().splitlines())
    assert one["num_client_processes"] == 1 and two["num_client_processes"] == 2
    assert len(sent[1]) == n + 1 and sorted(map(str, sent[0])) == sorted(map(str, sent[1]))  # + warm-up
    for key in ("num_requests", "completed", "total_input_tokens", "total_output_tokens"):
        assert one["metrics"][key] == two["metrics"][key]
    assert two["metrics"]["completed"] == n and two["length_mismatches"] == 0
    lengths = [[(r.prompt_len, r.expected_output_len, r.output_tokens) for r in res] for res in seen]
    assert lengths[0] == lengths[1] and len({x[1] for x in lengths[0]}) > 1  # lengths differ per request
    lag = two["metrics"]["client_loop_lag"]
    assert lag["samples"] > 0 and lag["max_ms"] >= lag["p99_ms"] >= 0
    # One clock for both processes: their first sends lie together (all at t=0 with rate inf).
    firsts = [min(r.send_time for r in seen[1][k::2]) for k in range(2)]
    assert abs(firsts[0] - firsts[1]) < (0.5 if rate == "inf" else 1.0)
    assert two["metrics"]["duration_s"] < 10


def test_client_processes_from_a_script_without_a_main_guard(fake_server: str, tmp_path: Path) -> None:
    """The workers are `python -m tokenspeed.bench.procs`, not multiprocessing's spawn, which
    re-imports the caller's __main__ and fails in a script without `if __name__ == "__main__"`."""
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text("from tokenspeed.bench import main\n"
                      f"raise SystemExit(main(['serve', '--base-url', {fake_server!r}, '--tokenizer', "
                      f"{_write_word_tokenizer(tmp_path)!r}, '--num-prompts', '4', '--random-input-len', '8', "
                      "'--random-output-len', '3', '--disable-tqdm', '--num-client-processes', '2']))\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "python")}
    out = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Client processes:" in out.stdout and "0 mismatches of 4" in out.stdout
    assert len(_FakeHandler.prompts) == 5  # the warm-up and the 4 requests


def test_max_concurrency_is_refused_with_client_processes(fake_server: str, tmp_path: Path) -> None:
    args = ["serve", "--base-url", fake_server, "--tokenizer", _write_word_tokenizer(tmp_path),
            "--num-prompts", "4", "--max-concurrency", "2", "--num-client-processes", "2", "--disable-tqdm"]
    with pytest.raises(SystemExit, match="--max-concurrency is a global cap"):
        bench_main(args)


def test_loop_lag_sees_a_blocked_event_loop() -> None:
    async def block() -> dict | None:
        lag = LoopLag(period=0.001)
        probe = asyncio.ensure_future(lag.run())
        await asyncio.sleep(0.01)
        _hold(0.15)  # the loop is held, as a client parsing a burst of events holds it
        await asyncio.sleep(0.01)
        probe.cancel()
        return lag.summary()

    s = asyncio.run(block())
    assert s is not None and s["max_ms"] >= 140 and s["over_100ms"] == 1


def _hold(seconds: float) -> None:
    time.sleep(seconds)


@pytest.mark.parametrize("stagger", [False, True])
def test_request_tasks_start_all_at_once_unless_staggered(
        fake_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stagger: bool) -> None:
    """At --request-rate inf every request's task exists before the first request is sent (as
    sglang.bench_serving and vllm bench serve do); --stagger-starts starts them one at a time, so the
    first request goes out while it is the only one."""
    import asyncio

    from tokenspeed.bench import sender

    seen: list[int] = []  # request tasks alive at each send
    real_send = sender.send

    async def counting_send(*a: object, **kw: object) -> RequestResult:
        seen.append(sum("send_all.<locals>.one" in t.get_coro().__qualname__ for t in asyncio.all_tasks()))
        return await real_send(*a, **kw)

    monkeypatch.setattr(sender, "send", counting_send)
    out = tmp_path / "runs.jsonl"
    n = 12
    args = ["serve", "--base-url", fake_server, "--tokenizer", _write_word_tokenizer(tmp_path),
            "--num-prompts", str(n), "--random-input-len", "8", "--random-output-len", "4",
            "--warmup-requests", "0", "--disable-tqdm", "--output-file", str(out)]
    assert bench_main(args + (["--stagger-starts"] if stagger else [])) == 0
    assert len(seen) == n
    assert seen[0] == (1 if stagger else n)
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec["stagger_starts"] is stagger and rec["request_rate"] == "inf"
    assert rec["metrics"]["completed"] == n and rec["length_mismatches"] == 0


def test_git_commit_only_from_a_tokenspeed_checkout(tmp_path: Path) -> None:
    """An installed copy inside another git repository (a pyenv checkout, say) has no commit."""
    import shutil
    import subprocess

    from tokenspeed.bench import serve

    here = Path(serve.__file__).resolve()
    if (here.parents[3] / ".git").exists():  # running from the source tree (PYTHONPATH=python)
        assert serve.git_commit() is not None and len(serve.git_commit() or "") == 40
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q", str(tmp_path)], check=True)
    subprocess.run([*git, "-C", str(tmp_path), "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    copy = tmp_path / "lib" / "tokenspeed" / "bench" / "serve.py"
    copy.parent.mkdir(parents=True)
    shutil.copy(here, copy)
    spec = importlib.util.spec_from_file_location("serve_copy", copy)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.git_commit() is None


# --- live: the real server (runs last; needs the built core) ----------------------------------

HAVE_CORE = importlib.util.find_spec("tokenspeed._core") is not None


@pytest.mark.skipif(not HAVE_CORE, reason="tokenspeed._core is not built/installed here")
@pytest.mark.slow
def test_zz_bench_serve_real_server(server: object, tmp_path: Path) -> None:
    out = tmp_path / "real.jsonl"
    url = server.url  # type: ignore[attr-defined]
    # The last run: two client processes, each its own event loop (--num-client-processes).
    for backend, nproc in (("openai-completions", 1), ("tokenspeed-native", 1), ("openai-completions", 2)):
        rc = bench_main(["serve", "--base-url", url, "--backend", backend, "--num-prompts", "8",
                         "--random-input-len", "32", "--random-output-len", "8", "--disable-tqdm",
                         "--disable-cache-flush", "--num-client-processes", str(nproc), "--output-file", str(out)])
        assert rc == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["num_client_processes"] for r in recs] == [1, 1, 2]
    assert recs[2]["metrics"]["client_loop_lag"]["samples"] > 0
    for rec in recs:
        assert rec["metrics"]["completed"] == 8 and rec["length_mismatches"] == 0
        assert rec["metrics"]["total_output_tokens"] == 64 and rec["output_tokens_source"] == "server usage"
        assert rec["metrics"]["gpu_idle"]["gpu_idle_s"] >= 0 and rec["metrics"]["gpu_idle"]["window_s"] > 0
        assert rec["metrics"]["gpu_idle"]["retractions"] == 0  # 8 short requests fit the pool
        itl = rec["metrics"]["engine_itl"]  # 8 requests x 7 gaps, as the engine saw them
        assert itl["gaps"] == 56 and itl["max_le_ms"] > 0
