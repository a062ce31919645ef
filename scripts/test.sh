#!/usr/bin/env bash
# The whole test suite: Rust (lint + unit/property tests) then Python (numerics, kernels
# under the Triton interpreter, end-to-end through the real server and the openai client).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export TOKENSPEED_TEST_ASSETS="${TOKENSPEED_TEST_ASSETS:-$("$PY" -m tokenspeed.launch.assets test-assets | tail -n1)}"

echo "== rust: fmt, clippy, tests =="
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -q -- -D warnings
cargo test --workspace -q

echo "== python: ruff, pytest =="
"$PY" -m ruff check python tests kernels benches conftest.py
# Tests import the installed package (pip install .), not the source tree.
"$PY" -m pytest -q -p no:cacheprovider "$@"
