"""HF `architectures` name → model class."""

from __future__ import annotations

from torch import nn

from tokenspeed.distributed.groups import ParallelState
from tokenspeed.layers.moe import MoeOptions
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from tokenspeed.models.gemma3 import Gemma3ForCausalLM
from tokenspeed.models.gpt_oss import GptOssForCausalLM
from tokenspeed.models.llama import LlamaForCausalLM
from tokenspeed.models.mixtral import MixtralForCausalLM
from tokenspeed.models.phi3 import Phi3ForCausalLM
from tokenspeed.models.qwen2 import Qwen2ForCausalLM
from tokenspeed.models.qwen3 import Qwen3ForCausalLM
from tokenspeed.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}


def build_model(config: ModelConfig, max_positions: int | None = None,
                moe: MoeOptions | None = None, parallel: ParallelState | None = None) -> nn.Module:
    """`moe`: backend and parallel layout of the expert layers (ignored by dense models);
    `parallel`: this rank's process groups (None: `distributed.state()`)."""
    cls = MODEL_REGISTRY.get(config.architecture)
    if cls is None:
        raise NotImplementedError(f"architecture {config.architecture!r} is not supported "
                                  f"(supported: {sorted(MODEL_REGISTRY)})")
    return cls(config, max_positions, moe, parallel)
