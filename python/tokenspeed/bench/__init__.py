"""`tokenspeed bench`: serve (online, any OpenAI-compatible server), offline (saturation), one-batch."""

from __future__ import annotations

import sys

USAGE = """usage: tokenspeed bench <mode> [args]   (each mode: --help)

modes:
  serve      stream requests to a running server (ours, SGLang, vLLM): TTFT, TPOT, ITL, E2E, throughput
  offline    start `tokenspeed serve` (flags after --), send every prompt at once, report tok/s, stop it
  one-batch  a static batch straight through ModelRunner: prefill and per-step decode latency
"""


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    mode, rest = argv[0], argv[1:]
    if mode == "serve":
        from tokenspeed.bench.serve import main as serve_main

        return serve_main(rest)
    if mode == "offline":
        from tokenspeed.bench.offline import main as offline_main

        return offline_main(rest)
    if mode in ("one-batch", "one_batch"):
        from tokenspeed.bench.one_batch import main as one_batch_main

        return one_batch_main(rest)
    print(f"tokenspeed bench: unknown mode {mode!r}\n\n{USAGE}", file=sys.stderr)
    return 2
