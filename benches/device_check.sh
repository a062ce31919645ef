#!/usr/bin/env bash
# One device call: install the carried abi3 wheel, then run the phases named on the command line.
#   kernels   kernel tests          gputests  tests/test_gpu.py (model vs HF, graphs, launch-ahead)
#   micro     kernel micro-benchmarks + the skinny-GEMV benchmark
#   sweep     decode attention at serving batch sizes: triton knobs vs FlashInfer
#   profile   benches/diagnostics/profile_decode.py (where a decode step's time goes)
#   fp8prof   benches/diagnostics/profile_decode_kernels.py: S1-sized decode steps (1536 cached tokens a
#             request) by kernel class with roofline floors: bf16 at batch 256, fp8 KV at 411,
#             fp8 weights + KV at 454 (issue 15); stops starting configurations LIMIT - 25 s in;
#             tables in fp8prof/, FP8PROF_ARGS adds flags (e.g. "--configs fp8kv,fp8both
#             --attn-sweep 128x4x2,128x4x3,128x8x2": the attention kernel alone per launch config)
#   ttft      benches/scenarios/ttft_probe.py: S7 TTFT at concurrency 1 (16/128/1024/4096-token prompts),
#             split into client / engine / worker / GPU time (TTFT_ARGS adds probe flags)
#   prefill   benches/diagnostics/profile_prefill.py: one eager prefill step of the 8B config (16 and 1024
#             tokens): host launch vs step time, kernel launches, syncs, top host-time items
#   latency   S2 and S1 full under TOKENSPEED_STEP_TRACE=1: the client's TTFT/ITL beside the
#             server's step intervals (benches/diagnostics/step_intervals.py) and retractions (one H100,
#             ~8 minutes; BENCH_ARGS adds flags)
#   schedlead S2 full at --schedule-lead-ms 0 and each of LEADS (default "2 3"), one server
#             each (~3 min a run): median TTFT against the lead, p99 ITL and GPU idle unchanged?
#   e2e       benches/scenarios/gpu_bench.py (BENCH_ARGS, e.g. "--skip-hf --only S3,S1r --budget-s 320")
#   tp        benches/diagnostics/parallel_check.py --mode tp: Llama-3.1-8B --tp 2 vs --tp 1 through serve:
#             4-layer fp32 tokens (identical), 32-layer bf16 tokens and S3 on each, all-reduce
#             cost (2 GPUs)
#   ep        benches/diagnostics/parallel_check.py --mode ep --checks fp32: EP=2 vs EP=1 greedy tokens,
#             Qwen3-30B-A3B shape, 4 layers fp32, must be identical (2 GPUs)
#   dpgraph   decode CUDA graphs under data-parallel attention (2 GPUs): --mode dpattn (fp32 tokens
#             vs one GPU, identical, plus the server log's graph-replay count), dpattn-eager
#             --checks bf16 (S3 without graphs, the baseline), dense-dpattn --checks fp32
#   a2a       benches/diagnostics/parallel_check.py --mode epa2a, then --mode dpa2a, --checks fp32:
#             --all2all-backend torch_all2all (NCCL all_to_all_single) vs one GPU, greedy tokens
#             must be identical, plain EP and data-parallel attention (2 GPUs)
#   eps3      benches/diagnostics/parallel_check.py --mode ep --checks bf16: the whole 48-layer bf16 model at
#             EP=1 and EP=2, token agreement and S3 on each (2 GPUs)
#   fitests   the FlashInfer backend's GPU tests alone (gputests runs them too)
#   moe       MoE: kernels/tests/test_moe.py and tests/test_gpu_moe.py on the GPU, then
#             kernels/bench/bench_moe.py (fused MoE vs roofline, Qwen3-30B-A3B expert shape)
#   moe_e2e   benches/scenarios/gpu_bench.py --model qwen3-30b-a3b (dummy weights; BENCH_ARGS as for e2e)
#   fp8tests  FP8 kernel tests (kernels/tests/test_fp8_*.py, and test_gemv.py: the GEMV both
#             share) and tests/test_gpu_fp8.py
#   fp8acc    benches/diagnostics/fp8_accuracy.py (fp8 KV / weights / both vs bf16, 4-layer 8B-shaped)
#   fp8micro  kernels/bench/bench_fp8.py (FP8 GEMV, _scaled_mm, Triton vs bf16) and decode/extend
#             attention over an fp8 KV cache (bench_kernels.py --kv-dtype fp8)
#   fp8diag   kernels/bench/diag_fp8_matmul.py (Triton W8A8 matmul: error per shape vs cuBLAS,
#             partial-sum promotion 0/32/128, and its time)
#   fp8gemv   kernels/bench/bench_fp8.py at decode M (1,2,4,8,64): fp8 GEMV with its fp8 tiles vs
#             the bf16 tile, cuBLAS, bf16; whole-step sums
#   fp8sweep  kernels/bench/bench_fp8.py --sweep: the fp8 GEMV config grid (tiles, warps, stages,
#             split-K, PDL) at the Llama-3.1-8B shapes and the fp8 lm_head, M = FP8_SWEEP_MS (default
#             1,2,4,8), timing stops LIMIT - 45 s in; prints us and GB/s per shape and config, the
#             best per shape and gemv.FP8_TILES rows to paste (full table: bench_fp8_sweep.log)
#   dp        benches/scenarios/dp_bench.py: S1 (reduced) with --dp 1 and --dp 2, output tok/s and the ratio
#             (target >= 1.9x; 2 GPUs; DP_ARGS adds flags, e.g. "--full" or "--method shortest_queue")
#   grammar   benches/diagnostics/grammar_bench.py: decode ms/token at batch 1 and 16 with and without a JSON
#             schema (GRAMMAR_ARGS adds flags)
#   fp8w      gpu_bench S3 with --quantization fp8;  fp8kv  S1r with --kv-cache-dtype fp8;
#   fp8both   S1r and S3 with both (each in its own folder; FP8_BENCH_ARGS adds flags, e.g. --full)
# FlashInfer (optional, not on the device image): .carry/fi/ holds the apache-tvm-ffi wheel and
# flashinfer.tar.gz (the flashinfer-python package minus sources its FA2 kernels never compile;
# see "FlashInfer on the device" in benches/RESULTS.md), plus fi_jit.tar.gz, the JIT-compiled
# modules a previous call sent back (FlashInfer compiles on first use, minutes); this call sends
# its own back the same way.
# PHASE_TIMEOUT (seconds, default 600) bounds each phase.
# Usage on the GPU machine (repo root, .carry/ built here: see benches/README.md):
#   bash benches/device_check.sh gputests:200 e2e:330 profile   (name:seconds sets that phase's timeout)
# Each phase logs to a work folder, packed at the end into $OUT/device_check.tar.gz (one file:
# the device tool returns few files); a phase failing does not stop the rest.
set -uo pipefail
FINAL=${OUT:-device_out}
OUT=$(mktemp -d)
mkdir -p "$FINAL"
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws
finish() {
    tar -czf "$FINAL/device_check.tar.gz" -C "$OUT" .
    if [[ -d $FLASHINFER_WORKSPACE_BASE ]]; then
        (cd "$FLASHINFER_WORKSPACE_BASE" && find . -name '*.so' -print0 | tar -czf "$FINAL/fi_jit.tar.gz" --null -T -)
    fi
}
trap finish EXIT
python3 -m pip install -q --no-deps --no-index --upgrade --target /tmp/site .carry/wheel/*.whl
cp /tmp/site/tokenspeed/_core.abi3.so python/tokenspeed/
export PYTHONPATH=$PWD/python
if [[ -d .carry/fi ]]; then
    python3 -m pip install -q --no-deps --no-index --upgrade --target /tmp/fisite .carry/fi/*.whl
    tar -xzf .carry/fi/flashinfer.tar.gz -C /tmp/fisite
    mkdir -p "$FLASHINFER_WORKSPACE_BASE"
    [[ -f .carry/fi/fi_jit.tar.gz ]] && tar -xzf .carry/fi/fi_jit.tar.gz -C "$FLASHINFER_WORKSPACE_BASE"
    export PYTHONPATH=$PYTHONPATH:/tmp/fisite
    python3 -c 'import flashinfer; print("flashinfer", flashinfer.__version__)' 2>&1 | tail -1
    command -v nvcc && nvcc --version | tail -1
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
git log -1 --format='%H %s' 2>/dev/null | tee -a "$OUT/gpu.txt"

phase() {  # name, command...
    local name=$1; shift
    local t0=$SECONDS
    echo "=== $name ==="
    timeout "$LIMIT" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s ==="
    tail -n "${TAIL:-25}" "$OUT/$name.log"
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
    fitests)
        phase fi_tests python3 -m pytest tests/test_gpu.py -q -s -p no:cacheprovider -k flashinfer
        ;;
    micro)
        phase bench_gemv bash -c "cd kernels && PYTHONPATH=. python3 bench/bench_gemv.py"
        phase bench_kernels bash -c "cd kernels && PYTHONPATH=. python3 bench/bench_kernels.py --out $OUT/kernels.jsonl"
        ;;
    sweep)
        phase decode_sweep bash -c "cd kernels && PYTHONPATH=.:$PYTHONPATH python3 bench/bench_decode_sweep.py --out $OUT/decode_sweep.jsonl"
        ;;
    profile)
        phase profile_decode python3 benches/diagnostics/profile_decode.py \
            --tokenizer .carry/llama3/tokenizer.json
        ;;
    fp8prof)
        # shellcheck disable=SC2086
        TAIL=120 phase profile_decode_kernels python3 benches/diagnostics/profile_decode_kernels.py \
            --out "$OUT/fp8prof" --budget-s "$((LIMIT - 25))" ${FP8PROF_ARGS:-}
        ;;
    ttft)
        # shellcheck disable=SC2086
        phase ttft_probe python3 benches/scenarios/ttft_probe.py --tokenizer .carry/llama3/tokenizer.json \
            --out "$OUT/ttft" ${TTFT_ARGS:-}
        ;;
    prefill)
        phase profile_prefill bash -c "python3 benches/diagnostics/profile_prefill.py llama31-8b \
            --device cuda --dtype bfloat16 --tokens 16 && python3 benches/diagnostics/profile_prefill.py llama31-8b \
            --device cuda --dtype bfloat16 --tokens 1024 --top 8"
        ;;
    tp)
        phase tp_check python3 benches/diagnostics/parallel_check.py --mode tp \
            --tokenizer .carry/llama3/tokenizer.json --out "$OUT/tp"
        ;;
    ep)
        phase ep_check python3 benches/diagnostics/parallel_check.py --mode ep \
            --tokenizer .carry/llama3/tokenizer.json --out "$OUT/ep" --checks fp32
        ;;
    dpattn)
        phase dpattn_check python3 benches/diagnostics/parallel_check.py --mode dpattn \
            --tokenizer .carry/llama3/tokenizer.json --out "$OUT/dpattn" --checks fp32
        ;;
    dpgraph)
        phase dpgraph_check python3 benches/diagnostics/parallel_check.py --mode dpattn \
            --tokenizer .carry/llama3/tokenizer.json --out "$OUT/dpgraph"
        phase dpgraph_eager python3 benches/diagnostics/parallel_check.py --mode dpattn-eager --checks bf16 \
            --tokenizer .carry/llama3/tokenizer.json --out "$OUT/dpgraph_eager"
        phase dense_dpattn python3 benches/diagnostics/parallel_check.py --mode dense-dpattn --checks fp32 \
            --tokenizer .carry/llama3/tokenizer.json --out "$OUT/dense_dpattn"
        ;;
    a2a)
        phase epa2a_check python3 benches/diagnostics/parallel_check.py --mode epa2a \
            --tokenizer .carry/llama3/tokenizer.json --out "$OUT/epa2a" --checks fp32
        phase dpa2a_check python3 benches/diagnostics/parallel_check.py --mode dpa2a \
            --tokenizer .carry/llama3/tokenizer.json --out "$OUT/dpa2a" --checks fp32
        ;;
    eps3)
        phase ep_s3 python3 benches/diagnostics/parallel_check.py --mode ep \
            --tokenizer .carry/llama3/tokenizer.json --out "$OUT/eps3" --checks bf16
        ;;
    dp)
        # shellcheck disable=SC2086
        phase dp_bench python3 benches/scenarios/dp_bench.py --tokenizer .carry/llama3/tokenizer.json \
            --out "$OUT/dp" --budget-s "$((LIMIT - 20))" ${DP_ARGS:-}
        ;;
    grammar)
        # shellcheck disable=SC2086
        phase grammar_bench python3 benches/diagnostics/grammar_bench.py \
            --tokenizer .carry/llama3/tokenizer.json --out "$OUT/grammar" ${GRAMMAR_ARGS:-}
        ;;
    latency)
        # shellcheck disable=SC2086
        TOKENSPEED_STEP_TRACE=1 phase latency_bench python3 benches/scenarios/gpu_bench.py \
            --tokenizer .carry/llama3/tokenizer.json --out "$OUT/latency" --skip-hf \
            --only S2r8,S1r --full --budget-s "$((LIMIT - 20))" ${BENCH_ARGS:-}
        ;;
    schedlead)
        for lead in 0 ${LEADS:-2 3}; do
            phase "schedlead_$lead" python3 benches/scenarios/gpu_bench.py \
                --tokenizer .carry/llama3/tokenizer.json --out "$OUT/schedlead_$lead" --skip-hf --only S2r8 --full --budget-s 200 \
                --serve-args "--schedule-lead-ms $lead"
        done
        ;;
    e2e)
        # shellcheck disable=SC2086
        phase gpu_bench python3 benches/scenarios/gpu_bench.py --tokenizer .carry/llama3/tokenizer.json \
            --out "$OUT" ${BENCH_ARGS:-}
        ;;
    moe)
        phase moe_kernel_tests bash -c "cd kernels && PYTHONPATH=. python3 -m pytest tests/test_moe.py -q -x -p no:cacheprovider"
        phase moe_gpu_tests python3 -m pytest tests/test_gpu_moe.py -q -s -p no:cacheprovider
        phase bench_moe bash -c "cd kernels && PYTHONPATH=. python3 bench/bench_moe.py --out $OUT/moe.jsonl"
        ;;
    moe_e2e)
        mkdir -p "$OUT/moe_e2e"
        # shellcheck disable=SC2086
        phase gpu_bench_moe python3 benches/scenarios/gpu_bench.py --model qwen3-30b-a3b \
            --tokenizer .carry/llama3/tokenizer.json --out "$OUT/moe_e2e" ${BENCH_ARGS:-}
        ;;
    fp8tests)
        phase fp8_kernel_tests bash -c "cd kernels && PYTHONPATH=. python3 -m pytest tests/test_fp8_kv.py tests/test_fp8_gemm.py tests/test_gemv.py -q -p no:cacheprovider"
        phase fp8_gpu_tests python3 -m pytest tests/test_gpu_fp8.py -q -s -p no:cacheprovider
        ;;
    fp8diag)
        phase fp8_diag bash -c "cd kernels && PYTHONPATH=.:$PYTHONPATH python3 bench/diag_fp8_matmul.py"
        ;;
    fp8gemv)
        phase bench_fp8_decode bash -c "cd kernels && PYTHONPATH=.:$PYTHONPATH python3 bench/bench_fp8.py --ms 1,2,4,8,64 --out $OUT/fp8_decode.jsonl"
        ;;
    fp8sweep)
        TAIL=45 phase bench_fp8_sweep bash -c "cd kernels && PYTHONPATH=.:$PYTHONPATH python3 bench/bench_fp8.py --sweep \
            --ms ${FP8_SWEEP_MS:-1,2,4,8} --budget-s $((LIMIT - 45)) --out $OUT/fp8_sweep.jsonl"
        ;;
    fp8acc)
        phase fp8_accuracy python3 benches/diagnostics/fp8_accuracy.py --out "$OUT"
        ;;
    fp8micro)
        phase bench_fp8 bash -c "cd kernels && PYTHONPATH=.:$PYTHONPATH python3 bench/bench_fp8.py --out $OUT/fp8.jsonl"
        phase bench_kernels_fp8kv bash -c "cd kernels && PYTHONPATH=. python3 bench/bench_kernels.py --only decode,extend --kv-dtype fp8 --out $OUT/kernels_fp8kv.jsonl"
        ;;
    fp8w|fp8kv|fp8both)
        case $p in
        fp8w) fp8_args=(--only S3 --quantization fp8) ;;
        fp8kv) fp8_args=(--only S1r --kv-cache-dtype fp8) ;;
        *) fp8_args=(--only S3,S1r --quantization fp8 --kv-cache-dtype fp8) ;;
        esac
        mkdir -p "$OUT/$p"
        # shellcheck disable=SC2086
        phase "gpu_bench_$p" python3 benches/scenarios/gpu_bench.py --tokenizer .carry/llama3/tokenizer.json \
            --out "$OUT/$p" --skip-hf --budget-s "$((LIMIT - 20))" "${fp8_args[@]}" ${FP8_BENCH_ARGS:-}
        ;;
    *) echo "unknown phase $p" ;;
    esac
done
