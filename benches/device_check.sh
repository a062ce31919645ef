#!/usr/bin/env bash
# One device call: install the carried abi3 wheel, then run the phases named on the command line.
#   kernels   kernel tests          gputests  tests/test_gpu.py (model vs HF, graphs, launch-ahead)
#   micro     kernel micro-benchmarks + the skinny-GEMV benchmark
#   profile   benches/profile_decode.py (where a decode step's time goes)
#   e2e       benches/gpu_bench.py (BENCH_ARGS, e.g. "--skip-hf --only S3,S1r --budget-s 320")
# PHASE_TIMEOUT (seconds, default 600) bounds each phase.
# Usage on the GPU machine (repo root, .carry/ built here: see benches/RESULTS.md):
#   bash benches/device_check.sh gputests:200 e2e:330 profile   (name:seconds sets that phase's timeout)
# Each phase logs to a work folder, packed at the end into $OUT/device_check.tar.gz (one file:
# the device tool returns few files); a phase failing does not stop the rest.
set -uo pipefail
FINAL=${OUT:-device_out}
OUT=$(mktemp -d)
mkdir -p "$FINAL"
trap 'tar -czf "$FINAL/device_check.tar.gz" -C "$OUT" .' EXIT
python3 -m pip install -q --no-deps --no-index --upgrade --target /tmp/site .carry/wheel/*.whl
cp /tmp/site/tokenspeed/_core.abi3.so python/tokenspeed/
export PYTHONPATH=$PWD/python
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
git log -1 --format='%H %s' 2>/dev/null | tee -a "$OUT/gpu.txt"

phase() {  # name, command...
    local name=$1; shift
    local t0=$SECONDS
    echo "=== $name ==="
    timeout "$LIMIT" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s ==="
    tail -n 25 "$OUT/$name.log"
}

for arg in "$@"; do
    p=${arg%%:*}
    LIMIT=${PHASE_TIMEOUT:-600}
    [[ $arg == *:* ]] && LIMIT=${arg#*:}
    case $p in
    kernels)
        phase kernel_tests bash -c "cd kernels && PYTHONPATH=. python3 -m pytest tests -q -x -p no:cacheprovider"
        ;;
    gputests)
        phase gpu_tests python3 -m pytest tests/test_gpu.py -q -s -p no:cacheprovider
        ;;
    micro)
        phase bench_gemv bash -c "cd kernels && PYTHONPATH=. python3 bench/bench_gemv.py"
        phase bench_kernels bash -c "cd kernels && PYTHONPATH=. python3 bench/bench_kernels.py --out $OUT/kernels.jsonl"
        ;;
    profile)
        phase profile_decode python3 benches/profile_decode.py --tokenizer .carry/llama3/tokenizer.json
        ;;
    e2e)
        # shellcheck disable=SC2086
        phase gpu_bench python3 benches/gpu_bench.py --tokenizer .carry/llama3/tokenizer.json \
            --out "$OUT" ${BENCH_ARGS:-}
        ;;
    *) echo "unknown phase $p" ;;
    esac
done
