"""The offline engine API: `LLM` (batch generation) and `AsyncLLM` (streaming), in this Python
process, over the same Rust engine and workers as `tokenspeed serve` (docs/offline.md)."""

from tokenspeed.offline.async_llm import AsyncLLM
from tokenspeed.offline.engine import EngineDeadError, RequestFailed
from tokenspeed.offline.llm import LLM
from tokenspeed.offline.outputs import CompletionOutput, Logprob, RequestOutput
from tokenspeed.offline.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

__all__ = [
           "LLM",
           "AsyncLLM",
           "CompletionOutput",
           "EngineDeadError",
           "GuidedDecodingParams",
           "Logprob",
           "RequestFailed",
           "RequestOutput",
           "SamplingParams",
           "StructuredOutputsParams",
]
