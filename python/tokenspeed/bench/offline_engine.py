"""`tokenspeed bench offline --via engine` (the default): the dataset through `tokenspeed.LLM.generate`
in this process, every prompt at once; output and total tok/s, in the same JSON record shape as
the server path (`--output-file`)."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

from tokenspeed.bench.datasets import LocalTokenizer, build_dataset, length_stats
from tokenspeed.bench.serve import clean_json, dataset_summary, git_commit, print_dataset


def run_engine_bench(args: argparse.Namespace, serve_flags: list[str], argv: list[str]) -> int:
    from tokenspeed import LLM, SamplingParams
    from tokenspeed.config import ConfigError, parse_serve_args

    try:
        cfg = parse_serve_args(serve_flags)
    except ConfigError as e:
        raise SystemExit(f"tokenspeed bench offline: {e}") from None
    t0 = time.monotonic()
    with LLM.from_config(cfg) as llm:
        startup_s = round(time.monotonic() - t0, 2)
        print(f"engine ready in this process after {startup_s} s")
        tok = LocalTokenizer(args.tokenizer or str(llm.engine.group.layout.tokenizer_dir))
        if args.backend == "openai-chat":
            raise SystemExit("tokenspeed bench offline --via engine sends completions (LLM.generate); "
                             "--backend openai-chat needs --via server")
        reqs = build_dataset(args, tok)
        ignore_eos = args.ignore_eos if args.ignore_eos is not None else args.dataset_name != "sharegpt"
        summary = dataset_summary(args, reqs)
        print(f"tokenizer: {tok.source}; via: LLM.generate; ignore_eos: {ignore_eos}")
        print_dataset(summary)
        params = [SamplingParams(temperature=args.temperature, max_tokens=r.output_len, ignore_eos=ignore_eos)
                  for r in reqs]
        if args.warmup_requests:
            llm.generate([r.prompt for r in reqs[:args.warmup_requests]],
                         SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=not args.disable_tqdm)
        duration = time.perf_counter() - start
    out_lens = [len(o.outputs[0].token_ids) for o in outs]
    in_lens = [len(o.prompt_token_ids or []) for o in outs]
    m = {"completed": len(outs), "duration_s": duration, "total_input_tokens": sum(in_lens),
         "total_output_tokens": sum(out_lens), "request_throughput": len(outs) / duration,
         "output_throughput": sum(out_lens) / duration,
         "total_throughput": (sum(in_lens) + sum(out_lens)) / duration}
    mismatches = [(i, r.output_len, n) for i, (r, n) in enumerate(zip(reqs, out_lens))
                  if ignore_eos and n != r.output_len]
    rc = 1 if mismatches and not args.no_verify else 0
    if ignore_eos:
        print(f"length check (ignore_eos, every output == max_tokens): "
              f"{'OK' if not mismatches else 'MISMATCH'}, {len(mismatches)} mismatches of {len(outs)}")
        for i, want, got in mismatches[:5]:
            print(f"  request {i}: max_tokens {want}, got {got}", file=sys.stderr)
    print(f"offline throughput (LLM.generate): output {m['output_throughput']:.1f} tok/s, "
          f"total {m['total_throughput']:.1f} tok/s ({m['completed']} requests, {duration:.2f} s)")
    if args.output_file:
        record = {"bench": "offline", "via": "engine", "commit": git_commit(), "argv": argv,
                  "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "serve_flags": serve_flags, "engine_startup_s": startup_s, "tokenizer": tok.source,
                  "ignore_eos": ignore_eos, "seed": args.seed, "tag": args.tag, "dataset": summary,
                  "realised_output_len": length_stats(out_lens), "length_mismatches": len(mismatches),
                  "metrics": m}
        with open(args.output_file, "a") as f:
            f.write(json.dumps(clean_json(record), default=str) + "\n")
        print(f"appended the results to {args.output_file}")
    return rc
