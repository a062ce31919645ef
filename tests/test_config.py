"""`tokenspeed serve` argument resolution: aliases, conflicts, YAML config, bad values,
--help groups, --dry-run, and the ServeConfig split between server and worker."""

from __future__ import annotations

import ast
import itertools
import json
from dataclasses import fields
from pathlib import Path

import pytest

from tokenspeed.config import (
    BY_DEST,
    FLAGS,
    GROUPS,
    ConfigError,
    NotSupportedError,
    ServeConfig,
    build_serve_parser,
    counts,
    load_serve_config,
    parse_serve_args,
)

# ---- aliases ------------------------------------------------------------------------------

ALIASES = [
    # (spellings, value words, attribute, expected)
    (["--max-model-len", "--context-length"], ["4096"], "context_length", 4096),
    (["--gpu-memory-utilization", "--mem-fraction-static"], ["0.7"], "mem_fraction_static", 0.7),
    (["--max-num-seqs", "--max-running-requests"], ["64"], "max_running_requests", 64),
    (["--block-size", "--page-size"], ["32"], "page_size", 32),
    (["--enforce-eager", "--disable-cuda-graph"], [], "disable_cuda_graph", True),
    (["--no-enable-prefix-caching", "--disable-radix-cache"], [], "disable_radix_cache", True),
    (["--enable-prefix-caching"], [], "disable_radix_cache", False),
    (["--disable-overlap-schedule"], [], "disable_overlap_schedule", True),
    (["--tensor-parallel-size", "--tp", "--tp-size", "--attn-tp-size"], ["1"], "tp_size", 1),
    (["--model", "--model-path"], ["org/some-model"], "model_path", "org/some-model"),
    (["--max-num-batched-tokens", "--chunked-prefill-size"], ["2048"], "chunked_prefill_size", 2048),
    (["--tokenizer", "--tokenizer-path"], ["/tok"], "tokenizer_path", "/tok"),
    (["--seed", "--random-seed"], ["7"], "random_seed", 7),
    (["--max-cudagraph-capture-size", "--cuda-graph-max-bs"], ["48"], "cuda_graph_max_bs", 48),
]  # fmt: skip


@pytest.mark.parametrize(("spellings", "words", "attr", "expected"), ALIASES)
def test_alias_resolves_to_one_setting(spellings: list[str], words: list[str], attr: str, expected) -> None:
    for spelling in spellings:
        cfg = parse_serve_args([spelling, *words])
        assert getattr(cfg, attr) == expected, spelling


def test_tracing_is_off_by_default_and_either_spelling_of_the_endpoint_turns_it_on(tmp_path: Path) -> None:
    off = parse_serve_args([])
    assert (off.enable_trace, off.otlp_traces_endpoint) == (False, "localhost:4318")
    assert parse_serve_args(["--enable-trace"]).enable_trace
    for spelling in ("--otlp-traces-endpoint", "--oltp-traces-endpoint"):  # vLLM's, SGLang's
        cfg = parse_serve_args([spelling, "collector:4318"])
        assert (cfg.enable_trace, cfg.otlp_traces_endpoint) == (True, "collector:4318"), spelling
    config = tmp_path / "serve.yaml"  # an explicit off wins over the endpoint
    config.write_text("enable-trace: false\notlp-traces-endpoint: collector:4318\n")
    assert not parse_serve_args(["--config", str(config)]).enable_trace
    for endpoint in ("https://collector:4318", "grpc://collector:4317"):  # before any worker loads
        with pytest.raises(NotSupportedError, match="not supported yet: --otlp-traces-endpoint"):
            parse_serve_args(["--enable-trace", "--otlp-traces-endpoint", endpoint])
    assert parse_serve_args(["--otlp-traces-endpoint", "http://c:4318"]).enable_trace


def test_positional_model() -> None:
    assert parse_serve_args(["org/m"]).model_path == "org/m"
    assert parse_serve_args(["--port", "1234", "org/m", "--seed", "1"]).model_path == "org/m"
    assert parse_serve_args([]).model_path is None  # the default model


def test_default_values() -> None:
    cfg = parse_serve_args([])
    assert (cfg.host, cfg.port, cfg.page_size, cfg.chunked_prefill_size) == ("127.0.0.1", 30000, 16, 8192)
    assert cfg.tp_size == 1 and cfg.schedule_policy == "fcfs" and cfg.device == "auto"
    assert cfg.dtype == "auto" and cfg.load_format == "auto" and not cfg.disable_radix_cache


@pytest.mark.parametrize("spelling", ["--dp-size", "--data-parallel-size", "--dp"])
def test_data_parallel_sizes_parse(spelling: str) -> None:
    cfg = parse_serve_args([spelling, "2", "--load-balance-method", "cache_aware"])
    assert (cfg.dp_size, cfg.load_balance_method) == (2, "cache_aware")
    assert parse_serve_args([]).load_balance_method == "round_robin"  # SGLang's default


def test_hicache_flags_parse_and_unbuilt_values_are_refused() -> None:
    cfg = parse_serve_args(["--enable-hierarchical-cache", "--hicache-ratio", "3",
                            "--hicache-write-policy", "write_back", "--radix-eviction-policy", "lfu"])
    assert (cfg.enable_hierarchical_cache, cfg.hicache_ratio) == (True, 3.0)
    assert (cfg.hicache_write_policy, cfg.radix_eviction_policy) == ("write_back", "lfu")
    off = parse_serve_args([])
    assert (off.enable_hierarchical_cache, off.hicache_write_policy) == (False, "write_through")
    with pytest.raises(NotSupportedError, match="write_through_selective.*use write_through or write_back"):
        parse_serve_args(["--enable-hierarchical-cache", "--hicache-write-policy", "write_through_selective"])
    for flag, value in [("--hicache-io-backend", "direct"), ("--hicache-mem-layout", "page_first")]:
        with pytest.raises(NotSupportedError, match=f"not supported yet: {flag}"):
            parse_serve_args(["--enable-hierarchical-cache", flag, value])
    # The storage tier: the local-file backend is built, the others are refused by name.
    cfg = parse_serve_args(["--enable-hierarchical-cache", "--hicache-storage-backend", "file"])
    assert cfg.hicache_storage_backend == "file"
    with pytest.raises(NotSupportedError, match="mooncake.*only the local-file storage backend"):
        parse_serve_args(["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake"])
    # The neutral values are accepted.
    parse_serve_args(["--hicache-io-backend", "kernel", "--hicache-mem-layout", "layer_first"])


def test_load_balance_methods_not_built_are_refused_by_name() -> None:
    with pytest.raises(NotSupportedError, match="--load-balance-method .*'minimum_tokens'"):
        parse_serve_args(["--dp", "2", "--load-balance-method", "minimum_tokens"])


@pytest.mark.parametrize("spelling", ["--ep-size", "--expert-parallel-size", "--ep"])
def test_expert_parallel_sizes_parse(spelling: str) -> None:
    cfg = parse_serve_args(["--tp", "4", spelling, "2"])
    assert (cfg.tp_size, cfg.ep_size, cfg.enable_expert_parallel) == (4, 2, False)
    cfg = parse_serve_args(["--tp", "2", "--enable-expert-parallel"])
    assert cfg.enable_expert_parallel and cfg.all2all_backend == "naive"
    cfg = parse_serve_args(["--tp", "2", "--ep-size", "2", "--all2all-backend", "torch_all2all"])
    assert cfg.all2all_backend == "torch_all2all" and cfg.worker_dict()["all2all_backend"] == \
        "torch_all2all"


@pytest.mark.parametrize("backend", ["pplx", "deepep_high_throughput", "deepep_low_latency",
                                     "flashinfer_all2allv"])
def test_all2all_backends_not_built_are_refused_by_name(backend: str) -> None:
    with pytest.raises(NotSupportedError, match=f"--all2all-backend .*'{backend}' is not built into "
                       "TokenSpeed: .* Instead, use --all2all-backend allgather_reducescatter"):
        parse_serve_args(["--tp", "2", "--ep-size", "2", "--all2all-backend", backend])
    with pytest.raises(ConfigError, match="invalid choice 'bogus'"):
        parse_serve_args(["--all2all-backend", "bogus"])


def test_parallel_sizes_of_one_are_fine() -> None:
    parse_serve_args(["--expert-parallel-size", "1", "--dp-size", "1", "--nnodes", "1", "--node-rank", "0"])


@pytest.mark.parametrize("spelling", ["--tensor-parallel-size", "--tp", "--tp-size", "--attn-tp-size"])
def test_tensor_parallel_sizes_parse(spelling: str) -> None:
    cfg = parse_serve_args([spelling, "4", "--dense-tp-size", "2", "--world-size", "4", "--nprocs-per-node", "4"])
    assert (cfg.tp_size, cfg.dense_tp_size, cfg.world_size, cfg.nprocs_per_node) == (4, 2, 4, 4)


@pytest.mark.parametrize("flag", [f for f in FLAGS if f.aliases], ids=lambda f: f.name)
def test_every_alias_maps_to_its_flag(flag) -> None:
    for a, b in itertools.combinations((flag.name, *flag.aliases), 2):
        with pytest.raises(ConfigError, match="conflicting flags") as info:
            parse_serve_args(_words(flag, a) + _words(flag, b))
        assert a in str(info.value) and b in str(info.value)


def _words(flag, spelling: str) -> list[str]:
    if flag.kind == "bool":
        return [spelling]
    default = flag.default if flag.default is not None else (1 if flag.kind in ("int", "float") else "x")
    return [spelling, str(default) if flag.kind != "json" else "{}"]


# ---- conflicts --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["--tensor-parallel-size", "1", "--attn-tp-size", "1"],
        ["--tp", "1", "--tp-size", "1"],
        ["--max-model-len", "100", "--context-length", "100"],
        ["--enable-prefix-caching", "--disable-radix-cache"],
        ["--enable-prefix-caching", "--no-enable-prefix-caching"],
        ["--gpu-memory-utilization", "0.5", "--mem-fraction-static", "0.6"],
        ["org/a", "--model", "org/b"],
    ],
)
def test_conflicting_spellings_name_both(argv: list[str]) -> None:
    with pytest.raises(ConfigError, match="conflicting flags") as info:
        parse_serve_args(argv)
    assert not isinstance(info.value, NotSupportedError)
    named = [a for a in argv if a.startswith("--")]
    for a in named:
        assert a in str(info.value)
    if len(named) == 1:
        assert "positional model" in str(info.value)


def test_repeating_one_spelling_keeps_the_last() -> None:
    assert parse_serve_args(["--port", "1", "--port", "2"]).port == 2


# ---- bad values ---------------------------------------------------------------------------------

BAD = [
    (["--port", "abc"], "--port", "integer"),
    (["--port", "0"], "--port", "at least 1"),
    (["--port", "70000"], "--port", "at most 65535"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization", "at most 1"),
    (["--mem-fraction-static", "0"], "--mem-fraction-static", "greater than 0"),
    (["--mem-fraction-static", "nan"], "--mem-fraction-static", "finite"),
    (["--context-length", "0"], "--context-length", "at least 1"),
    (["--max-model-len", "4k"], "--max-model-len", "integer"),
    (["--page-size", "-16"], "--page-size", "at least 1"),
    (["--max-num-seqs", "-3"], "--max-num-seqs", "at least 1"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size", "at least 1"),
    (["--random-seed", "-1"], "--random-seed", "at least 0"),
    (["--schedule-policy", "fastest"], "--schedule-policy", "invalid choice"),
    (["--dtype", "int8"], "--dtype", "invalid choice"),
    (["--device", "tpu"], "--device", "invalid choice"),
    (["--log-level", "loud"], "--log-level", "invalid choice"),
    (["--attention-backend", "magic"], "--attention-backend", "invalid choice"),
    (["--load-format", "zip"], "--load-format", "invalid choice"),
    (["--hf-overrides", "{oops"], "--hf-overrides", "invalid JSON"),
    (["--hf-overrides", "[1]"], "--hf-overrides", "expected a JSON object"),
    (["--cuda-graph-bs", "1", "x"], "--cuda-graph-bs", "integer"),
    (["--speculative-num-steps", "0"], "--speculative-num-steps", "at least 1"),
    (["--port"], "--port", "expected one argument"),
]


@pytest.mark.parametrize(("argv", "name", "fragment"), BAD)
def test_bad_values_name_the_flag(argv: list[str], name: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_serve_args(argv)
    assert not isinstance(info.value, NotSupportedError)
    assert name in str(info.value) and fragment in str(info.value), str(info.value)


def test_unknown_flag_suggests_a_spelling() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown flag: --max-model-lenn \(did you mean --max-model-len\?\)"
    ):
        parse_serve_args(["--max-model-lenn", "5"])
    with pytest.raises(ConfigError, match="unknown flag: --mdl"):
        parse_serve_args(["--mdl", "x"])
    with pytest.raises(ConfigError, match="only one positional model"):
        parse_serve_args(["a", "b"])
    with pytest.raises(ConfigError, match="unknown flag: --cont"):  # no prefix abbreviations
        parse_serve_args(["--cont", "5"])


def test_value_normalisation() -> None:
    cfg = parse_serve_args(["--dtype", "half", "--log-level", "WARNING"])
    assert cfg.dtype == "float16" and cfg.log_level == "warning"
    assert parse_serve_args(["--dtype", "float"]).dtype == "float32"
    assert parse_serve_args(["--port=8080"]).port == 8080


@pytest.mark.parametrize(
    ("argv", "name"),
    [
        (["--attention-backend", "fa3"], "--attention-backend"),
        (["--schedule-policy", "dfs-weight"], "--schedule-policy"),
        (["--load-format", "pt"], "--load-format"),
        (["--device", "xpu"], "--device"),
        (["--chunked-prefill-size", "-1"], "--chunked-prefill-size"),
        (["--revision", "main"], "--revision"),
        (["--download-dir", "/tmp/hf"], "--download-dir"),
        (["--quantization-param-path", "s.json", "--modelopt-quant", "fp8"], "--modelopt-quant"),
        (["--lora-backend", "csgmv"], "--lora-backend"),
        (["--speculative-config", '{"method": "eagle"}'], "--speculative-config"),
        (["--grammar-backend", "outlines"], "--grammar-backend"),
    ],
)
def test_values_not_built_yet(argv: list[str], name: str) -> None:
    with pytest.raises(NotSupportedError, match=f"^not supported yet: {name} \\(") as info:
        parse_serve_args(argv)
    assert info.value.exit_code == 2


def test_supported_choices_work() -> None:
    for policy in ("fcfs", "lpm"):
        assert parse_serve_args(["--schedule-policy", policy]).schedule_policy == policy
    for backend in ("triton", "torch_native"):
        assert parse_serve_args(["--attention-backend", backend]).attention_backend == backend
    for fmt in ("auto", "safetensors", "gguf", "dummy"):
        assert parse_serve_args(["--load-format", fmt]).load_format == fmt
    assert parse_serve_args(["--trust-remote-code"]).trust_remote_code is True
    for backend in ("llguidance", "xgrammar", "none"):  # xgrammar: checked importable at launch
        assert parse_serve_args(["--grammar-backend", backend]).grammar_backend == backend


# ---- --config YAML ----------------------------------------------------------------------------------


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_yaml_config_either_spelling(tmp_path: Path) -> None:
    path = _yaml(
        tmp_path,
        "model: org/m\nmax-model-len: 4096\ngpu_memory_utilization: 0.5\nenable-metrics: true\n"
        "port: 8080\nblock-size: 32\nenable-prefix-caching: false\nschedule-policy: lpm\n",
    )
    cfg = parse_serve_args(["--config", path])
    assert cfg.model_path == "org/m" and cfg.context_length == 4096 and cfg.mem_fraction_static == 0.5
    assert cfg.enable_metrics is True and cfg.port == 8080 and cfg.page_size == 32
    assert cfg.disable_radix_cache is True and cfg.schedule_policy == "lpm"
    assert cfg.config_file == path


def test_sglang_style_config_file(tmp_path: Path) -> None:
    # The example from SGLang's documentation, with a TP size TokenSpeed can run.
    path = _yaml(
        tmp_path,
        "model-path: meta-llama/Meta-Llama-3-8B-Instruct\nhost: 0.0.0.0\nport: 30000\n"
        "tensor-parallel-size: 1\nenable-metrics: true\nlog-requests: true\n",
    )
    cfg = parse_serve_args(["--config", path])
    assert cfg.host == "0.0.0.0" and cfg.tp_size == 1 and cfg.log_requests


def test_command_line_overrides_the_file(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "port: 8080\nmax-model-len: 1024\nhost: 0.0.0.0\n")
    cfg = parse_serve_args(["--port", "9000", "--context-length", "2048", f"--config={path}"])
    assert (cfg.port, cfg.context_length, cfg.host) == (9000, 2048, "0.0.0.0")
    assert (
        parse_serve_args(["org/cli", "--config", _yaml(tmp_path, "model: org/file\n")]).model_path
        == "org/cli"
    )


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        (
            "max-model-len: 10\nbogus-key: 1\nother_thing: 2\n",
            ["unknown keys", "'bogus-key'", "'other_thing'"],
        ),
        ("max-modle-len: 10\n", ["unknown key", "did you mean 'max-model-len'"]),
        (
            "max-model-len: 10\ncontext-length: 20\n",
            ["conflicting flags", "--max-model-len", "--context-length"],
        ),
        ("port: abc\n", ["--port", "integer", "serve.yaml"]),
        ("port: 0\n", ["--port", "at least 1", "serve.yaml"]),
        ("enable-metrics: maybe\n", ["--enable-metrics", "true or false"]),
        ("- port\n- 80\n", ["mapping"]),
        ("port: [1\n", ["not valid YAML"]),
        ("config: other.yaml\n", ["another config file"]),
    ],
)
def test_bad_config_files(tmp_path: Path, text: str, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_serve_args(["--config", _yaml(tmp_path, text)])
    assert not isinstance(info.value, NotSupportedError)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_config_file_missing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        parse_serve_args(["--config", str(tmp_path / "nope.yaml")])


def test_config_file_unsupported_and_empty(tmp_path: Path) -> None:
    with pytest.raises(NotSupportedError, match=r"^not supported yet: --lora-backend \(.*serve.yaml"):
        parse_serve_args(["--config", _yaml(tmp_path, "lora-backend: csgmv\n")])
    assert parse_serve_args(["--config", _yaml(tmp_path, "")]).port == 30000
    assert parse_serve_args(["--config", _yaml(tmp_path, "api-key:\n")]).api_key is None
    cfg = parse_serve_args(["--config", _yaml(tmp_path, "lora-paths: []\nhf-overrides: {}\nnnodes: 1\n")])
    assert isinstance(cfg, ServeConfig)


# ---- --help and --dry-run ---------------------------------------------------------------------------


def test_help_is_grouped_and_lists_every_spelling(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_serve_args(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for heading in ("Model and tokenizer:", "HTTP server:", "Quantization and data type:",
                    "Memory and scheduling:", "Parallelism:", "Logging and metrics:", "LoRA:",
                    "Speculative decoding:", "PD disaggregation:", "Hierarchical cache and KV store:"):  # fmt: skip
        assert heading in out
    for flag in FLAGS:
        for spelling in flag.spellings:
            assert spelling in out
    assert "[not supported yet]" in out


def test_parser_groups_follow_the_table() -> None:
    parser = build_serve_parser()
    titles = [g.title for g in parser._action_groups]
    assert [t for t in titles if t in GROUPS] == list(GROUPS)


def test_dry_run_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        load_serve_config(["org/m", "--dry-run", "--max-model-len", "2048", "--api-key", "secret"])
    assert info.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model_path"] == "org/m" and out["context_length"] == 2048 and out["dry_run"] is True
    assert out["api_key"] != "secret"
    assert set(out) == {f.name for f in fields(ServeConfig)}


def test_errors_exit_2_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--port", "x"], ["--lora-backend", "csgmv"]):
        with pytest.raises(SystemExit) as info:
            load_serve_config(argv)
        assert info.value.code == 2
    assert "not supported yet: --lora-backend (" in capsys.readouterr().err
    assert load_serve_config(["--port", "1"]).port == 1


# ---- ServeConfig and the table ------------------------------------------------------------------------


def test_serve_config_fields_are_the_implemented_flags() -> None:
    implemented = {f.dest for f in FLAGS if f.implemented}
    assert {f.name for f in fields(ServeConfig)} == implemented
    for f in fields(ServeConfig):
        assert f.default == BY_DEST[f.name].default, f.name


def test_exactly_these_flags_are_implemented() -> None:
    expected = {
        "--model-path", "--tokenizer-path", "--host", "--port", "--served-model-name", "--api-key",
        "--chat-template", "--context-length", "--page-size", "--max-running-requests",
        "--chunked-prefill-size", "--max-prefill-tokens", "--max-mixed-prefill-tokens",
        "--max-total-tokens", "--schedule-policy", "--schedule-lead-ms", "--max-mixed-step-ms",
        "--disable-radix-cache", "--disable-overlap-schedule", "--mem-fraction-static", "--device",
        "--swa-full-tokens-ratio", "--disable-hybrid-swa-memory", "--dtype", "--load-format", "--random-seed", "--log-level", "--log-requests", "--trust-remote-code", "--attention-backend",
        "--disable-cuda-graph", "--cuda-graph-max-bs", "--disable-piecewise-cuda-graph",
        "--enable-piecewise-cuda-graph", "--piecewise-cuda-graph-tokens",
        "--piecewise-cuda-graph-max-tokens", "--tp-size", "--skip-server-warmup",
        "--enable-metrics", "--dry-run", "--config", "--moe-backend", "--ep-size",
        "--enable-expert-parallel", "--all2all-backend",
        "--kv-cache-dtype", "--quantization-param-path", "--quantization", "--lm-head-quantization",
        "--dense-tp-size",
        "--moe-tp-size", "--world-size", "--nprocs-per-node", "--dist-init-addr", "--dist-timeout", "--nnodes",
        "--node-rank", "--max-queued-requests", "--decode-log-interval", "--sampling-defaults",
        "--max-request-body-bytes", "--shutdown-timeout", "--watchdog-timeout",
        "--grammar-backend", "--tool-call-parser", "--reasoning-parser", "--enable-auto-tool-choice",
        "--constrained-json-whitespace-pattern", "--constrained-json-disable-any-whitespace",
        "--dp-size", "--load-balance-method", "--enable-dp-attention",
        "--speculative-algorithm", "--speculative-config", "--speculative-num-draft-tokens",
        "--speculative-ngram-min-match-window-size", "--speculative-ngram-max-match-window-size",
        "--speculative-draft-model-path", "--speculative-num-steps", "--speculative-eagle-topk",
        "--speculative-disable-by-batch-size", "--speculative-break-even-accept-length",
        "--speculative-break-even-per-request", "--speculative-probe-interval",
        "--enable-lora", "--max-lora-rank", "--lora-target-modules", "--lora-paths",
        "--max-loras-per-batch", "--max-loaded-loras", "--lora-eviction-policy",
        "--enable-priority-scheduling", "--schedule-low-priority-values-first", "--weight-version",
        "--priority-scheduling-preemption-threshold",
        "--is-embedding", "--constrained-json-allow-additional-properties",
        "--enable-hierarchical-cache", "--hicache-ratio", "--hicache-size",
        "--hicache-write-policy", "--radix-eviction-policy", "--hicache-storage-backend",
        "--hicache-storage-backend-extra-config", "--json-model-override-args",
        "--kv-events-config", "--max-logprobs", "--enable-trace", "--otlp-traces-endpoint",
        "--disaggregation-mode", "--disaggregation-transfer-backend",
        "--disaggregation-bootstrap-port", "--disaggregation-bootstrap-host",
        "--enable-deterministic-inference",
    }  # fmt: skip
    assert {f.name for f in FLAGS if f.implemented} == expected
    c = counts()
    assert c["implemented"] == len(expected) and c["flags"] == len(FLAGS) > 250


def test_each_component_reads_the_section_its_flags_name() -> None:
    cfg = parse_serve_args(["org/m", "--api-key", "k", "--dtype", "bfloat16", "--max-mixed-step-ms", "25",
                            "--dry-run"])
    server, scheduler, worker = cfg.section("server"), cfg.section("scheduler"), cfg.section("worker")
    assert server["api_key"] == "k" and "dtype" not in server and server["model_path"] == "org/m"
    assert worker["dtype"] == "bfloat16" and "api_key" not in worker and worker["model_path"] == "org/m"
    # The scheduler's section is its whole config (the launcher adds the measured num_pages and
    # resolves context_length / max_running_requests): Rust's SchedulerConfig, field for field.
    assert set(scheduler) == {"page_size", "max_running_requests", "chunked_prefill_size",
                              "max_prefill_tokens", "max_mixed_prefill_tokens", "max_mixed_step_ms",
                              "schedule_policy", "disable_radix_cache", "context_length",
                              "speculative_algorithm", "speculative_num_draft_tokens",
                              "speculative_ngram_min_match_window_size",
                              "speculative_ngram_max_match_window_size",
                              "speculative_disable_by_batch_size",
                              "speculative_break_even_accept_length",
                              "speculative_break_even_per_request", "speculative_probe_interval",
                              "enable_priority_scheduling", "schedule_low_priority_values_first",
                              "radix_eviction_policy", "hicache_write_policy",
                              "priority_scheduling_preemption_threshold"}
    assert scheduler["max_mixed_step_ms"] == 25.0 and "max_mixed_step_ms" not in server
    for shared in ("page_size", "context_length", "chunked_prefill_size"):
        assert shared in scheduler and shared in worker
    assert {"dry_run", "tp_size"} <= set(cfg.section("launch"))
    assert cfg.server_dict() == server | scheduler and cfg.worker_dict() == worker
    every = set().union(*(cfg.section(r) for r in ("server", "scheduler", "worker", "launch")))
    assert every == set(cfg.to_dict())


def test_serve_config_is_generated_from_the_table() -> None:
    # One field per implemented flag, its default the table's: nothing restates a setting.
    assert {f.name: f.default for f in fields(ServeConfig)} == {
        f.dest: f.default for f in FLAGS if f.implemented}


def test_table_is_well_formed() -> None:
    for flag in FLAGS:
        assert flag.help[:1].isupper() and flag.help.endswith("."), flag.name
        assert flag.readers and set(flag.readers) <= {"server", "scheduler", "worker", "launch"}
        assert flag.default is None or flag.check(flag.default) is None
        if flag.supported is not None:
            assert set(flag.supported) <= set(flag.choices or ()), flag.name
            if flag.default is not None:
                assert flag.default in flag.supported, flag.name


def test_config_package_does_not_import_torch() -> None:
    pkg = Path(__file__).resolve().parents[1] / "python" / "tokenspeed" / "config"
    for src in pkg.glob("*.py"):
        for node in ast.walk(ast.parse(src.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                root = name.split(".")[0]
                assert root not in ("torch", "numpy", "transformers"), f"{src.name} imports {name}"
                if root == "tokenspeed":
                    assert name.startswith("tokenspeed.config"), f"{src.name} imports {name}"


def test_sampling_defaults_come_from_generation_config_unless_openai(tmp_path) -> None:
    import json

    from tokenspeed.launch.model_facts import sampling_defaults
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True, "eos_token_id": 2}))
    assert sampling_defaults(tmp_path, "model") == {"temperature": 0.6, "top_p": 0.9, "top_k": 20.0}
    assert sampling_defaults(tmp_path, "openai") == {}
    assert sampling_defaults(tmp_path / "missing", "model") == {}


def test_priority_order_flag_needs_priority_scheduling() -> None:
    from types import SimpleNamespace

    from tokenspeed.launch.serve import LaunchError, check_priority_flags

    def flags(low_first: bool, enabled: bool, threshold: int = 10) -> SimpleNamespace:
        return SimpleNamespace(schedule_low_priority_values_first=low_first,
                               enable_priority_scheduling=enabled,
                               priority_scheduling_preemption_threshold=threshold)

    with pytest.raises(LaunchError, match="needs --enable-priority-scheduling"):
        check_priority_flags(flags(True, False))
    with pytest.raises(LaunchError, match="threshold compares request priorities"):
        check_priority_flags(flags(False, False, threshold=3))
    check_priority_flags(flags(True, True))
    check_priority_flags(flags(False, True, threshold=0))
    check_priority_flags(flags(False, False))
