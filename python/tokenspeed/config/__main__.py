"""`python -m tokenspeed.config [serve args]`: resolve the arguments and print the result as
JSON (like `tokenspeed serve --dry-run`), or print the error and exit 2."""

from __future__ import annotations

import sys

from tokenspeed.config.parser import load_serve_config


def main(argv: list[str] | None = None) -> int:
    config = load_serve_config(sys.argv[1:] if argv is None else argv)
    print(config.to_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
