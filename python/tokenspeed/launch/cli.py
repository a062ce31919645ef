"""The `tokenspeed` command: serve, bench, router, env, version."""

from __future__ import annotations

import json
import logging
import platform
import sys


def _serve(argv: list[str]) -> int:
    from tokenspeed.config import ConfigError, NotSupportedError, parse_serve_args

    try:
        cfg = parse_serve_args(argv)
    except (ConfigError, NotSupportedError) as e:
        print(f"tokenspeed serve: {e}", file=sys.stderr)
        return 2
    if cfg.dry_run:
        print(cfg.to_json())
        return 0
    logging.basicConfig(level=(cfg.log_level or "info").upper(), format="%(asctime)s %(levelname)s %(message)s")
    from tokenspeed.launch.serve import LaunchError, launch

    try:
        return launch(cfg)
    except LaunchError as e:
        print(f"tokenspeed serve: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def _env() -> int:
    info: dict[str, object] = {"python": sys.version.split()[0], "platform": platform.platform()}
    try:
        import torch

        info.update(torch=torch.__version__, cuda=torch.cuda.is_available())
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        info["torch"] = None
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    from tokenspeed import __version__, _core

    info.update(tokenspeed=__version__, core=_core.__version__)
    print(json.dumps(info, indent=2))
    return 0


USAGE = """usage: tokenspeed <command> [args]

commands:
  serve [MODEL] [flags]   serve a model over an OpenAI-compatible HTTP API (--help for flags)
  bench ...               benchmarks (serve | one-batch | offline)
  router --pd ...         route requests to a prefill/decode server pair (--help)
  env                     print versions of TokenSpeed, torch, triton, CUDA
  version                 print the TokenSpeed version
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    cmd, rest = args[0], args[1:]
    if cmd == "serve":
        return _serve(rest)
    if cmd == "bench":
        from tokenspeed.bench import main as bench_main

        return bench_main(rest)
    if cmd == "router":
        from tokenspeed.launch.pd_router import main as router_main

        return router_main(rest)
    if cmd == "env":
        return _env()
    if cmd == "version":
        from tokenspeed import __version__

        print(__version__)
        return 0
    print(f"tokenspeed: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
