"""Seed-driven coverage of the `tokenspeed serve` flag table (issue 4).

Every `--flag` named in the seed documents (TokenSpeed's compatible-parameter and parallelism
pages, SGLang's server-argument pages) must be in the table, and every flag in the table must
either work or stop the launch with `not supported yet: --flag (...)`.

The seeds live next to the repository: `<repo>/../shared/seeds/`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tokenspeed.config import (
    BY_SPELLING,
    FLAGS,
    ConfigError,
    Flag,
    NotSupportedError,
    ServeConfig,
    parse_serve_args,
)

SEED_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "seeds"
SEED_PREFIXES = ("000", "001", "002", "003", "004")

# Seed pages are HTML flattened to text, so a flag is sometimes glued to the next word
# ("--tool-call-parserwhen", "--enable-p2p-checkto"). Only these words are stripped.
GLUE_WORDS = ("before", "when", "only", "for", "to")
# Tokens in the seeds that are not `serve` flags, with the reason.
NOT_SERVE_FLAGS = {
    "--help": "argparse's own help switch (tested in test_config.py)",
    "--shm-size": "a `docker run` option mentioned in SGLang's deployment notes",
}
# `--` flags, and SGLang's pages also write flags with an en dash ("–enable-ep-moe").
_FLAG_RE = re.compile(r"(?:--|\u2013|\u2014)([a-z][a-z0-9*-]*)")


def _seed_text(prefix: str) -> str:
    if not SEED_DIR.is_dir():
        pytest.fail(f"seed documents not found: expected the directory {SEED_DIR} (<repo>/../shared/seeds)")
    files = sorted(SEED_DIR.glob(f"{prefix}_*.txt"))
    if not files:
        pytest.fail(f"seed {prefix} not found in {SEED_DIR}")
    return files[0].read_text(encoding="utf-8")


def _seed_tokens(prefix: str) -> list[str]:
    """Every flag-looking token of one seed, as `--name`, in order of first appearance."""
    seen: dict[str, None] = {}
    for m in _FLAG_RE.finditer(_seed_text(prefix)):
        token = "--" + m.group(1).rstrip("-")
        seen.setdefault(token, None)
    return list(seen)


def _resolve_token(token: str) -> str:
    """How the table covers a seed token: 'flag', 'wildcard', 'not-a-serve-flag' or ''."""
    candidates = [token] + [token[: -len(w)] for w in GLUE_WORDS if token.endswith(w)]
    for cand in candidates:
        if "*" in cand:
            prefix = cand.split("*", 1)[0]
            if any(sp.startswith(prefix) for sp in BY_SPELLING):
                return "wildcard"
            continue
        if cand in BY_SPELLING:
            return "flag"
        if cand in NOT_SERVE_FLAGS:
            return "not-a-serve-flag"
    return ""


@pytest.mark.parametrize("prefix", SEED_PREFIXES)
def test_every_seed_flag_is_in_the_table(prefix: str) -> None:
    tokens = _seed_tokens(prefix)
    assert tokens, f"no flags extracted from seed {prefix}"
    missing = [t for t in tokens if not _resolve_token(t)]
    assert not missing, f"seed {prefix}: flags missing from the table: {missing}"


def test_seed_extraction_finds_the_known_shapes() -> None:
    # Guard the extractor itself: glued words, wildcards, en dashes and plain tables.
    assert "--tool-call-parserwhen" in _seed_tokens("000")
    assert _resolve_token("--tool-call-parserwhen") == "flag"
    assert _resolve_token("--disaggregation-*") == "wildcard"
    assert _resolve_token("--kvstore-*only") == "wildcard"
    assert "--enable-ep-moe" in _seed_tokens("002")  # written with an en dash there
    assert len(_seed_tokens("004")) > 250
    assert _resolve_token("--definitely-not-a-flag") == ""


# SGLang spellings the issue names explicitly.
NAMED_IN_ISSUE = [
    "--model-path", "--tp-size", "--mem-fraction-static", "--context-length",
    "--max-running-requests", "--chunked-prefill-size", "--max-prefill-tokens", "--schedule-policy",
    "--disable-radix-cache", "--page-size", "--cuda-graph-max-bs", "--disable-cuda-graph",
    "--attention-backend", "--sampling-backend", "--grammar-backend", "--enable-metrics",
    "--log-requests", "--api-key", "--served-model-name", "--chat-template", "--tool-call-parser",
    "--reasoning-parser", "--speculative-algorithm", "--speculative-num-steps",
    "--speculative-draft-model-path", "--lora-paths", "--max-loras-per-batch", "--disaggregation-mode",
    "--disaggregation-transfer-backend", "--enable-hierarchical-cache", "--hicache-ratio",
]  # fmt: skip


@pytest.mark.parametrize("spelling", NAMED_IN_ISSUE)
def test_flags_named_in_the_issue(spelling: str) -> None:
    assert spelling in BY_SPELLING


# ---- every flag in the table is accepted or explicitly "not supported yet" ------------------


# Flags whose value only means something beside another one (the pair is what gets tested).
PARTNERS = {"--speculative-num-draft-tokens": ["--speculative-algorithm", "NGRAM"],
            "--speculative-draft-model-path": ["--speculative-algorithm", "EAGLE3",
                                               "--speculative-num-steps", "3"],
            "--speculative-num-steps": ["--speculative-algorithm", "EAGLE3",
                                        "--speculative-draft-model-path", "head"],
            # The speculation gate's tuning needs speculation configured.
            **{gate: ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "2"]
               for gate in ("--speculative-disable-by-batch-size",
                            "--speculative-break-even-accept-length",
                            "--speculative-break-even-per-request", "--speculative-probe-interval")}}
JSON_SAMPLES = {"--speculative-config": '{"method": "ngram", "num_speculative_tokens": 2}',
                "--kv-events-config": '{"publisher": "zmq", "endpoint": "tcp://*:5557"}'}


def sample_argv(flag: Flag, spelling: str) -> list[str]:
    """A valid, non-default value for the flag, as command-line words."""
    if flag.name in PARTNERS:
        return [*PARTNERS[flag.name], spelling, str(sample_value(flag))]
    if flag.kind == "bool":
        return [spelling, "true"] if flag.takes_value else [spelling]
    if flag.kind == "list":
        if flag.choices:
            return [spelling, str(flag.choices[0])]
        return [spelling, "2", "4"] if flag.item in ("int", "float") else [spelling, "a"]
    return [spelling, str(sample_value(flag))]


def sample_value(flag: Flag) -> Any:
    if flag.choices:
        return next(c for c in flag.choices if c != flag.default)
    if flag.kind == "json":
        return JSON_SAMPLES.get(flag.name, '{"k": 1}')
    if flag.kind == "int":
        lo = int(flag.minimum) if flag.minimum is not None else 0
        v = (flag.default + 1) if isinstance(flag.default, int) and flag.default >= lo else max(lo, 1) + 1
        return min(v, int(flag.maximum)) if flag.maximum is not None else v
    if flag.kind == "float":
        if flag.maximum is not None:
            return 0.5 if flag.default != 0.5 else 0.25
        return (flag.default or 1.0) + 1.0
    return "sample-value"


GENERIC = [f for f in FLAGS if f.dest != "config_file"]


@pytest.mark.parametrize("flag", GENERIC, ids=[f.name for f in GENERIC])
def test_each_flag_is_accepted_or_not_supported(flag: Flag) -> None:
    for spelling in (flag.name, *flag.aliases):
        argv = sample_argv(flag, spelling)
        try:
            cfg = parse_serve_args(argv)
        except NotSupportedError as e:
            assert f"not supported yet: {spelling} (" in str(e), str(e)
            assert not flag.implemented or flag.supported or flag.max_supported or flag.unsupported_values
        except ConfigError as e:  # pragma: no cover - the failure message is the point
            pytest.fail(f"{argv}: a valid value was rejected: {e}")
        else:
            assert flag.implemented, f"{argv} was accepted but {flag.name} is not implemented"
            assert isinstance(cfg, ServeConfig)
            assert getattr(cfg, flag.dest) != flag.default or flag.kind == "bool"


UNIMPLEMENTED = [f for f in FLAGS if not f.implemented]


@pytest.mark.parametrize("flag", UNIMPLEMENTED, ids=[f.name for f in UNIMPLEMENTED])
def test_unimplemented_flag_message_says_what_it_does(flag: Flag) -> None:
    with pytest.raises(NotSupportedError) as info:
        parse_serve_args(sample_argv(flag, flag.name))
    line = str(info.value)
    assert line.startswith(f"not supported yet: {flag.name} (")
    what = line.split(" (", 1)[1]
    assert len(what) > 8, line


DEFAULTS_EXPLICIT = [f for f in UNIMPLEMENTED if f.default is not None and f.kind not in ("bool", "list")]


@pytest.mark.parametrize("flag", DEFAULTS_EXPLICIT, ids=[f.name for f in DEFAULTS_EXPLICIT])
def test_spelling_out_the_default_of_an_unbuilt_flag_is_fine(flag: Flag) -> None:
    # Recipes often spell out defaults (e.g. `--nnodes 1`); that asks for nothing unbuilt.
    assert isinstance(parse_serve_args([flag.name, str(flag.default)]), ServeConfig)


def test_unbuilt_features_are_reported_together() -> None:
    with pytest.raises(NotSupportedError) as info:
        parse_serve_args(["--lora-backend", "csgmv", "--speculative-algorithm", "EAGLE",
                          "--enable-dp-lm-head"])
    lines = info.value.lines
    assert [ln.split(" (")[0] for ln in lines] == [
        "not supported yet: --lora-backend",
        "not supported yet: --speculative-algorithm",
        "not supported yet: --enable-dp-lm-head",
    ]


DEEPEP_SPELLINGS = [
    ["--all2all-backend", "deepep_high_throughput"],
    ["--all2all-backend", "deepep_low_latency"],
    ["--moe-a2a-backend", "deepep"],
    ["--enable-deepep-moe"],
]


@pytest.mark.parametrize("argv", DEEPEP_SPELLINGS, ids=[" ".join(a) for a in DEEPEP_SPELLINGS])
def test_deepep_is_refused_saying_what_it_needs_and_what_to_use(argv: list[str]) -> None:
    # Issue 16: not the generic "not available yet", but what DeepEP needs and the built-in
    # exchanges to use instead.
    with pytest.raises(NotSupportedError) as info:
        parse_serve_args(argv)
    message = str(info.value)
    assert message.startswith(f"not supported yet: {argv[0]} ("), message
    assert "not available yet" not in message
    for words in ("deep_ep", "NVSHMEM", "RDMA", "--all2all-backend allgather_reducescatter",
                  "torch_all2all"):
        assert words in message, f"{words!r} missing: {message}"


@pytest.mark.parametrize("name", ["--all2all-backend", "--moe-a2a-backend"])
def test_every_refused_all_to_all_backend_says_why(name: str) -> None:
    flag = BY_SPELLING[name]
    refused = [v for v in flag.choices if v != flag.default and v not in (flag.supported or ())]
    assert refused
    for value in refused:
        with pytest.raises(NotSupportedError) as info:
            parse_serve_args([name, value])
        message = str(info.value)
        assert f"{value!r} is not built into TokenSpeed: " in message, message
        assert "allgather_reducescatter" in message and "torch_all2all" in message, message


def test_help_text_is_our_own() -> None:
    # No help string starts with a sentence copied from the SGLang documents.
    seeds = " ".join(_seed_text(p) for p in ("002", "003", "004")).lower()
    copied = []
    for flag in FLAGS:
        first = flag.help.split(". ")[0].strip().rstrip(".").lower()
        if len(first) > 25 and first in seeds:
            copied.append(flag.name)
    assert not copied, f"help copied from the seeds: {copied}"
