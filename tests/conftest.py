"""Shared fixtures: a real `tokenspeed serve` process on CPU with the default model, and a tiny
random Llama checkpoint for the model-runner tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from server_harness import Server, start_server, stop_server

if TYPE_CHECKING:  # the GPU machine runs tests/test_gpu*.py without the openai package
    import openai


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the e2e suite: default model, small pages so sharing is visible."""
    srv = start_server(str(tmp_path_factory.mktemp("server")), "--page-size", "4", "--max-running-requests", "32",
                       "--max-total-tokens", "16384", "--enable-metrics", "--log-requests")
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="session")
def client(server: Server) -> openai.OpenAI:
    """The official client against the shared server (a module may define its own)."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer random Llama (vocab 200, hidden 64, GQA 4/2) saved by transformers, seed 0."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.2)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)
