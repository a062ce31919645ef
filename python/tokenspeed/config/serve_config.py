"""`ServeConfig`: the resolved settings of `tokenspeed serve`.

Only implemented flags get a field: every other flag must still hold its default (anything
else is refused as "not supported yet"), so there is nothing for the runtime to read.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from tokenspeed.config.table import BY_DEST

REDACTED = "<redacted>"


@dataclass
class ServeConfig:
    # Model and tokenizer.
    model_path: str | None = None  # None: the default model (SmolLM2-135M-Instruct)
    tokenizer_path: str | None = None  # None: same as the model
    load_format: str = "auto"
    trust_remote_code: bool = False  # accepted; no effect (remote code never runs)
    context_length: int | None = None  # None: from the model config
    # HTTP server and API.
    host: str = "127.0.0.1"
    port: int = 30000
    skip_server_warmup: bool = False
    api_key: str | None = None
    served_model_name: str | None = None  # None: the model path
    chat_template: str | None = None
    # Data type and quantization.
    dtype: str = "auto"
    quantization: str | None = None  # fp8; None: whatever config.json declares
    kv_cache_dtype: str = "auto"  # fp8 / fp8_e4m3 / fp8_e5m2: an fp8 KV cache
    quantization_param_path: str | None = None  # FP8 KV cache scales (JSON)
    # Memory and scheduling.
    mem_fraction_static: float | None = None  # None: chosen by the worker
    max_running_requests: int | None = None  # None: derived from the KV cache size
    max_total_tokens: int | None = None  # None: derived from mem_fraction_static
    chunked_prefill_size: int = 8192
    max_prefill_tokens: int = 16384
    schedule_policy: str = "fcfs"
    page_size: int = 16
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    # Runtime.
    device: str = "auto"
    random_seed: int | None = None
    # Logging.
    log_level: str = "info"
    log_requests: bool = False
    enable_metrics: bool = False
    # Parallelism.
    tp_size: int = 1
    # Kernels and CUDA graphs.
    attention_backend: str | None = None  # None: picked from the device
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None  # None: chosen by the worker
    # Launcher.
    config_file: str | None = None
    dry_run: bool = False

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
