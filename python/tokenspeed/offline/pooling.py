"""`LLM.embed`, `LLM.score` and `LLM.classify` on an `is_embedding=True` engine: the pooling
routes' answers (rust/server/src/http/pooling.rs, through `tokenspeed._core.Engine`) in vLLM's
output shapes (`EmbeddingRequestOutput`, `ScoringRequestOutput`, `ClassificationRequestOutput`,
each with `.outputs`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    finished: bool = True


@dataclass
class ClassificationOutput:
    probs: list[float]
    label: str | None  # the most likely label's name (config.json id2label)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    finished: bool = True


def embedding_outputs(request_id: str, response: dict[str, Any]) -> list[EmbeddingRequestOutput]:
    return [EmbeddingRequestOutput(f"{request_id}-{d['index']}", EmbeddingOutput(d["embedding"]))
            for d in response["data"]]


def scoring_outputs(request_id: str, response: dict[str, Any]) -> list[ScoringRequestOutput]:
    return [ScoringRequestOutput(f"{request_id}-{d['index']}", ScoringOutput(float(d["score"])))
            for d in response["data"]]


def classification_outputs(request_id: str, response: dict[str, Any]
                           ) -> list[ClassificationRequestOutput]:
    return [ClassificationRequestOutput(f"{request_id}-{d['index']}",
                                        ClassificationOutput(d["probs"], d.get("label")))
            for d in response["data"]]
