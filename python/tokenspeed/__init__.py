"""TokenSpeed: a fast LLM serving runtime — Rust core (HTTP, tokenizer, radix cache, scheduler)
with Python model workers, driven by `tokenspeed serve`, or in-process through `tokenspeed.LLM`
and `tokenspeed.AsyncLLM` (docs/offline.md)."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# Imported on first use: `import tokenspeed` (the CLI, the workers) stays light.
_OFFLINE = ("LLM", "AsyncLLM", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams",
            "RequestOutput", "CompletionOutput")


def __getattr__(name: str) -> Any:
    if name in _OFFLINE:
        from tokenspeed import offline

        return getattr(offline, name)
    raise AttributeError(f"module 'tokenspeed' has no attribute {name!r}")
