"""`ServeConfig`: the resolved settings of `tokenspeed serve`.

Only implemented flags get a field: every other flag must still hold its default (anything
else is refused as "not supported yet"), so there is nothing for the runtime to read. Defaults
come from the flag table; nothing here restates one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tokenspeed.config.table import BY_DEST

REDACTED = "<redacted>"


def _default(dest: str) -> Any:
    """A field's default is its flag's, read from the table (the one owner of defaults)."""
    return field(default=BY_DEST[dest].default)


@dataclass
class ServeConfig:
    # Model and tokenizer.
    model_path: str | None = _default("model_path")  # None: the default model (SmolLM2-135M-Instruct)
    tokenizer_path: str | None = _default("tokenizer_path")  # None: same as the model
    load_format: str = _default("load_format")
    trust_remote_code: bool = _default("trust_remote_code")  # accepted; no effect (remote code never runs)
    context_length: int | None = _default("context_length")  # None: from the model config
    # HTTP server and API.
    host: str = _default("host")
    port: int = _default("port")
    skip_server_warmup: bool = _default("skip_server_warmup")
    api_key: str | None = _default("api_key")
    served_model_name: str | None = _default("served_model_name")  # None: the model path
    chat_template: str | None = _default("chat_template")
    max_request_body_bytes: int = _default("max_request_body_bytes")
    shutdown_timeout: float = _default("shutdown_timeout")  # seconds to drain on SIGTERM/SIGINT
    # Data type.
    dtype: str = _default("dtype")
    quantization: str | None = _default("quantization")  # fp8; None: whatever config.json declares
    lm_head_quantization: str = _default("lm_head_quantization")  # auto / fp8 / none (FP8 weights)
    kv_cache_dtype: str = _default("kv_cache_dtype")  # fp8 / fp8_e4m3 / fp8_e5m2: an fp8 KV cache
    quantization_param_path: str | None = _default("quantization_param_path")  # FP8 KV scales (JSON)
    # Memory and scheduling.
    mem_fraction_static: float | None = _default("mem_fraction_static")  # None: chosen by the worker
    max_running_requests: int | None = _default("max_running_requests")  # None: derived from the KV pool (config/derived.py)
    max_total_tokens: int | None = _default("max_total_tokens")  # None: derived from mem_fraction_static
    chunked_prefill_size: int = _default("chunked_prefill_size")
    max_prefill_tokens: int = _default("max_prefill_tokens")
    max_mixed_prefill_tokens: int = _default("max_mixed_prefill_tokens")
    max_mixed_step_ms: float = _default("max_mixed_step_ms")
    max_queued_requests: int = _default("max_queued_requests")
    schedule_policy: str = _default("schedule_policy")
    page_size: int = _default("page_size")
    disable_radix_cache: bool = _default("disable_radix_cache")
    disable_overlap_schedule: bool = _default("disable_overlap_schedule")
    schedule_lead_ms: float = _default("schedule_lead_ms")
    # Runtime.
    device: str = _default("device")
    random_seed: int | None = _default("random_seed")
    watchdog_timeout: float = _default("watchdog_timeout")  # seconds one step may take
    # Logging.
    log_level: str = _default("log_level")
    log_requests: bool = _default("log_requests")
    enable_metrics: bool = _default("enable_metrics")
    decode_log_interval: int = _default("decode_log_interval")
    # API.
    sampling_defaults: str = _default("sampling_defaults")  # "model": generation_config.json's
    # Structured output, tool calls, reasoning.
    grammar_backend: str = _default("grammar_backend")  # llguidance, or none (refused)
    tool_call_parser: str | None = _default("tool_call_parser")
    reasoning_parser: str | None = _default("reasoning_parser")
    enable_auto_tool_choice: bool = _default("enable_auto_tool_choice")
    constrained_json_whitespace_pattern: str | None = _default("constrained_json_whitespace_pattern")
    constrained_json_disable_any_whitespace: bool = _default("constrained_json_disable_any_whitespace")
    # Parallelism (checked together by tokenspeed.distributed.groups.ParallelSizes at launch).
    tp_size: int = _default("tp_size")
    ep_size: int = _default("ep_size")
    enable_expert_parallel: bool = _default("enable_expert_parallel")  # EP size = world size
    dense_tp_size: int | None = _default("dense_tp_size")  # None: the attention TP size
    moe_tp_size: int | None = _default("moe_tp_size")  # None: world size / expert-parallel size
    world_size: int | None = _default("world_size")  # None: the attention TP size
    nprocs_per_node: int | None = _default("nprocs_per_node")  # None: world size / nodes
    dist_init_addr: str | None = _default("dist_init_addr")  # None: a free port on 127.0.0.1
    dist_timeout: int = _default("dist_timeout")
    nnodes: int = _default("nnodes")
    node_rank: int = _default("node_rank")
    dp_size: int = _default("dp_size")  # replicas, one engine + worker group each
    enable_dp_attention: bool = _default("enable_dp_attention")  # --dp-size: attention groups
    load_balance_method: str = _default("load_balance_method")  # how the router picks a replica
    # Kernels and CUDA graphs.
    attention_backend: str | None = _default("attention_backend")  # None: picked from the device
    disable_cuda_graph: bool = _default("disable_cuda_graph")
    cuda_graph_max_bs: int | None = _default("cuda_graph_max_bs")  # None: chosen by the worker
    disable_piecewise_cuda_graph: bool = _default("disable_piecewise_cuda_graph")  # extend graphs
    enable_piecewise_cuda_graph: bool = _default("enable_piecewise_cuda_graph")  # deprecated
    piecewise_cuda_graph_tokens: Sequence[int] | None = _default("piecewise_cuda_graph_tokens")
    piecewise_cuda_graph_max_tokens: int = _default("piecewise_cuda_graph_max_tokens")
    moe_backend: str | None = _default("moe_backend")  # None: triton on CUDA, torch_native on CPU
    all2all_backend: str = _default("all2all_backend")  # naive: partial outputs all-reduced
    # Launcher.
    config_file: str | None = _default("config_file")
    dry_run: bool = _default("dry_run")

    def to_dict(self) -> dict[str, Any]:
        """All settings, JSON-ready."""
        return asdict(self)

    def _component_dict(self, wanted: tuple[str, ...]) -> dict[str, Any]:
        return {k: v for k, v in self.to_dict().items() if BY_DEST[k].component in wanted}

    def server_dict(self) -> dict[str, Any]:
        """Settings the Rust server core consumes (component "server" or "both")."""
        return self._component_dict(("server", "both"))

    def worker_dict(self) -> dict[str, Any]:
        """Settings the Python worker consumes (component "worker" or "both")."""
        return self._component_dict(("worker", "both"))

    def to_json(self, redact_secrets: bool = True) -> str:
        """What `--dry-run` prints. The API key is replaced unless redact_secrets=False."""
        d = self.to_dict()
        if redact_secrets and d.get("api_key") is not None:
            d["api_key"] = REDACTED
        return json.dumps(d, indent=2, sort_keys=False)
