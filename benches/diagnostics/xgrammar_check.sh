#!/usr/bin/env bash
# `--grammar-backend xgrammar` on the GPU machine, if xgrammar can be installed there (it is not by
# default and the machine has no network: carry the wheels, e.g. `pip download xgrammar -d wheels`
# for its Python: xgrammar and apache-tvm-ffi, ~15 MB; torch/transformers/triton are already there).
#   bash benches/diagnostics/xgrammar_check.sh [WHEEL_DIR]
# Prints the worker-side matcher tests' result, then grammar_bench.py's table for this backend:
# every constrained output valid ("bad outputs" 0) and the per-token cost of a JSON schema at
# batch 1 and 16 (compare with the llguidance rows in benches/RESULTS.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -n "${1:-}" ]; then python3 -m pip install -q --no-index --find-links "$1" xgrammar; fi
if ! python3 -c "import xgrammar" 2>/dev/null; then
    echo "xgrammar is not importable here: nothing to check"; exit 0
fi
python3 -m pytest -q tests/test_grammar_backend.py
python3 benches/diagnostics/grammar_bench.py --tokenizer .carry/llama3/tokenizer.json --out grammar_xgr_out \
    --serve-args "--grammar-backend xgrammar"
