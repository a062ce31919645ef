"""`tokenspeed bench serve`: online serving benchmark against any OpenAI-compatible server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from tokenspeed.bench import procs
from tokenspeed.bench.client import BACKENDS, send
from tokenspeed.bench.datasets import (
    RANGE_RATIO_HELP,
    BenchRequest,
    BenchTokenizer,
    build_dataset,
    length_stats,
    resolve_tokenizer,
)
from tokenspeed.bench.metrics import (
    RequestResult,
    arrival_offsets,
    compute_metrics,
    format_metrics,
    verify_lengths,
)
from tokenspeed.bench.sender import LoopLag, open_clients, payload_fn, send_all

DATASETS = ("random", "random-ids", "sharegpt", "generated-shared-prefix")


def add_dataset_args(p: argparse.ArgumentParser, *, num_prompts: int = 1000, input_len: int = 1024,
                     output_len: int = 1024) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=DATASETS, default="random",
                   help="random: random-token text prompts re-tokenized to the drawn length; random-ids: "
                        "token-id prompts of exact length (not with openai-chat); sharegpt: --dataset-path; "
                        "generated-shared-prefix: SGLang's gsp groups (default: random)")
    g.add_argument("--num-prompts", type=int, default=num_prompts,
                   help=f"number of requests (default {num_prompts}; gsp: groups x prompts per group)")
    g.add_argument("--random-input-len", type=int, default=input_len, help=f"(default {input_len})")
    g.add_argument("--random-output-len", type=int, default=output_len, help=f"(default {output_len})")
    g.add_argument("--random-range-ratio", type=float, default=0.0, help=RANGE_RATIO_HELP)
    g.add_argument("--dataset-path", help="ShareGPT JSON: a list of {conversations: [{from, value}, ...]}")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="fixed max_tokens for sharegpt (default: token count of the first gpt turn)")
    g.add_argument("--sharegpt-context-len", type=int, default=None,
                   help="skip sharegpt pairs whose prompt + output tokens exceed this")
    g.add_argument("--gsp-num-groups", type=int, default=64, help="(default 64)")
    g.add_argument("--gsp-prompts-per-group", type=int, default=16, help="(default 16)")
    g.add_argument("--gsp-system-prompt-len", type=int, default=2048, help="(default 2048)")
    g.add_argument("--gsp-question-len", type=int, default=128, help="(default 128)")
    g.add_argument("--gsp-output-len", type=int, default=256, help="(default 256)")
    g.add_argument("--seed", type=int, default=1, help="seed of prompts, lengths and arrivals (default 1)")


def add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=BACKENDS, default="openai-completions",
                   help="openai-completions (/v1/completions, default), openai-chat (/v1/chat/completions), "
                        "tokenspeed-native (SGLang-style /generate), openai-embeddings (/v1/embeddings "
                        "of an --is-embedding server: requests/s and input tokens/s)")
    p.add_argument("--model", help="model name to send (default: the first id of GET /v1/models)")
    p.add_argument("--tokenizer", help="dir with tokenizer.json (or the file) for counting and generating "
                                       "prompt tokens (default: the server's model dir from /get_model_info "
                                       "if local, else the server's /tokenize)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="cap on requests in flight (only with --num-client-processes 1)")
    p.add_argument("--num-client-processes", type=procs.num_processes, default=1, metavar="N|auto",
                   help="send the measured requests from N processes (auto: min(8, CPUs)), each with its "
                        "own event loop, the requests dealt round-robin and started together at one "
                        "instant (same dataset and arrival offsets as with 1). One Python event loop cannot "
                        "read thousands of streams in time (S1: ~50k SSE events/s) and its lateness counts "
                        "as the server's ITL; see client_loop_lag (default 1)")
    p.add_argument("--stagger-starts", action="store_true",
                   help="start the request tasks one at a time, letting the event loop read the open "
                        "streams between starts, instead of creating every task at once (the default, as "
                        "sglang.bench_serving and vllm bench serve do). With thousands of requests at t=0, "
                        "creating them all first costs ~1 ms of Python each before the loop reads any "
                        "stream, and that client-made start-up gap counts in the first streams' ITL; "
                        "staggering keeps it out, but sends the last request later. Only matters when many "
                        "requests are due at once (--request-rate inf)")
    p.add_argument("--warmup-requests", type=int, default=1,
                   help="requests sent (concurrently, the first prompt) before measuring (default 1)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="force max_tokens outputs (default: on for random, random-ids and gsp; off for sharegpt)")
    p.add_argument("--no-verify", action="store_true",
                   help="do not fail when an ignore_eos response has a length != max_tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="(default 0: greedy)")
    p.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request body")
    p.add_argument("--disable-cache-flush", action="store_true",
                   help="do not POST /flush_cache after warm-up (by default it is called; 404 is ignored)")
    p.add_argument("--request-timeout", type=float, default=6 * 3600, help="seconds per request")
    p.add_argument("--output-file", help="append one JSON line with the config and metrics of this run")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--tag", default=None, help="free text stored in the JSON line")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenspeed bench serve",
                                description="Online serving benchmark: streams every request (SSE) and "
                                            "reports TTFT, TPOT, ITL, E2E and throughput.")
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="(default http://127.0.0.1:30000)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s, Poisson arrivals; inf (default) = all at once")
    add_client_args(p)
    add_dataset_args(p)
    return p


def default_model(base_url: str) -> str | None:
    try:
        r = httpx.get(f"{base_url}/v1/models", timeout=10, trust_env=False)
        r.raise_for_status()
        data = r.json().get("data") or []
        return str(data[0]["id"]) if data else None
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def git_commit() -> str | None:
    """HEAD of the TokenSpeed checkout this file runs from; None when installed (site-packages
    may lie inside another git repository, e.g. a pyenv checkout)."""
    here = Path(__file__).resolve()
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], check=False, capture_output=True,
                             text=True, timeout=5, cwd=here.parent)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 2:
        return None
    top, head = lines
    return head if (Path(top) / "python" / "tokenspeed" / "bench" / "serve.py").resolve() == here else None


async def _flush_cache(client: httpx.AsyncClient, base_url: str) -> str:
    try:
        r = await client.post(f"{base_url}/flush_cache")
    except httpx.HTTPError as e:
        return f"failed ({e})"
    if r.status_code == 200:
        return "flushed"
    if r.status_code == 404:
        return "not supported by the server"
    return f"HTTP {r.status_code}: {r.text.strip()[:200]}"


async def _engine_counters(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    """TokenSpeed's engine time counters from /get_server_info (None from other servers), with
    "at_s": when they were read (the bench's perf_counter clock)."""
    try:
        r = await client.get(f"{base_url}/get_server_info")
        engine = r.json().get("engine") if r.status_code == 200 else None
        if not engine:
            return None
        counters = {k: float(engine[k]) for k in ("busy_s", "stalled_s")}
        for key in ("gpu_idle_s", "retractions"):  # older servers lack them
            if key in engine:
                counters[key] = float(engine[key])
        return {**counters, "at_s": time.perf_counter()}
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None


ITL_SERIES = "tokenspeed:inter_token_latency_seconds_bucket"


async def _engine_itl_buckets(client: httpx.AsyncClient, base_url: str) -> dict[float, float] | None:
    """The engine's inter-token gap histogram from /metrics (upper bound s -> cumulative count,
    summed over label sets); None from servers without it."""
    try:
        r = await client.get(f"{base_url}/metrics")
        return parse_itl_buckets(r.text) if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def parse_itl_buckets(text: str) -> dict[float, float] | None:
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        if not line.startswith(ITL_SERIES + "{"):
            continue
        labels, _, value = line.rpartition(" ")
        le = labels.split('le="', 1)[1].split('"', 1)[0]
        bound = math.inf if le == "+Inf" else float(le)
        buckets[bound] = buckets.get(bound, 0.0) + float(value)
    return buckets or None


def engine_itl(before: dict[float, float] | None, after: dict[float, float] | None,
               over_s: float = 0.3) -> dict | None:
    """The run's inter-token gaps as the engine saw them (its event loop, when each step's
    tokens arrived: before detokenizing and the HTTP stream, and before the client): how many
    exceeded `over_s` and the histogram bound under which all of them fall. A long gap the
    client measures but the engine does not was made between the engine and the client."""
    if not before or not after or over_s not in after:
        return None
    delta = {b: after[b] - before.get(b, 0.0) for b in after}
    total = delta.get(math.inf, 0.0)
    max_le = min((b for b, n in delta.items() if n >= total), default=math.inf)
    return {"gaps": int(total), f"over_{int(over_s * 1e3)}ms": int(total - delta[over_s]),
            "max_le_ms": max_le * 1e3}


def gpu_idle_share(before: dict[str, float] | None, after: dict[str, float] | None) -> dict | None:
    """The server's idle counters over the run (between the bench's two reads of them).

    - gpu_idle_s / gpu_idle_share: the worker's own measure (CUDA events; wall clock on CPU) of
      the GPU idle between steps, over the wall time between the two reads (window_s). It counts
      every gap, also those while no request was in the server (low request rates raise it).
    - busy_s, stalled_s / engine_stalled_share: the engine's view: seconds it had a plan in flight
      (busy) or had requests but none in flight (stalled, waiting for the engine); share =
      stalled / (busy + stalled). One-step-ahead scheduling keeps it near 0 even when the GPU
      waits for the worker's host."""
    if not before or not after:
        return None
    busy = after["busy_s"] - before["busy_s"]
    stalled = after["stalled_s"] - before["stalled_s"]
    total = busy + stalled
    out = {"busy_s": busy, "stalled_s": stalled,
           "engine_stalled_share": stalled / total if total > 0 else math.nan}
    if "gpu_idle_s" in before and "gpu_idle_s" in after:
        idle = after["gpu_idle_s"] - before["gpu_idle_s"]
        window = after["at_s"] - before["at_s"]
        out.update(gpu_idle_s=idle, window_s=window,
                   gpu_idle_share=idle / window if window > 0 else math.nan)
    if "retractions" in before and "retractions" in after:  # requests sent back to the queue
        out["retractions"] = int(after["retractions"] - before["retractions"])
    return out


async def run_requests(args: argparse.Namespace, reqs: list[BenchRequest], model: str | None,
                       ignore_eos: bool, server: dict | None = None) -> tuple[list[RequestResult], list[str]]:
    """Warm-up, cache flush, then every request on its Poisson arrival; returns results and notes.
    `server`, when given, receives the server's engine counters over the run ("gpu_idle").
    With --num-client-processes N > 1 the workers are spawned (and ready) before the warm-up,
    so that their start-up stays out of the counters' window, and send the measured requests."""
    notes: list[str] = []
    nproc = args.num_client_processes
    offsets = arrival_offsets(len(reqs), args.request_rate, np.random.default_rng(args.seed + 1))
    pool = procs.ClientProcesses(args, reqs, offsets.tolist(), model, ignore_eos, nproc) if nproc > 1 else None
    clients = open_clients(args, len(reqs) if pool is None else max(1, args.warmup_requests))
    async with contextlib.AsyncExitStack() as stack:
        if pool is not None:
            stack.callback(pool.close)
        for c in clients:
            await stack.enter_async_context(c)
        payload = payload_fn(args, model, ignore_eos)
        if args.warmup_requests > 0:
            notes.append(await _warm_up(args, clients, reqs[0], *payload(reqs[0])))
        if not args.disable_cache_flush:
            notes.append(f"flush_cache: {await _flush_cache(clients[0], args.base_url)}")

        counters = await _engine_counters(clients[0], args.base_url)
        itl = await _engine_itl_buckets(clients[0], args.base_url)
        lag = LoopLag()
        if pool is not None:  # the parent's loop only waits: the workers' lateness is the one
            results, lag.lags = await asyncio.to_thread(pool.run)
        else:
            probe = asyncio.ensure_future(lag.run())
            try:
                results = await send_all(args, reqs, clients, payload, offsets)
            finally:
                probe.cancel()
        if server is not None:
            server["client_loop_lag"] = lag.summary()
            server["gpu_idle"] = gpu_idle_share(counters, await _engine_counters(clients[0], args.base_url))
            server["engine_itl"] = engine_itl(itl, await _engine_itl_buckets(clients[0], args.base_url))
    return results, notes


async def _warm_up(args: argparse.Namespace, clients: list[httpx.AsyncClient], req: BenchRequest,
                   path: str, body: dict) -> str:
    """--warmup-requests copies of the first request, all at once; any failure ends the run."""
    warm = await asyncio.gather(*[
        send(clients[k % len(clients)], args.base_url, args.backend, path, body,
             RequestResult(req.prompt_len, req.output_len))
        for k in range(args.warmup_requests)])
    bad = [w for w in warm if not w.ok]
    if bad:
        raise SystemExit(f"tokenspeed bench: warm-up request failed: {bad[0].error}")
    return f"warm-up: {args.warmup_requests} request(s) ok"


def resolve_output_tokens(results: list[RequestResult], tok: BenchTokenizer) -> str:
    """Output token counts from usage where the server sent it, else by re-tokenizing the text."""
    counted = 0
    for r in results:
        if r.usage_output_tokens is not None:
            r.output_tokens = r.usage_output_tokens
        elif r.ok:
            r.output_tokens = len(tok.encode(r.text))
            counted += 1
    return "server usage" if counted == 0 else f"tokenizer re-count ({counted} requests without usage)"


def dataset_summary(args: argparse.Namespace, reqs: list[BenchRequest]) -> dict[str, object]:
    s: dict[str, object] = {"name": args.dataset_name, "num_prompts": len(reqs),
                            "input_len": length_stats([r.prompt_len for r in reqs]),
                            "output_len": length_stats([r.output_len for r in reqs])}
    if args.dataset_name in ("random", "random-ids"):
        s["random_range_ratio"] = args.random_range_ratio
        s["range_semantics"] = "vLLM: uniform in [max(1, int(L*(1-R))), int(L*(1+R))]"
    if args.dataset_name == "generated-shared-prefix":
        s["gsp"] = {k: getattr(args, f"gsp_{k}") for k in
                    ("num_groups", "prompts_per_group", "system_prompt_len", "question_len", "output_len")}
    return s


def print_dataset(summary: dict) -> None:
    i, o = summary["input_len"], summary["output_len"]
    print(f"dataset {summary['name']}: {summary['num_prompts']} prompts; input tokens mean {i['mean']:.1f} "
          f"min {i['min']} max {i['max']}; output tokens (max_tokens) mean {o['mean']:.1f} "
          f"min {o['min']} max {o['max']}")
    if "range_semantics" in summary:
        print(f"random-range-ratio {summary['random_range_ratio']} ({summary['range_semantics']})")


def run_serve_bench(args: argparse.Namespace, argv: list[str], extra_record: dict | None = None,
                    title: str = "serve") -> tuple[int, dict]:
    """The whole `bench serve` flow on parsed args; returns (exit code, the JSON record)."""
    model = args.model or default_model(args.base_url)
    if args.backend != "tokenspeed-native" and not model:
        print("warning: GET /v1/models gave no model id; sending requests without 'model'", file=sys.stderr)
    tok = resolve_tokenizer(args.tokenizer, args.base_url, model)
    if args.dataset_name == "random-ids" and args.backend == "openai-chat":
        raise SystemExit("tokenspeed bench: random-ids sends token ids; use openai-completions or tokenspeed-native")
    reqs = build_dataset(args, tok)
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else args.dataset_name != "sharegpt"
    if args.backend == "openai-embeddings":  # nothing is generated: no length to check
        ignore_eos = False
    summary = dataset_summary(args, reqs)
    print(f"tokenizer: {tok.source}; model: {model}; backend: {args.backend}; ignore_eos: {ignore_eos}")
    print_dataset(summary)

    server: dict = {}
    results, notes = asyncio.run(run_requests(args, reqs, model, ignore_eos, server))
    for n in notes:
        print(n)
    out_source = resolve_output_tokens(results, tok)
    m = compute_metrics(results)
    for key in ("gpu_idle", "engine_itl", "client_loop_lag"):
        if server.get(key):
            m[key] = server[key]
    header = {"Backend": args.backend, "Traffic request rate": args.request_rate,
              "Max request concurrency": args.max_concurrency or "not set",
              "Request task starts": "staggered" if args.stagger_starts else "all at once",
              "Client processes": args.num_client_processes}
    print(format_metrics(m, header))
    print(f"output tokens counted from: {out_source}")
    realised = length_stats([r.output_tokens for r in results if r.ok])
    print(f"realised output tokens: mean {realised['mean']:.1f} min {realised['min']} max {realised['max']}")

    rc = 0
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"FAILED requests: {len(failed)}; first error: {failed[0].error}", file=sys.stderr)
        rc = 1
    mismatches = verify_lengths(results) if ignore_eos else []
    if ignore_eos:
        verdict = "OK" if not mismatches else "MISMATCH"
        print(f"length check (ignore_eos, every output == max_tokens): {verdict}, "
              f"{len(mismatches)} mismatches of {len(results) - len(failed)}")
        for i, want, got in mismatches[:5]:
            print(f"  request {i}: max_tokens {want}, got {got}", file=sys.stderr)
        if mismatches and not args.no_verify:
            rc = 1
    record = {
        "bench": title, "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(), "argv": argv, "base_url": args.base_url, "backend": args.backend,
        "model": model, "tokenizer": tok.source, "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency, "stagger_starts": bool(args.stagger_starts),
        "ignore_eos": ignore_eos, "seed": args.seed, "num_client_processes": args.num_client_processes,
        "tag": args.tag, "dataset": summary, "notes": notes, "output_tokens_source": out_source,
        "realised_output_len": realised, "length_mismatches": len(mismatches) if ignore_eos else None,
        "first_error": failed[0].error if failed else None, **(extra_record or {}), "metrics": m,
    }
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps(clean_json(record), default=str) + "\n")
        print(f"appended the results to {args.output_file}")
    return rc, record


def clean_json(o: object) -> object:
    """Strict JSON: numpy scalars → Python, inf/nan → "inf"/null."""
    if isinstance(o, dict):
        return {str(k): clean_json(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [clean_json(v) for v in o]
    if isinstance(o, np.generic):
        o = o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None if math.isnan(o) else ("inf" if o > 0 else "-inf")
    return o


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    args.base_url = args.base_url.rstrip("/")
    rc, _ = run_serve_bench(args, ["tokenspeed", "bench", "serve", *argv])
    return rc
