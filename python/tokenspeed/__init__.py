"""TokenSpeed: a fast LLM serving runtime — Rust core (HTTP, tokenizer, radix cache, scheduler)
with Python model workers, driven by `tokenspeed serve`."""

__version__ = "0.1.0"
