"""Multi-LoRA serving end to end: greedy output of each adapter equals HF PEFT's on the same
random adapters and the same model (SmolLM2 real weights, fp32, CPU), for one batch mixing
three adapters and the base model, through the real server and the openai client; adapters
loaded and unloaded at run time; the prefix cache kept apart per adapter."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

from server_harness import Server, start_server, stop_server

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # ~70 s: a server, four PEFT adapters and their references

PROMPT = "The three most useful things to pack for a long hike are"
MAX_TOKENS = 6
# name → (rank, alpha, rsLoRA, target modules): attention only, the MLP only with rsLoRA, all
# seven projections (q/k/v and gate/up land in our fused qkv_proj / gate_up_proj).
ADAPTERS = {
    "attn": (8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": (4, 8, True, ["gate_proj", "up_proj", "down_proj"]),
    "all": (16, 32, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"]),
    "late": (2, 4, False, ["q_proj", "v_proj"]),  # loaded at run time
}


def _base_model() -> torch.nn.Module:
    from tokenspeed.launch.assets import ensure_default_model

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(ensure_default_model()), torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_base() -> torch.nn.Module:
    return _base_model()


def _save_adapter(base: torch.nn.Module, path: Path, seed: int, rank: int, alpha: int,
                  rslora: bool, targets: list[str]) -> torch.nn.Module:
    """A PEFT adapter with random A and B (PEFT zeroes B, which would make it a no-op);
    returns the base model without it."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets,
                             lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(str(path))
    return model.unload()


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory,
                 hf_base: torch.nn.Module) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    base = hf_base
    for seed, (name, spec) in enumerate(ADAPTERS.items()):
        base = _save_adapter(base, root / name, seed, *spec)
    return {name: root / name for name in ADAPTERS}


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory,
                adapter_dirs: dict[str, Path]) -> Iterator[Server]:
    # attn is pinned (SGLang's JSON form): it keeps one of the 3 pool slots throughout.
    pinned = json.dumps({"lora_name": "attn", "lora_path": str(adapter_dirs["attn"]), "pinned": True})
    paths = [pinned] + [f"{n}={adapter_dirs[n]}" for n in ("mlp", "all")]
    srv = start_server(str(tmp_path_factory.mktemp("lora-server")), "--page-size", "4",
                       "--max-total-tokens", "4096", "--lora-paths", *paths,
                       "--max-loras-per-batch", "3")
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="module")
def client(lora_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="unused", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def prompt_ids(lora_server: Server) -> list[int]:
    return httpx.post(f"{lora_server.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]


@pytest.fixture(scope="module")
def peft_tokens(adapter_dirs: dict[str, Path], prompt_ids: list[int],
                hf_base: torch.nn.Module) -> dict[str | None, list[int]]:
    """Greedy continuations by HF PEFT: each adapter's, and the base model's (None)."""
    model = peft.PeftModel.from_pretrained(hf_base, str(adapter_dirs["attn"]), adapter_name="attn")
    for name in ADAPTERS:
        if name != "attn":
            model.load_adapter(str(adapter_dirs[name]), adapter_name=name)
    ids = torch.tensor([prompt_ids])
    out: dict[str | None, list[int]] = {}

    def generate() -> list[int]:
        with torch.no_grad():
            seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=MAX_TOKENS, do_sample=False)
        return seq[0, len(prompt_ids):].tolist()

    for name in ADAPTERS:
        model.set_adapter(name)
        out[name] = generate()
    with model.disable_adapter():
        out[None] = generate()
    return out


def _complete(client: openai.OpenAI, model: str, prompt_ids: list[int],
              **extra: object) -> openai.types.Completion:
    return client.completions.create(model=model, prompt=prompt_ids, max_tokens=MAX_TOKENS,
                                     temperature=0, extra_body={"return_tokens_as_token_ids": True,
                                                                **extra}, logprobs=0)


def _ids(r: openai.types.Completion) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]


def test_mixed_batch_matches_peft(client: openai.OpenAI, prompt_ids: list[int],
                                  peft_tokens: dict[str | None, list[int]]) -> None:
    base = client.models.list().data[0].id
    assert len(set(map(tuple, peft_tokens.values()))) == len(peft_tokens), \
        "the random adapters change the greedy output (else this test could not fail)"
    # The base model first: its prompt KV is cached, and no adapter may reuse it.
    first = _complete(client, base, prompt_ids)
    assert _ids(first) == peft_tokens[None]
    names = [base, "attn", "mlp", "all", base]
    with ThreadPoolExecutor(len(names)) as pool:  # one batch: three adapters and the base
        results = list(pool.map(lambda m: _complete(client, m, prompt_ids), names))
    for name, r in zip(names, results):
        assert _ids(r) == peft_tokens[None if name == base else name], name
        assert r.model == name  # the adapter a request ran on, as vLLM names it
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert (cached > 0) == (name == base), (name, cached)
    # The same adapter reuses its own cached prompt, and SGLang's lora_path names an adapter.
    again = _complete(client, base, prompt_ids, lora_path="attn")
    assert _ids(again) == peft_tokens["attn"]
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_on_an_adapter(lora_server: Server, client: openai.OpenAI) -> None:
    """A chat request on an adapter runs the adapter on the rendered prompt: the same text as a
    completion of the template's tokens on it."""
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = httpx.post(f"{lora_server.url}/tokenize", json={"messages": messages}).json()["tokens"]
    chat = client.chat.completions.create(model="all", messages=messages, max_tokens=MAX_TOKENS,
                                          temperature=0)
    assert chat.model == "all"
    text = client.completions.create(model="all", prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    base = client.completions.create(model=client.models.list().data[0].id, prompt=ids,
                                     max_tokens=MAX_TOKENS, temperature=0)
    assert chat.choices[0].message.content == text.choices[0].text != base.choices[0].text


def test_models_list_adapters_with_parent(client: openai.OpenAI) -> None:
    cards = client.models.list().data
    base = cards[0].id
    by_id = {c.id: c for c in cards[1:]}
    assert set(by_id) == {"attn", "mlp", "all"}
    assert all(c.model_extra["parent"] == base for c in by_id.values())
    assert client.models.retrieve("mlp").model_extra["parent"] == base


def test_unknown_adapters_are_refused_by_name(client: openai.OpenAI, prompt_ids: list[int]) -> None:
    with pytest.raises(openai.NotFoundError, match="nope"):
        _complete(client, "nope", prompt_ids)
    with pytest.raises(openai.BadRequestError, match="nope") as e:
        _complete(client, client.models.list().data[0].id, prompt_ids, lora_path="nope")
    assert e.value.body["param"] == "lora_path"


def test_load_and_unload_at_run_time(lora_server: Server, client: openai.OpenAI,
                                     adapter_dirs: dict[str, Path], prompt_ids: list[int],
                                     peft_tokens: dict[str | None, list[int]]) -> None:
    url = lora_server.url
    r = httpx.post(f"{url}/v1/load_lora_adapter",
                   json={"lora_name": "late", "lora_path": str(adapter_dirs["late"])})
    assert r.status_code == 200, r.text
    assert _ids(_complete(client, "late", prompt_ids)) == peft_tokens["late"]
    dup = httpx.post(f"{url}/load_lora_adapter",  # SGLang's spelling
                     json={"lora_name": "late", "lora_path": str(adapter_dirs["late"])})
    assert dup.status_code == 400 and "late" in dup.text
    bad = httpx.post(f"{url}/v1/load_lora_adapter",
                     json={"lora_name": "x", "lora_path": str(adapter_dirs["late"] / "missing")})
    assert bad.status_code == 400 and "adapter_config.json" in bad.text
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError, match="late"):
        _complete(client, "late", prompt_ids)
    gone = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "late"})
    assert gone.status_code == 404 and "late" in gone.text


def test_pinned_adapters_keep_a_slot_and_leave_one(lora_server: Server, client: openai.OpenAI,
                                                   adapter_dirs: dict[str, Path], prompt_ids: list[int],
                                                   peft_tokens: dict[str | None, list[int]]) -> None:
    """3 pool slots, attn pinned at start: one more pin is taken, a third would leave no slot
    for the others (400 on `pinned`); unloading a pinned adapter frees its pin. Pinned or not,
    every adapter gives PEFT's tokens, beside the others in one batch."""
    url = lora_server.url
    load = {"lora_name": "late", "lora_path": str(adapter_dirs["late"]), "pinned": True}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=load).status_code == 200
    try:
        third = httpx.post(f"{url}/v1/load_lora_adapter", json=load | {"lora_name": "late2"})
        assert third.status_code == 400, third.text
        assert third.json()["error"]["param"] == "pinned" and "at most 2" in third.text
        with ThreadPoolExecutor(4) as pool:  # 2 pins + mlp = 3 slots; then all waits for one
            got = dict(zip(["late", "attn", "mlp", "all"], pool.map(
                lambda m: _ids(_complete(client, m, prompt_ids)), ["late", "attn", "mlp", "all"])))
        assert got == {m: peft_tokens[m] for m in got}
    finally:
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    again = httpx.post(f"{url}/v1/load_lora_adapter", json=load | {"lora_name": "late2"})
    assert again.status_code == 200, again.text
    assert _ids(_complete(client, "late2", prompt_ids)) == peft_tokens["late"]
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late2"}).status_code == 200


def test_n_streaming_and_structured_output_on_an_adapter(client: openai.OpenAI, prompt_ids: list[int],
                                                         peft_tokens: dict[str | None, list[int]]) -> None:
    extra = {"return_tokens_as_token_ids": True}
    r = client.completions.create(model="all", prompt=prompt_ids, max_tokens=MAX_TOKENS,
                                  temperature=0, n=2, logprobs=0, extra_body=extra)
    assert [_ids_of(c.logprobs.tokens) for c in r.choices] == [peft_tokens["all"]] * 2
    stream = client.completions.create(model="mlp", prompt=prompt_ids, max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True, logprobs=0, extra_body=extra)
    streamed = [t for chunk in stream for c in chunk.choices for t in (c.logprobs.tokens if c.logprobs else [])]
    assert _ids_of(streamed) == peft_tokens["mlp"]
    digits = client.completions.create(model="attn", prompt=prompt_ids, max_tokens=4, temperature=0,
                                       extra_body={"regex": "[0-9]+"})
    assert digits.choices[0].text.isdigit()


def _ids_of(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_agent_routes_on_an_adapter(lora_server: Server, client: openai.OpenAI) -> None:
    """`model` names an adapter on /v1/responses and /v1/messages as on the chat route: the
    same greedy text as chat on that adapter, not the base model's; an unknown name is the
    chat route's 404."""
    import anthropic

    question = "Name a colour."
    messages = [{"role": "user", "content": question}]
    base = client.models.list().data[0].id

    def respond(model: str) -> openai.types.responses.Response:
        return client.responses.create(model=model, input=question, max_output_tokens=MAX_TOKENS,
                                       temperature=0)

    chat = client.chat.completions.create(model="all", messages=messages, max_tokens=MAX_TOKENS,
                                          temperature=0)
    on_adapter, on_base = respond("all"), respond(base)
    assert on_adapter.model == "all"
    assert on_adapter.output_text == chat.choices[0].message.content != on_base.output_text
    claude = anthropic.Anthropic(base_url=lora_server.url, api_key="unused", max_retries=0,
                                 timeout=120)
    m = claude.messages.create(model="all", max_tokens=MAX_TOKENS, messages=messages,
                               extra_body={"temperature": 0})
    assert m.model == "all" and m.content[0].text == chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError) as chat_error:
        client.chat.completions.create(model="nope", messages=messages, max_tokens=1)
    with pytest.raises(openai.NotFoundError) as e:
        respond("nope")
    assert e.value.body == chat_error.value.body
    with pytest.raises(anthropic.NotFoundError) as a:
        claude.messages.create(model="nope", max_tokens=1, messages=messages)
    assert a.value.body["error"]["message"] == chat_error.value.body["message"]
