"""lm-evaluation-harness's `local-completions` model against `tokenspeed serve` (issue 31): its
loglikelihood path (completions with `echo`, `logprobs: 1`, `max_tokens: 1`, parsed with
`max(top_logprobs.values())`) runs a multiple-choice task made from local text, and each
answer's log-likelihood equals HF transformers' on the same weights (fp32 CPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from server_harness import Server

lm_eval = pytest.importorskip("lm_eval")

# lm-eval joins question and choice with its target delimiter, " ".
DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "Berlin", "a fish"], "label": 0},
    {"question": "Two plus two equals", "choices": ["four", "seven"], "label": 0},
    {"question": "The opposite of hot is", "choices": ["cold", "tall", "blue"], "label": 0},
]


def smollm2_dir() -> Path:
    return Path(os.environ.get("TOKENSPEED_TEST_ASSETS", "/root/.cache/tokenspeed/test-assets")) / "smollm2"


def write_task(root: Path) -> None:
    (root / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (root / "ts_local_mc.yaml").write_text(f"""task: ts_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "docs.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
""")


def test_local_completions_loglikelihoods_match_hf(server: Server, model: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    write_task(tmp_path)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # the task's data is a local file
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": model, "base_url": f"{server.url}/v1/completions",
                    "tokenizer_backend": "huggingface", "tokenizer": str(smollm2_dir()),
                    "num_concurrent": 1, "max_retries": 1},
        tasks=["ts_local_mc"], task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True)
    assert results is not None
    acc = results["results"]["ts_local_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    samples = results["samples"]["ts_local_mc"]
    assert len(samples) == len(DOCS)

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir()), dtype=torch.float32).eval()
    for s in samples:
        doc = s["doc"]
        ours = [float(r[0][0]) for r in s["resps"]]  # (loglikelihood, is_greedy) per choice
        ref = []
        for choice in doc["choices"]:
            ctx = tok(doc["question"]).input_ids
            full = tok(doc["question"] + " " + choice).input_ids
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), dim=-1)
            ref.append(sum(float(logp[i - 1, full[i]]) for i in range(len(ctx), len(full))))
        assert ours == pytest.approx(ref, abs=2e-3), (doc, ours, ref)
