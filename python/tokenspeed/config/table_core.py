"""Flag table, part 1: model, HTTP/API, dtype, memory and scheduling, runtime, logging, launcher.

Help text is TokenSpeed's own. The first sentence of each help string is reused in the
"not supported yet: --flag (...)" message, so it is kept short and self-contained.
"""

from __future__ import annotations

from tokenspeed.config.derived import (
    KV_TOKENS_PER_RUNNING_REQUEST,
    MAX_DEFAULT_RUNNING_REQUESTS,
    MIN_DEFAULT_RUNNING_REQUESTS,
    RUNNING_REQUESTS_STEP,
)
from tokenspeed.config.flag import (
    G_API,
    G_HTTP,
    G_LAUNCH,
    G_LOGGING,
    G_MEMORY,
    G_MODEL,
    G_QUANT,
    G_RUNTIME,
    Flag,
    b,
    c,
    f,
    i,
    j,
    lst,
    s,
)

# The table is laid out by hand, one flag per few lines.
# fmt: off
DEFAULT_MODEL = "SmolLM2-135M-Instruct"

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

LOAD_FORMATS = (
    "auto", "pt", "safetensors", "npcache", "dummy", "gguf", "bitsandbytes", "layered",
    "sharded_state", "remote", "remote_instance",
)

MODEL_FLAGS: list[Flag] = [
    s("--model-path", "Model to serve: a local directory or a Hugging Face style repo ID. "
      f"It may also be given as the first positional argument. Default: {DEFAULT_MODEL}.",
      G_MODEL, aliases=("--model",), readers=("server", "worker"), implemented=True, metavar="PATH"),
    s("--tokenizer-path", "Where to load the tokenizer from. Default: the model directory.",
      G_MODEL, aliases=("--tokenizer",), implemented=True, metavar="PATH"),
    c("--tokenizer-mode", "Tokenizer flavour: 'auto' prefers a fast tokenizer, 'slow' forces the "
      "pure-Python one.", G_MODEL, ("auto", "slow"), "auto"),
    i("--tokenizer-worker-num", "Number of tokenizer worker processes.", G_MODEL, 1, minimum=1),
    b("--skip-tokenizer-init", "Run without a tokenizer: requests carry token IDs and responses "
      "return token IDs.", G_MODEL),
    c("--load-format", "How weights are read from disk. Available now: auto (detect from the "
      "files), safetensors, gguf, and dummy (random weights, for benchmarking).", G_MODEL,
      LOAD_FORMATS, "auto", supported=("auto", "safetensors", "gguf", "dummy"),
      readers=("worker",), implemented=True, metavar="FORMAT"),
    j("--model-loader-extra-config", "Extra JSON options handed to the weight loader.", G_MODEL,
      readers=("worker",)),
    b("--trust-remote-code", "Accepted for compatibility with vLLM and SGLang recipes. TokenSpeed "
      "never runs Python code shipped inside a model repository, so this switch has no effect.",
      G_MODEL, readers=("worker",), implemented=True),
    i("--context-length", "Longest sequence, prompt plus output, in tokens. Default: the maximum "
      "from the model's config.", G_MODEL, aliases=("--max-model-len",), minimum=1,
      readers=("scheduler", "worker"), implemented=True),
    b("--is-embedding", "Serve an embedding or scoring model: /v1/embeddings, /v1/score, "
      "/v1/rerank and /classify instead of the generating routes (docs/embeddings.md). BERT "
      "encoders and cross-encoders, Llama/Qwen2/Qwen3 decoders used as embedders, and their "
      "*ForSequenceClassification cross-encoders (a converted Qwen3-Reranker).",
      G_MODEL, readers=("server", "worker"), implemented=True),
    b("--enable-multimodal", "Turn on image/video/audio inputs for multimodal models.", G_MODEL,
      readers=("server", "worker")),
    s("--revision", "Model revision to fetch: a branch, tag or commit. TokenSpeed loads "
      "local files only, so only the default is accepted.", G_MODEL, readers=("worker",)),
    c("--model-impl", "Which model implementation to run: TokenSpeed's own or a fallback.",
      G_MODEL, ("auto", "sglang", "transformers"), "auto", readers=("worker",)),
    s("--download-dir", "Directory for downloaded weights. TokenSpeed has no hub download yet.",
      G_MODEL, readers=("worker",), metavar="DIR"),
]

HTTP_FLAGS: list[Flag] = [
    s("--host", "Address the HTTP server binds to. Use 0.0.0.0 to listen on all interfaces.",
      G_HTTP, "127.0.0.1", implemented=True),
    i("--port", "TCP port of the HTTP server.", G_HTTP, 30000, minimum=1, maximum=65535,
      implemented=True),
    b("--skip-server-warmup", "Start serving without first running a warm-up request.", G_HTTP,
      implemented=True),
    s("--warmups", "Comma-separated names of custom warm-up routines to run before serving.",
      G_HTTP),
    i("--nccl-port", "Port for the NCCL rendezvous between workers. Default: a free port.", G_HTTP,
      minimum=1, maximum=65535, readers=("worker",)),
    i("--max-request-body-bytes", "Largest request body accepted; a larger one is refused with "
      "413 before it is read in full.", G_HTTP, 8 << 20, minimum=1, readers=("server",),
      implemented=True, metavar="BYTES"),
    f("--shutdown-timeout", "Seconds in-flight requests get to finish after SIGTERM/SIGINT "
      "(new requests get 503 meanwhile) before they are aborted; 0 aborts them at once "
      "(vLLM's flag).", G_HTTP, 30.0, minimum=0.0, readers=("server",), implemented=True),
]

API_FLAGS: list[Flag] = [
    s("--api-key", "Require this key as a bearer token on every API request.", G_API,
      implemented=True, metavar="KEY"),
    s("--served-model-name", "Model name reported by /v1/models and expected in requests. "
      "Default: the model path.", G_API, implemented=True, metavar="NAME"),
    s("--weight-version", "Free-form version label for the loaded weights, reported by "
      "/get_model_info, /get_weight_version and each /generate response's meta_info (as SGLang "
      "does), so an RL trainer can tell which weights produced a sample.", G_API, "default",
      implemented=True, readers=("server",)),
    s("--chat-template", "Chat template to use instead of the tokenizer's own: a file path or "
      "a built-in template name.", G_API, implemented=True, metavar="TEMPLATE"),
    s("--completion-template", "Template for code-completion (fill-in-the-middle) prompts.",
      G_API),
    b("--enable-cache-report", "Report the number of prefix-cached prompt tokens in each "
      "response's usage block.", G_API),
    c("--reasoning-parser", "Parser that separates reasoning text (think tags; deepseek-v3: "
      "only with chat_template_kwargs thinking true; kimi: the model's optional "
      "\u25c1think\u25b7 block; gpt-oss: harmony's analysis channel) from the final answer: "
      "message.reasoning_content and delta.reasoning_content. deepseek_v3 and openai_gptoss are "
      "vLLM's names.", G_API,
      ("deepseek-r1", "deepseek-v3", "deepseek_v3", "glm45", "gpt-oss", "openai_gptoss", "kimi",
       "qwen3", "qwen3-thinking", "step3"),
      supported=("deepseek-r1", "deepseek-v3", "deepseek_v3", "kimi", "qwen3", "qwen3-thinking",
                 "gpt-oss", "openai_gptoss"),
      implemented=True),
    c("--tool-call-parser", "Parser that extracts OpenAI-style tool calls from model output "
      "(hermes: Qwen2.5/Qwen3; llama3_json; mistral; pythonic; deepseekv3: DeepSeek-V3/R1; "
      "deepseekv31: DeepSeek-V3.1; kimi_k2: Kimi-K2; gpt-oss: GPT-OSS's harmony format). "
      "deepseek_v3, deepseek_v31 and openai are vLLM's names.", G_API,
      ("hermes", "qwen25", "qwen3", "llama3", "llama3_json", "llama4_json", "mistral",
       "pythonic", "llama4_pythonic", "deepseekv3", "deepseek_v3", "deepseekv31", "deepseek_v31",
       "glm45", "kimi_k2", "gpt-oss", "openai", "step3"),
      supported=("hermes", "qwen25", "qwen3", "llama3", "llama3_json", "llama4_json",
                 "mistral", "pythonic", "llama4_pythonic", "deepseekv3", "deepseek_v3",
                 "deepseekv31", "deepseek_v31", "kimi_k2", "gpt-oss", "openai"),
      implemented=True),
    b("--enable-auto-tool-choice", "Let the model decide when to call tools (tool_choice "
      "\"auto\"); needs --tool-call-parser. Accepted as vLLM spells it.", G_API,
      implemented=True),
    c("--sampling-defaults", "Where default sampling parameters come from: the model's "
      "generation config or OpenAI's defaults.", G_API, ("openai", "model"), "model",
      implemented=True),
    i("--max-logprobs", "Most logprobs a request may ask for per token (logprobs, "
      "top_logprobs, prompt_logprobs, top_logprobs_num); more is a 400 naming the cap, as in "
      "vLLM. -1: no cap, the whole vocabulary; a request's -1 (all) needs a cap that covers the "
      "vocabulary. Each step's result slot in shared memory holds this many per token for every "
      "token of the step, so a vocabulary-sized cap needs a small --chunked-prefill-size and "
      "--max-running-requests (checked at start).", G_API, 20, minimum=0, allowed_special=(-1,),
      readers=("server", "launch"), implemented=True, metavar="N"),
    s("--tool-server", "Tool server(s) to attach for built-in tool use.", G_API),
    b("--return-token-ids", "Include token IDs in every response.", G_API),
    s("--file-storage-pth", "Directory for files uploaded through the API.", G_API),
]

QUANT_FLAGS: list[Flag] = [
    c("--dtype", "Precision of weights and activations. 'auto' lets the worker follow the "
      "checkpoint's dtype. 'half' and 'float' are accepted as float16 and float32.", G_QUANT, ("auto", "float16", "bfloat16", "float32"), "auto",
      value_aliases={"half": "float16", "float": "float32"}, readers=("worker",),
      implemented=True),
    s("--quantization", "Weight quantization method. Available now: fp8 (per-channel FP8 weights, "
      "per-token FP8 activations; a bf16/fp16/fp32 checkpoint is quantised while loading). FP8 "
      "checkpoints (compressed-tensors, ModelOpt, per-tensor fp8, and DeepSeek-V3's block-wise fp8 "
      "with 128x128 weight scales, kept fp8 in memory) are detected from config.json without it; other "
      "methods (awq, gptq, bitsandbytes, ...) fail at start.", G_QUANT, readers=("worker",),
      implemented=True, metavar="METHOD"),
    c("--lm-head-quantization", "Precision of the LM head's weights under FP8 weight "
      "quantization. 'auto': FP8 when --quantization fp8 quantises the checkpoint (the head is "
      "the largest read of a batch-1 decode step), as the checkpoint has it for FP8 checkpoints "
      "(FP8 when it ships lm_head.weight_scale); 'fp8': always FP8 (needs FP8 weights); 'none': "
      "the model dtype, as vLLM does (an FP8 head is dequantised once loaded). A tied head "
      "gets its own FP8 copy; the embedding keeps the model dtype.", G_QUANT,
      ("auto", "fp8", "none"), "auto", readers=("worker",), implemented=True),
    s("--quantization-param-path", "JSON file with per-layer scaling factors for an FP8 KV "
      "cache, in vLLM's kv_cache_scales layout ({\"kv_cache\": {\"scaling_factor\": {tp_rank: "
      "{layer: scale}}}}). Default: the checkpoint's k_scale/v_scale tensors, else 1.0.", G_QUANT,
      readers=("worker",), implemented=True, metavar="PATH"),
    s("--modelopt-quant", "Quantize with NVIDIA ModelOpt using this scheme at load time.",
      G_QUANT, readers=("worker",)),
    s("--modelopt-checkpoint-restore-path", "Load an already ModelOpt-quantized checkpoint from "
      "here.", G_QUANT, readers=("worker",), metavar="PATH"),
    s("--modelopt-checkpoint-save-path", "Save the ModelOpt-quantized model here.", G_QUANT,
      readers=("worker",), metavar="PATH"),
    c("--kv-cache-dtype", "Storage type of the KV cache. 'auto' uses the model dtype; 'fp8' "
      "(= fp8_e4m3) and fp8_e5m2 store 8-bit floats with per-layer scales (see "
      "--quantization-param-path), so the same memory holds twice the tokens of bfloat16.",
      G_QUANT, ("auto", "fp8", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16"), "auto",
      readers=("worker",), implemented=True),
    b("--enable-fp32-lm-head", "Compute the output logits in float32.", G_QUANT,
      readers=("worker",)),
    s("--torchao-config", "Quantize with torchao using this recipe (int8dq, int4wo-128, ...).",
      G_QUANT, readers=("worker",)),
]

MEMORY_FLAGS: list[Flag] = [
    f("--mem-fraction-static", "Fraction of GPU memory TokenSpeed may take for weights plus KV "
      "cache, between 0 and 1. Default: chosen from the GPU size.", G_MEMORY,
      aliases=("--gpu-memory-utilization",), minimum=0.0, min_exclusive=True, maximum=1.0,
      readers=("worker",), implemented=True, metavar="FRACTION"),
    i("--max-running-requests", "Most requests decoded at the same time. Default: derived from the "
      f"KV pool, its tokens / {KV_TOKENS_PER_RUNNING_REQUEST} (or / the context length when "
      f"shorter), rounded down to a multiple of {RUNNING_REQUESTS_STEP}, within "
      f"[{MIN_DEFAULT_RUNNING_REQUESTS}, {MAX_DEFAULT_RUNNING_REQUESTS}]: 256 for Llama-3.1-8B on "
      "an H100, 512 with --kv-cache-dtype fp8 (twice the tokens); /get_server_info reports it. "
      "Slots and plans are sized for the upper bound before the pool is known.", G_MEMORY,
      aliases=("--max-num-seqs",), minimum=1, readers=("scheduler", "worker"), implemented=True),
    i("--prefill-max-requests", "Most new requests admitted in one prefill batch.", G_MEMORY,
      minimum=1),
    i("--max-queued-requests", "Most requests allowed to wait in the queue; more are rejected "
      "(429). With --enable-priority-scheduling a new request more urgent than the least urgent "
      "waiting one takes its place instead, and that one gets the 429 (SGLang's rule). "
      "Bounded by default (SGLang's is unbounded) so that a burst cannot grow memory without "
      "limit.", G_MEMORY, 4096, minimum=1, readers=("server",), implemented=True),
    i("--max-total-tokens", "Size of the KV cache pool in tokens, overriding the size worked out "
      "from --mem-fraction-static. Mostly for testing.", G_MEMORY, minimum=1, readers=("launch",),
      implemented=True),
    i("--chunked-prefill-size", "Token budget of one scheduler iteration: long prompts are "
      "prefilled in chunks of at most this many tokens. vLLM's --max-num-batched-tokens maps "
      "here. The value -1 (no chunking) is not available yet.", G_MEMORY, 8192,
      aliases=("--max-num-batched-tokens",), minimum=1, allowed_special=(-1,),
      unsupported_values=(-1,), implemented=True, readers=("scheduler", "worker")),
    i("--max-prefill-tokens", "Most prompt tokens in one prefill batch; a single prompt longer "
      "than this still runs alone.", G_MEMORY, 16384, minimum=1, implemented=True, readers=("scheduler",)),
    i("--max-mixed-prefill-tokens", "Most prompt tokens in a step that also carries decodes (0: "
      "no cap beyond --chunked-prefill-size). Running streams wait for the whole step, so the "
      "cap spreads a wave of prompts over more, shorter steps. Like vLLM's long-prefill "
      "threshold and SGLang's mixed chunk. The default, 1024, measured on an H100 (Llama-3.1-8B, "
      "2000 prompts at once): p99 inter-token gap 203 -> 63 ms, throughput +1.9% over no cap.",
      G_MEMORY, 1024, minimum=0, implemented=True, readers=("scheduler",)),
    f("--max-mixed-step-ms", "Run time a step that also carries decodes is planned to stay "
      "within (0: off). The engine learns from measured step times what the running decodes "
      "take and what each prompt token adds, and gives a mixed step only the prompt tokens "
      "that fit (at least 256, at most --max-mixed-prefill-tokens): a few decodes leave room "
      "for a whole prompt, hundreds of long-context ones for a shorter chunk. Bounds the gap "
      "between tokens under heavy load where a token cap cannot tell the two apart. Applies "
      "only while the batch is full: while a request waits and a slot and the KV pool have "
      "room for it, a mixed step takes up to --max-mixed-prefill-tokens, since a full batch "
      "of B requests needs B x prompt/output length prompt tokens a step to refill (S1: "
      "400-500 with an fp8 cache, above the 256 floor) and a batch that cannot refill costs "
      "more than a longer gap. The default, 40, measured on an H100 (Llama-3.1-8B, 2000 "
      "prompts at once): p99 step interval 46.0 -> 40.8 ms; 1024-token prompts at 8 req/s "
      "unchanged (their mixed steps take ~27 ms).",
      G_MEMORY, 40.0, minimum=0.0, readers=("scheduler",), implemented=True),
    f("--schedule-lead-ms", "With overlap scheduling, plan the next step this many ms before "
      "the running decode step is expected to end (the shortest recent decode step), not as "
      "soon as it starts, so requests that arrive meanwhile join it: up to one decode step "
      "less time to first token. It must cover the worker's launch of a step, or the GPU "
      "waits. 0: plan at once. The default, 2, measured on an H100 (Llama-3.1-8B, 1024-token "
      "prompts at 8 req/s): median TTFT 44.4 -> 39.0 ms, inter-token gaps, batch-1 decode and "
      "saturated throughput unchanged.", G_MEMORY, 2.0, minimum=0.0, readers=("server",),
      implemented=True),
    c("--schedule-policy", "Order in which waiting requests are admitted: fcfs (arrival order) "
      "or lpm (longest cached prefix first).", G_MEMORY,
      ("fcfs", "lpm", "random", "dfs-weight", "lof"), "fcfs", supported=("fcfs", "lpm"),
      implemented=True, readers=("scheduler",)),
    b("--enable-priority-scheduling", "Admit waiting requests by their `priority` request field "
      "(an integer, default 0) first; --schedule-policy orders requests of equal priority. "
      "Without it a non-zero `priority` is refused (400).", G_MEMORY, implemented=True,
      readers=("scheduler",)),
    b("--schedule-low-priority-values-first", "With priority scheduling, treat smaller priority "
      "numbers as more urgent (vLLM's convention); by default larger ones are (SGLang's).",
      G_MEMORY, implemented=True, readers=("scheduler",)),
    i("--priority-scheduling-preemption-threshold", "With priority scheduling, a waiting "
      "request that finds no slot or KV room retracts running requests whose priority it beats "
      "by more than this (least urgent first, latest admitted first within a priority); their "
      "KV stays in the prefix cache and they resume with the tokens they generated (SGLang's "
      "rule). Needs --enable-priority-scheduling when changed.", G_MEMORY, 10, minimum=0,
      implemented=True, readers=("scheduler",)),
    f("--schedule-conservativeness", "How cautiously the scheduler admits requests; larger means "
      "fewer retractions.", G_MEMORY, 1.0, minimum=0.0),
    i("--page-size", "Tokens per KV cache page (block). Default 16; note SGLang defaults to 1.",
      G_MEMORY, 16, aliases=("--block-size",), minimum=1, readers=("scheduler", "worker"), implemented=True),
    f("--hybrid-kvcache-ratio", "Split between uniform and hybrid KV buffers for models mixing "
      "sliding-window and full attention, from 0 to 1.", G_MEMORY, minimum=0.0, maximum=1.0),
    f("--swa-full-tokens-ratio", "KV tokens of the sliding-window layers' own pool relative to "
      "the full layers' pool (SGLang's meaning), for models mixing both (Gemma 3, GPT-OSS): "
      "given, it turns the hybrid layout on, in which requests give back the sliding pages "
      "that left their window; unset, every layer keeps full-context pages (SGLang's default "
      "is 0.8 and on). The hybrid layout turns prefix caching off and needs "
      "--disable-cuda-graph on a GPU (docs/models.md).", G_MEMORY, minimum=0.0,
      min_exclusive=True, maximum=1.0, implemented=True, readers=("worker",)),
    b("--disable-hybrid-swa-memory", "Use one KV layout for sliding-window and full layers "
      "(the default unless --swa-full-tokens-ratio is given).", G_MEMORY, implemented=True,
      readers=("worker",)),
    b("--disable-radix-cache", "Turn off prefix caching, the reuse of KV cache between "
      "requests that share a prompt prefix. vLLM's --no-enable-prefix-caching does the same; "
      "--enable-prefix-caching keeps it on.", G_MEMORY, aliases=("--no-enable-prefix-caching",),
      negated=("--enable-prefix-caching",), implemented=True, readers=("scheduler",)),
    b("--prefill-only-one-req", "Put at most one request in each prefill batch. Takes a value: "
      "true or false.", G_MEMORY, takes_value=True),
]

RUNTIME_FLAGS: list[Flag] = [
    c("--device", "Where the model runs. 'auto' picks CUDA when a GPU is visible, else CPU.",
      G_RUNTIME, ("auto", "cuda", "cpu", "xpu", "hpu", "npu", "mps"), "auto",
      supported=("auto", "cuda", "cpu"), readers=("worker",), implemented=True),
    i("--stream-interval", "Send streamed output every this many tokens.", G_RUNTIME, 1,
      minimum=1),
    b("--stream-output", "Stream output as disjoint segments instead of cumulative text.",
      G_RUNTIME),
    i("--random-seed", "Seed for all random number generators, for reproducible sampling.",
      G_RUNTIME, aliases=("--seed",), minimum=0, readers=("worker",), implemented=True),
    # The default bounds whitespace (one space, or a newline and an indent): with any amount
    # allowed, as by default in SGLang and vLLM, small models loop on whitespace until max_tokens.
    s("--constrained-json-whitespace-pattern", "Regex of whitespace allowed between tokens of "
      "JSON-constrained output; 'any' allows any run of whitespace.", G_RUNTIME,
      r"( |\n[ \t]{0,16})", implemented=True, metavar="REGEX", readers=("launch",)),
    b("--constrained-json-disable-any-whitespace", "Force compact JSON in JSON-constrained "
      "output.", G_RUNTIME, implemented=True, readers=("launch",)),
    # Undeclared properties are refused by default, as in vLLM and SGLang (xgrammar's default):
    # allowed, a small model keeps inventing properties until max_tokens.
    b("--constrained-json-allow-additional-properties", "In JSON-constrained output (schemas "
      "of response_format, tools, guided_json), allow properties a schema does not declare when "
      "it leaves additionalProperties unspecified. Default: not allowed.", G_RUNTIME,
      implemented=True, readers=("server",)),
    f("--watchdog-timeout", "Abort the server when one forward step takes longer than this many "
      "seconds.", G_RUNTIME, 300.0, minimum=0.0, min_exclusive=True, readers=("server",),
      implemented=True),
    f("--soft-watchdog-timeout", "Dump debugging state when one forward step takes longer than "
      "this many seconds.", G_RUNTIME, 300.0, minimum=0.0, min_exclusive=True, readers=("server", "worker")),
    i("--dist-timeout", "Seconds a rank waits for the others, to form the process group and in "
      "any collective, before it fails naming itself.", G_RUNTIME, 300, minimum=1,
      readers=("worker",), implemented=True),
    i("--base-gpu-id", "First GPU index to use, for running several servers on one machine.",
      G_RUNTIME, 0, minimum=0, readers=("worker",)),
    i("--gpu-id-step", "Stride between the GPU indices used by consecutive workers.", G_RUNTIME,
      1, minimum=1, readers=("worker",)),
    b("--sleep-on-idle", "Lower CPU use while no requests are running.", G_RUNTIME),
    j("--mm-process-config", "JSON options for multimodal preprocessing (image, video, audio).",
      G_RUNTIME),
]

LOGGING_FLAGS: list[Flag] = [
    c("--log-level", "Verbosity of all logs.", G_LOGGING, LOG_LEVELS, "info", casefold=True,
      readers=("launch", "worker"), implemented=True),
    c("--log-level-http", "Verbosity of the HTTP access log. Default: same as --log-level.",
      G_LOGGING, LOG_LEVELS, casefold=True),
    b("--log-requests", "Log every request and its response.", G_LOGGING, implemented=True),
    c("--log-requests-level", "How much of each request --log-requests writes, from 0 "
      "(metadata) to 3 (full input and output).", G_LOGGING, (0, 1, 2, 3), 2),
    s("--crash-dump-folder", "Folder for a dump of recent requests when the server crashes.",
      G_LOGGING, metavar="DIR"),
    b("--crash-on-nan", "Stop the server when a NaN log-probability appears.", G_LOGGING),
    b("--show-time-cost", "Log the time spent in instrumented code sections.", G_LOGGING),
    b("--enable-metrics", "Expose Prometheus metrics at /metrics.", G_LOGGING, implemented=True),
    b("--enable-metrics-for-all-schedulers", "Record request metrics on every tensor-parallel "
      "rank, not only rank 0.", G_LOGGING),
    s("--tokenizer-metrics-custom-labels-header", "HTTP header carrying custom metric labels.",
      G_LOGGING, "x-custom-labels"),
    lst("--tokenizer-metrics-allowed-custom-labels", "Custom metric label names that requests "
        "may set.", G_LOGGING),
    lst("--bucket-time-to-first-token", "Histogram buckets (seconds) for time to first token.",
        G_LOGGING, item="float"),
    lst("--bucket-inter-token-latency", "Histogram buckets (seconds) for inter-token latency.",
        G_LOGGING, item="float"),
    lst("--bucket-e2e-request-latency", "Histogram buckets (seconds) for end-to-end latency.",
        G_LOGGING, item="float"),
    b("--collect-tokens-histogram", "Record histograms of prompt and generated token counts.",
      G_LOGGING),
    lst("--prompt-tokens-buckets", "Bucket rule for the prompt-token histogram.", G_LOGGING),
    lst("--generation-tokens-buckets", "Bucket rule for the generated-token histogram.",
        G_LOGGING),
    f("--gc-warning-threshold-secs", "Warn when a Python garbage collection pause is longer "
      "than this; 0 turns the warning off.", G_LOGGING, 0.0, minimum=0.0),
    i("--decode-log-interval", "Write a decode progress line every this many steps.", G_LOGGING,
      40, minimum=1, readers=("server",), implemented=True),
    b("--enable-request-time-stats-logging", "Log per-request timing breakdowns.", G_LOGGING),
    j("--kv-events-config", "Publish the prefix cache's KV events (block stored / removed / "
      "all cleared) over ZMQ for cache-aware routers (llm-d, NVIDIA Dynamo, SGLang's router), "
      'in vLLM\'s and SGLang\'s format: {"publisher": "zmq", "endpoint": "tcp://*:5557", '
      '"topic": "", "replay_endpoint": null, "buffer_steps": 10000, "max_queue_size": 100000}. '
      "With --dp N, replica r publishes on the endpoint's port + r (docs/kv_events.md).",
      G_LOGGING, readers=("server",), implemented=True),
    b("--enable-trace", "Export OpenTelemetry traces: per request, spans for HTTP, tokenize, "
      "queue, each prefill chunk, decode and detokenize, under the request's W3C traceparent, "
      "sent over OTLP/HTTP to --otlp-traces-endpoint (docs/deployment.md#tracing).", G_LOGGING,
      readers=("server",), implemented=True),
    s("--otlp-traces-endpoint", "OpenTelemetry collector for --enable-trace: host:port or an "
      "http:// URL, spans POSTed as OTLP/HTTP protobuf to its /v1/traces (4318 is a "
      "collector's OTLP/HTTP port; gRPC is not supported yet). Given without --enable-trace "
      "(vLLM's usage), it turns tracing on.", G_LOGGING, "localhost:4318",
      aliases=("--oltp-traces-endpoint",), readers=("server",), implemented=True, metavar="URL"),
]

LAUNCH_FLAGS: list[Flag] = [
    s("--config", "Read flags from this YAML file. Keys are flag names without the leading "
      "dashes, in any accepted spelling; flags on the command line win over the file.",
      G_LAUNCH, readers=("launch",), implemented=True, metavar="FILE", dest="config_file"),
    b("--dry-run", "Print the resolved configuration as JSON and exit without serving.",
      G_LAUNCH, readers=("launch",), implemented=True),
]

CORE_FLAGS: list[Flag] = [
    *MODEL_FLAGS,
    *HTTP_FLAGS,
    *API_FLAGS,
    *QUANT_FLAGS,
    *MEMORY_FLAGS,
    *RUNTIME_FLAGS,
    *LOGGING_FLAGS,
    *LAUNCH_FLAGS,
]
# fmt: on
