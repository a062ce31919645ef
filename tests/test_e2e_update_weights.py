"""/update_weights_from_disk end to end (SGLang's route and body): the default model serves; a
perturbed copy of its weights is loaded while the server stays up, and the greedy output changes;
loading the original back restores the original output. A checkpoint of another architecture,
or one that fails half-way (a tensor missing), is refused with success false and the weights
that were serving keep serving. A request running when the update arrives finishes first, on the
old weights; the prefix cache is dropped (its KV came from the old weights)."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from server_harness import Server, start_server, stop_server

pytestmark = pytest.mark.slow  # one server, a few reloads of SmolLM2's 270 MB: ~30-60 s on CPU

PROMPT = "The capital of France is"


def _model_dir() -> Path:
    from tokenspeed.launch.assets import ensure_default_model

    return Path(ensure_default_model())


def _copy(dst: Path, tensors: dict[str, torch.Tensor] | None, config: dict | None = None) -> str:
    """A checkpoint directory: the default model's files, with these tensors (None: its own)
    and config."""
    src = _model_dir()
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    if tensors is None:  # the original weights
        (dst / "model.safetensors").symlink_to(src / "model.safetensors")
    else:
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("weights")
    weights = load_file(str(_model_dir() / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    perturbed = {k: (v.float() * (1 + 0.2 * torch.randn(v.shape, generator=gen))).to(v.dtype)
                 if v.dim() == 2 else v for k, v in weights.items()}
    config = json.loads((_model_dir() / "config.json").read_text())
    broken = dict(perturbed)
    del broken[max(k for k in broken if k.endswith("mlp.down_proj.weight"))]
    return {
        "original": str(_model_dir()),
        "perturbed": _copy(tmp / "perturbed", perturbed),
        "other_arch": _copy(tmp / "other_arch", None, {**config, "num_hidden_layers": 3}),
        "missing_tensor": _copy(tmp / "missing_tensor", broken),
    }


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(str(tmp_path_factory.mktemp("update")), "--weight-version", "v1")
    yield server
    stop_server(server)


def _complete(srv: Server, max_tokens: int = 8) -> str:
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(model=srv.info()["served_model_name"], prompt=PROMPT,
                                    max_tokens=max_tokens, temperature=0)
    return out.choices[0].text


def _update(srv: Server, **body: object) -> httpx.Response:
    return httpx.post(f"{srv.url}/update_weights_from_disk", json=body, timeout=300)


def _version(srv: Server) -> str:
    return httpx.get(f"{srv.url}/get_weight_version", timeout=10).json()["weight_version"]


def test_new_weights_change_the_output_and_the_old_ones_restore_it(srv: Server,
                                                                   dirs: dict[str, str]) -> None:
    original = _complete(srv)
    r = _update(srv, model_path=dirs["perturbed"], weight_version="v2")
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True and r.json()["num_paused_requests"] == 0, r.text
    assert _version(srv) == "v2"
    assert _complete(srv) != original, "the perturbed weights serve"
    gen = httpx.post(f"{srv.url}/generate", timeout=60, json={
        "text": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}).json()
    assert gen["meta_info"]["weight_version"] == "v2"
    r = _update(srv, model_path=dirs["original"], weight_version="v1")
    assert r.json()["success"] is True, r.text
    assert _complete(srv) == original, "the original weights serve again (no stale cached KV)"
    assert _version(srv) == "v1"


def test_a_bad_checkpoint_is_refused_and_the_serving_weights_stay(srv: Server,
                                                                  dirs: dict[str, str]) -> None:
    original = _complete(srv)
    r = _update(srv, model_path=dirs["other_arch"], weight_version="bad")
    assert r.status_code == 400 and r.json()["success"] is False, r.text
    assert "num_hidden_layers" in r.json()["message"]
    # Every tensor but one loads before the missing one is noticed: the old weights come back.
    r = _update(srv, model_path=dirs["missing_tensor"], weight_version="bad")
    assert r.status_code == 400 and r.json()["success"] is False, r.text
    assert "missing" in r.json()["message"]
    r = _update(srv, model_path="/nonexistent/checkpoint")
    assert r.status_code == 400 and r.json()["success"] is False, r.text
    assert _version(srv) == "v1"
    assert _complete(srv) == original
    bad = httpx.post(f"{srv.url}/update_weights_from_disk", json={"path": "x"}, timeout=30)
    assert bad.status_code == 400 and "error" in bad.json(), bad.text


def test_a_running_request_finishes_on_the_old_weights_first(srv: Server,
                                                            dirs: dict[str, str]) -> None:
    original = _complete(srv, 24)
    out: dict[str, str] = {}
    t = threading.Thread(target=lambda: out.update(text=_complete(srv, 24)))
    t.start()
    while srv.info()["engine"]["running_requests"] == 0 and t.is_alive():
        time.sleep(0.01)
    r = _update(srv, model_path=dirs["perturbed"])
    t.join(120)
    assert r.json()["success"] is True, r.text
    assert out["text"] == original, "the request in flight ran on the old weights to its end"
    assert _complete(srv, 24) != original
    assert _update(srv, model_path=dirs["original"]).json()["success"] is True
