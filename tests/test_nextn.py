"""NEXTN drafting (DeepSeek-V3's multi-token prediction layer as the draft head, worker/
draft_chain.py over models/deepseek_mtp.py): from a tiny random V3 checkpoint with its MTP
layer (tests/deepseek_mtp_model.py), the drafts the runner returns after prompt chunks, after a
verify step that rejects and one that accepts every draft are those of a plain torch reference
over HF transformers' hidden states; so are every request's in a mixed batch (torch_native and
triton) and after a page copy (the head's latent KV comes along). The head's KV is a latent
(MLA) cache; the target skips the MTP layer's tensors; copies of the target's head and
embedding are shared; --quantization fp8 drafts; a model without an MTP layer is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from deepseek_mtp_model import MtpModel, hf_greedy, make_mtp_model, reference_drafts
from spec_checks import BatchDrafting, drafting_resumes_after_pauses, drafts_follow_the_reference
from test_models_families import family_models  # noqa: F401  (the fixture)

from tokenspeed.worker.draft_chain import DraftSpec
from tokenspeed.worker.model_runner import ModelRunner
from tokenspeed.worker.plan import StepPlan

STEPS = 3
NEXTN = DraftSpec("NEXTN", None, STEPS)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> MtpModel:
    return make_mtp_model(tmp_path_factory.mktemp("deepseek_mtp"))


def runner_for(m: MtpModel, slots: int = 2, backend: str = "torch_native") -> ModelRunner:
    return ModelRunner(str(m.path), page_size=4, max_slots=slots, max_context_len=64, seed=0,
                       attention_backend=backend, draft=NEXTN)


def test_the_head_is_the_mtp_layer_over_a_latent_cache(mtp_model: MtpModel) -> None:
    runner = runner_for(mtp_model)
    drafter = runner.drafter
    assert drafter is not None and drafter.cache is not None
    cfg = mtp_model.target.config
    k = drafter.cache.k[0]
    assert k.shape[2:] == (1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    assert drafter.cache.v_from_k == cfg.kv_lora_rank and drafter.cache.v[0].data_ptr() == k.data_ptr()
    assert len(runner.model.model.layers) == cfg.num_hidden_layers  # the MTP layer is not one
    head = drafter.head
    assert head.shared_head.head is not None  # its own output head (unlike the target's)
    assert head.embed_tokens is None  # the target's embedding
    torch.testing.assert_close(head.eh_proj.weight, mtp_model.mtp["eh_proj.weight"])


def test_drafts_match_the_reference_forward(mtp_model: MtpModel) -> None:
    m = mtp_model
    drafts_follow_the_reference(runner_for(m), [(37 * i) % 250 + 3 for i in range(11)], STEPS,
                                lambda seq: reference_drafts(m, seq, STEPS),
                                lambda seq, n: hf_greedy(m.target, seq, n))


@pytest.mark.parametrize("backend", ["torch_native", "triton"])  # triton: the interpreter on CPU
def test_a_batch_drafts_as_each_request_alone(mtp_model: MtpModel, backend: str) -> None:
    # Three requests in one batch, the head's attention one backend call per pass: prompt
    # chunks, decodes, verify steps that reject and one that accepts every draft.
    m = mtp_model
    prompts = {s: [(31 * i + 17 * s) % 250 + 3 for i in range(n)] for s, n in ((0, 5), (1, 9), (2, 14))}
    b = BatchDrafting(runner_for(m, slots=3, backend=backend), prompts, STEPS,
                      lambda seq: reference_drafts(m, seq, STEPS))
    b.step(StepPlan.build(**b.admission(), scheduled=[
        (2, 0, prompts[2][:6], False), (0, 0, prompts[0], True), (1, 0, prompts[1], True)]), {0, 1})
    right = hf_greedy(m.target, b.seqs[1], STEPS + 1)
    b.step(StepPlan.build(scheduled=[
        b.verify(1, right[:STEPS]), b.verify(0), (2, 6, prompts[2][6:], True)]), {0, 1, 2})
    assert b.seqs[1][-(STEPS + 1):] == right
    b.step(StepPlan.build(scheduled=[b.verify(s) for s in (2, 1, 0)]), {0, 1, 2})


def test_drafting_resumes_exactly_after_paused_steps(mtp_model: MtpModel) -> None:
    # Speculation turned off by the scheduler (`pause_drafts`) and back on: the MTP layer's
    # latent KV kept up, its drafts the reference's on resumption.
    m = mtp_model
    prompts = {0: [(29 * i) % 250 + 3 for i in range(6)], 1: [(13 * i + 5) % 250 + 3 for i in range(9)]}
    drafting_resumes_after_pauses(BatchDrafting(runner_for(m, slots=2), prompts, STEPS,
                                                lambda seq: reference_drafts(m, seq, STEPS)))


def test_a_model_without_an_mtp_layer_is_refused(family_models, tmp_path: Path) -> None:  # noqa: F811
    path, _ = family_models("deepseek_v3")  # V3's config, no MTP tensors
    with pytest.raises(ValueError, match="no MTP layer|without an MTP layer"):
        ModelRunner(path, page_size=4, max_slots=2, max_context_len=64, draft=NEXTN)


def test_a_head_equal_to_the_targets_is_shared(tmp_path: Path) -> None:
    # V3's release ships copies of the embedding and the output head in the MTP layer: equal
    # tensors are the target's, not a second copy.
    m = make_mtp_model(tmp_path, tie_word_embeddings=False)
    from safetensors.torch import load_file, save_file

    file = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(str(file))
    n = m.target.config.num_hidden_layers
    tensors[f"model.layers.{n}.shared_head.head.weight"] = tensors["lm_head.weight"]
    tensors[f"model.layers.{n}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    save_file({k: v.clone() for k, v in tensors.items()}, str(file), metadata={"format": "pt"})
    runner = ModelRunner(str(tmp_path), page_size=4, max_slots=2, max_context_len=64, draft=NEXTN)
    assert runner.drafter is not None
    head = runner.drafter.head
    assert head.shared_head.head is None and head.embed_tokens is None


def test_dummy_weights_draft(mtp_model: MtpModel) -> None:
    runner = ModelRunner(str(mtp_model.path), page_size=4, max_slots=2, max_context_len=64,
                         load_format="dummy", draft=NEXTN)
    out = runner.launch(StepPlan.build(new=[{"slot": 0, "temperature": 0.0}],
                                       page_tables=[(0, 0, [1, 2])],
                                       scheduled=[(0, 0, [5, 6, 7], True)])).wait()
    assert out.draft_tokens is not None and len(out.draft_tokens[0]) == STEPS



def test_fp8_target_drafts_with_the_layer_in_its_dtype(mtp_model: MtpModel) -> None:
    # --quantization fp8 of a float checkpoint: the target's linears are FP8, the MTP layer's
    # stay as loaded (its own output head included), and it drafts.
    runner = ModelRunner(str(mtp_model.path), page_size=4, max_slots=2, max_context_len=64,
                         quantization="fp8", draft=NEXTN)
    assert runner.model.model.layers[0].self_attn.kv_a_proj_with_mqa.weight.dtype == torch.float8_e4m3fn
    head = runner.drafter.head
    assert head.decoder.self_attn.kv_a_proj_with_mqa.weight.dtype == torch.float32
    out = runner.launch(StepPlan.build(new=[{"slot": 0, "temperature": 0.0}],
                                       page_tables=[(0, 0, [1, 2, 3])],
                                       scheduled=[(0, 0, [5, 6, 7, 8, 9], True)])).wait()
    assert out.draft_tokens is not None and len(out.draft_tokens[0]) == STEPS


def test_a_copied_page_brings_the_heads_latent_kv(mtp_model: MtpModel) -> None:
    # The plan's page copies (a shared prefix's partial page): B's first two pages are copies of
    # A's and it computes from position 6 on; the head's latent entries of positions 0 ... 5
    # must come with the copies for B's drafts to be those of B alone.
    m = mtp_model
    runner = runner_for(m)
    a = [(41 * i) % 250 + 3 for i in range(8)]
    b = a[:7] + [11, 12, 13]
    runner.launch(StepPlan.build(new=[{"slot": 0, "temperature": 0.0}],
                                 page_tables=[(0, 0, [1, 2, 3])],
                                 scheduled=[(0, 0, a, True)])).wait()
    out = runner.launch(StepPlan.build(new=[{"slot": 1, "temperature": 0.0}],
                                       page_tables=[(1, 0, [10, 11, 12])], copies=[(1, 10), (2, 11)],
                                       scheduled=[(1, 6, b[6:], True)])).wait()
    assert out.draft_tokens is not None
    seq = b + np.asarray(out.tokens).tolist()
    assert out.draft_tokens[0].tolist() == reference_drafts(m, seq, STEPS)
