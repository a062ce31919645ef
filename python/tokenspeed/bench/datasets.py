"""Benchmark prompts: tokenizers (local file or the server's /tokenize) and the four datasets."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

RANGE_RATIO_HELP = (
    "Spread of random lengths (vLLM's meaning): each length is drawn uniformly from the integers "
    "[max(1, int(L*(1-R))), int(L*(1+R))]; 0 (default) = every length is exactly L. Needs 0 <= R < 1. "
    "(SGLang's flag of the same name means [max(1, int(L*R)), L]: its 0 means uniform in [1, L].)")


class BenchTokenizer(Protocol):
    """What the datasets and the output-length fallback need from a tokenizer."""

    vocab_size: int
    special_ids: set[int]
    source: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class LocalTokenizer:
    """A `tokenizer.json` (HF tokenizers), or a directory holding one (else AutoTokenizer)."""

    def __init__(self, path: str) -> None:
        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        self.source = str(file)
        if file.is_file():
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(file))
            self._hf = None
            self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
            self.special_ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        else:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(path)
            self.source = path
            self.vocab_size = len(self._hf)
            self.special_ids = set(self._hf.all_special_ids)

    def encode(self, text: str) -> list[int]:
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=False))
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        if self._hf is not None:
            return str(self._hf.decode(ids, skip_special_tokens=False))
        return str(self._tok.decode(ids, skip_special_tokens=False))


class RemoteTokenizer:
    """The server's /tokenize and /detokenize (TokenSpeed and vLLM speak the same shape)."""

    def __init__(self, base_url: str, model: str | None, vocab_size: int, special_ids: set[int]) -> None:
        import httpx

        self._client = httpx.Client(base_url=base_url, timeout=60, trust_env=False)
        self._model = model
        self.vocab_size = vocab_size
        self.special_ids = special_ids
        self.source = f"{base_url}/tokenize"

    def encode(self, text: str) -> list[int]:
        body: dict = {"prompt": text, "add_special_tokens": False}
        if self._model:
            body["model"] = self._model
        r = self._client.post("/tokenize", json=body)
        r.raise_for_status()
        return [int(t) for t in r.json()["tokens"]]

    def decode(self, ids: list[int]) -> str:
        body: dict = {"tokens": ids}
        if self._model:
            body["model"] = self._model
        r = self._client.post("/detokenize", json=body)
        r.raise_for_status()
        d = r.json()
        return str(d.get("text", d.get("prompt", "")))


def resolve_tokenizer(path: str | None, base_url: str, model: str | None) -> BenchTokenizer:
    """--tokenizer, else the server's tokenizer/model directory if it is local, else /tokenize."""
    if path:
        return LocalTokenizer(path)
    import httpx

    info: dict = {}
    try:
        r = httpx.get(f"{base_url}/get_model_info", timeout=10, trust_env=False)
        if r.status_code == 200:
            info = r.json()
    except httpx.HTTPError:
        pass
    for cand in (info.get("tokenizer_path"), info.get("model_path"), model):
        if cand and (Path(cand) / "tokenizer.json").is_file():
            return LocalTokenizer(cand)
    vocab = int(info.get("vocab_size") or 0)
    special = {int(i) for i in info.get("eos_token_ids") or []}
    remote = RemoteTokenizer(base_url, model, vocab, special)
    try:
        remote.encode("hello")
    except Exception as e:  # noqa: BLE001 - any failure means "no usable remote tokenizer"
        raise SystemExit(f"tokenspeed bench: no tokenizer: pass --tokenizer DIR ({base_url}/tokenize: {e})")
    if not vocab:
        raise SystemExit("tokenspeed bench: the server does not report vocab_size; pass --tokenizer DIR")
    return remote


@dataclass
class BenchRequest:
    prompt: str | list[int]  # text, or token ids (random-ids)
    prompt_len: int  # tokens, as counted by the benchmark's tokenizer (no special tokens added)
    output_len: int  # max_tokens of the request
    group: int = -1  # generated-shared-prefix: index of the shared system prompt


class TokenSampler:
    """Random non-special token ids, and text that re-tokenizes to a requested length."""

    def __init__(self, tok: BenchTokenizer, rng: np.random.Generator) -> None:
        self.tok = tok
        self.rng = rng
        ids = np.arange(tok.vocab_size, dtype=np.int64)
        self.allowed = np.setdiff1d(ids, np.fromiter(tok.special_ids, np.int64)) if tok.special_ids else ids

    def ids(self, n: int) -> list[int]:
        return [int(i) for i in self.rng.choice(self.allowed, size=n)]

    def text(self, n: int) -> tuple[str, int]:
        """Text of n tokens (decode random ids, re-encode, trim or top up; a few rounds)."""
        ids = self.ids(n)
        text, got = "", []
        for _ in range(10):
            text = self.tok.decode(ids)
            got = self.tok.encode(text)
            if len(got) == n:
                return text, n
            ids = got[:n] if len(got) > n else got + self.ids(n - len(got))
        return text, len(got)


def random_lengths(rng: np.random.Generator, length: int, range_ratio: float, n: int) -> np.ndarray:
    """vLLM semantics: uniform integers in [max(1, int(L*(1-R))), int(L*(1+R))]."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, int(length * (1.0 - range_ratio)))
    hi = max(lo, int(length * (1.0 + range_ratio)))
    return rng.integers(lo, hi + 1, size=n)


def random_dataset(tok: BenchTokenizer, rng: np.random.Generator, num_prompts: int, input_len: int,
                   output_len: int, range_ratio: float, as_ids: bool) -> list[BenchRequest]:
    """`random` (text that re-tokenizes to the length) or `random-ids` (exact token ids)."""
    ins = random_lengths(rng, input_len, range_ratio, num_prompts)
    outs = random_lengths(rng, output_len, range_ratio, num_prompts)
    sampler = TokenSampler(tok, rng)
    reqs = []
    for i, o in zip(ins.tolist(), outs.tolist()):
        if as_ids:
            reqs.append(BenchRequest(sampler.ids(i), i, o))
        else:
            text, n = sampler.text(i)
            reqs.append(BenchRequest(text, n, o))
    return reqs


def _turns(conv: list[dict]) -> tuple[str | None, str | None]:
    """First human turn, and the first assistant turn after it."""
    human = gpt = None
    for t in conv:
        who = str(t.get("from", t.get("role", ""))).lower()
        val = t.get("value", t.get("content"))
        if not isinstance(val, str):
            continue
        if human is None and who in ("human", "user"):
            human = val
        elif human is not None and who in ("gpt", "assistant", "chatgpt", "bard", "model"):
            gpt = val
            break
    return human, gpt


def sharegpt_dataset(path: str, tok: BenchTokenizer, rng: np.random.Generator, num_prompts: int,
                     output_len: int | None = None, context_len: int | None = None) -> list[BenchRequest]:
    """ShareGPT JSON (list of {conversations: [{from, value}, ...]}), shuffled with the seed.

    Prompt = first human turn; output length = tokens of the first gpt turn (or `output_len`).
    Skips (like SGLang) prompts or outputs under 2 tokens and, with `context_len`, longer pairs.
    """
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise TypeError(f"{path}: expected a JSON list of conversations")
    reqs: list[BenchRequest] = []
    for idx in rng.permutation(len(data)).tolist():
        item = data[idx]
        conv = item.get("conversations", item.get("conversation")) if isinstance(item, dict) else None
        if not isinstance(conv, list):
            continue
        human, gpt = _turns(conv)
        if human is None or (gpt is None and output_len is None):
            continue
        plen = len(tok.encode(human))
        olen = output_len if output_len is not None else len(tok.encode(gpt or ""))
        if plen < 2 or olen < (1 if output_len is not None else 2):
            continue
        if context_len and plen + olen > context_len:
            continue
        reqs.append(BenchRequest(human, plen, olen))
        if len(reqs) == num_prompts:
            break
    if not reqs:
        raise ValueError(f"{path}: no usable conversations")
    if len(reqs) < num_prompts:
        print(f"warning: {path} gave only {len(reqs)} usable prompts of {num_prompts}", file=sys.stderr)
    return reqs


def shared_prefix_dataset(tok: BenchTokenizer, rng: np.random.Generator, num_groups: int,
                          prompts_per_group: int, system_prompt_len: int, question_len: int,
                          output_len: int) -> list[BenchRequest]:
    """SGLang's generated-shared-prefix: per group one random system prompt, then
    `prompts_per_group` random questions; prompt = system + "\\n\\n" + question; shuffled."""
    sampler = TokenSampler(tok, rng)
    reqs = []
    for g in range(num_groups):
        system, _ = sampler.text(system_prompt_len)
        for _ in range(prompts_per_group):
            question, _ = sampler.text(question_len)
            prompt = f"{system}\n\n{question}"
            reqs.append(BenchRequest(prompt, len(tok.encode(prompt)), output_len, group=g))
    order = rng.permutation(len(reqs)).tolist()
    return [reqs[i] for i in order]


def build_dataset(a: argparse.Namespace, tok: BenchTokenizer) -> list[BenchRequest]:
    """The dataset named by the parsed CLI args (see serve.add_dataset_args)."""
    rng = np.random.default_rng(a.seed)
    name = a.dataset_name
    if name in ("random", "random-ids"):
        return random_dataset(tok, rng, a.num_prompts, a.random_input_len, a.random_output_len,
                              a.random_range_ratio, as_ids=name == "random-ids")
    if name == "sharegpt":
        if not a.dataset_path or not os.path.isfile(a.dataset_path):
            raise SystemExit(f"tokenspeed bench: --dataset-path {a.dataset_path!r} is not a file (ShareGPT JSON)")
        return sharegpt_dataset(a.dataset_path, tok, rng, a.num_prompts, a.sharegpt_output_len,
                                a.sharegpt_context_len)
    if name == "generated-shared-prefix":
        return shared_prefix_dataset(tok, rng, a.gsp_num_groups, a.gsp_prompts_per_group,
                                     a.gsp_system_prompt_len, a.gsp_question_len, a.gsp_output_len)
    raise SystemExit(f"tokenspeed bench: unknown dataset {name!r}")


def length_stats(values: list[int]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "min": 0, "max": 0, "total": 0}
    return {"mean": float(np.mean(values)), "min": int(min(values)), "max": int(max(values)),
            "total": int(sum(values))}
