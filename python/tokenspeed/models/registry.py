"""HF `architectures` name → model class."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from tokenspeed.distributed.groups import ParallelState
from tokenspeed.layers.moe import MoeOptions
from tokenspeed.models.bert import BertForSequenceClassification, BertModel
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from tokenspeed.models.gemma3 import Gemma3ForCausalLM
from tokenspeed.models.gpt_oss import GptOssForCausalLM
from tokenspeed.models.llama import LlamaForCausalLM
from tokenspeed.models.mixtral import MixtralForCausalLM
from tokenspeed.models.phi3 import Phi3ForCausalLM
from tokenspeed.models.pooling import (
    DecoderClassifier,
    DecoderEmbedding,
    PoolingConfig,
    classifier_labels,
    head_tokens,
    read_pooling_config,
)
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


# `--is-embedding`: encoders that pool (their own classes) ...
ENCODER_REGISTRY: dict[str, type[BertModel | BertForSequenceClassification]] = {
    "BertModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
}
# ... and decoders used as embedders: checkpoints saved as the bare model name the same layers.
DECODER_EMBEDDER_NAMES = {"LlamaModel": "LlamaForCausalLM", "Qwen2Model": "Qwen2ForCausalLM",
                          "Qwen3Model": "Qwen3ForCausalLM"}
DECODER_EMBEDDERS = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
# ... and decoders with a classification head (cross-encoders: rerank, score, classify).
DECODER_CLASSIFIERS = {"LlamaForSequenceClassification": "LlamaForCausalLM",
                       "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
                       "Qwen3ForSequenceClassification": "Qwen3ForCausalLM"}


def build_model(config: ModelConfig, max_positions: int | None = None,
                moe: MoeOptions | None = None, parallel: ParallelState | None = None,
                pooling: PoolingConfig | None = None) -> nn.Module:
    """`moe`: backend and parallel layout of the expert layers (ignored by dense models);
    `parallel`: this rank's process groups (None: `distributed.state()`); `pooling`: build the
    model as a pooling model (`--is-embedding`, see models/pooling.py)."""
    if pooling is not None:
        return build_pooling_model(config, pooling, max_positions, moe, parallel)
    cls = MODEL_REGISTRY.get(config.architecture)
    if cls is None:
        raise NotImplementedError(f"architecture {config.architecture!r} is not supported "
                                  f"(supported: {sorted(MODEL_REGISTRY)})")
    return cls(config, max_positions, moe, parallel)


def pooling_config_for(config: ModelConfig, model_dir: str | None) -> PoolingConfig:
    """The checkpoint's sentence-transformers pooling, else the family's default: CLS for an
    encoder, the last token for a decoder (which attends only backwards)."""
    default = "cls" if config.architecture in ENCODER_REGISTRY else "last"
    ids, two_way = head_tokens(config.raw, model_dir)
    return replace(read_pooling_config(model_dir, default), head_token_ids=ids, two_way=two_way)


def build_pooling_model(config: ModelConfig, pooling: PoolingConfig,
                        max_positions: int | None = None, moe: MoeOptions | None = None,
                        parallel: ParallelState | None = None) -> nn.Module:
    arch = config.architecture
    if arch in ENCODER_REGISTRY:
        return ENCODER_REGISTRY[arch](config, pooling)
    if arch in DECODER_CLASSIFIERS:
        decoder = MODEL_REGISTRY[DECODER_CLASSIFIERS[arch]]
        inner = decoder(config, max_positions, moe, parallel)
        return DecoderClassifier(inner, len(classifier_labels(config.raw)), pooling)
    name = DECODER_EMBEDDER_NAMES.get(arch, arch)
    if name not in DECODER_EMBEDDERS:
        raise NotImplementedError(
            f"architecture {arch!r} cannot serve as an embedding model (--is-embedding "
            f"supports {sorted(ENCODER_REGISTRY)}, the decoders {sorted(DECODER_EMBEDDERS)} and "
            f"the decoder classifiers {sorted(DECODER_CLASSIFIERS)})")
    decoder = MODEL_REGISTRY[name]
    return DecoderEmbedding(decoder(config, max_positions, moe, parallel), pooling)
