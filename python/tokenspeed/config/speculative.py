"""Speculative decoding settings: vLLM's `--speculative-config` JSON mapped onto the flags,
and the rules that tie the flags together. Run once, when `tokenspeed serve` resolves its
arguments, so every reader (scheduler, worker) sees one consistent set."""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenspeed.config.errors import ConfigError, NotSupportedError

# vLLM's `--speculative-config` keys → the flag dest each one sets.
_VLLM_KEYS = {
    "num_speculative_tokens": "speculative_num_draft_tokens",
    "prompt_lookup_min": "speculative_ngram_min_match_window_size",
    "prompt_lookup_max": "speculative_ngram_max_match_window_size",
    "model": "speculative_draft_model_path",
    "disable_by_batch_size": "speculative_disable_by_batch_size",
}
# vLLM's `method` values → `--speculative-algorithm`; None: named, but not built yet.
_METHODS: dict[str, str | None] = {
    "ngram": "NGRAM", "eagle": None, "eagle3": "EAGLE3", "mtp": "NEXTN", "deepseek_mtp": "NEXTN",
    "draft_model": None, "medusa": None, "mlp_speculator": None,
}
# The speculation gate's tuning (rust/engine scheduler/spec_gate.rs), by flag dest suffix.
_GATE_FLAGS = ("disable_by_batch_size", "break_even_accept_length", "break_even_per_request",
               "probe_interval")
# Algorithms whose drafts a head in the worker chains after each step (worker/draft_chain.py;
# the scheduler's side: rust/engine SchedulerConfig::worker_drafts).
DRAFT_HEADS = ("EAGLE3", "NEXTN")


def resolve_speculative(cfg: Any) -> Any:
    """`cfg` with `--speculative-config` applied and checked; raises ConfigError."""
    if cfg.speculative_config:
        cfg = _apply_vllm_config(cfg, cfg.speculative_config)
    if cfg.speculative_algorithm is None:
        # A flag away from its default (the flag table's, through the config's fields) asks for
        # speculation that is not configured.
        defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
        given = [f for f in ("num_draft_tokens", "num_steps", "draft_model_path", "eagle_topk",
                             *_GATE_FLAGS)
                 if getattr(cfg, f"speculative_{f}") != defaults[f"speculative_{f}"]]
        if given:
            raise ConfigError(f"--speculative-{given[0].replace('_', '-')} needs "
                              "--speculative-algorithm (NGRAM, EAGLE3 or NEXTN)")
        return cfg
    if cfg.speculative_algorithm in DRAFT_HEADS:
        cfg = _chain(cfg)
    elif cfg.speculative_draft_model_path or cfg.speculative_num_steps:
        raise ConfigError("--speculative-draft-model-path and --speculative-num-steps are for "
                          "--speculative-algorithm EAGLE3 or NEXTN")
    if cfg.speculative_num_draft_tokens is None:
        raise ConfigError(f"--speculative-algorithm {cfg.speculative_algorithm} needs "
                          "--speculative-num-draft-tokens (the draft tokens verified per step)")
    lo, hi = (cfg.speculative_ngram_min_match_window_size,
              cfg.speculative_ngram_max_match_window_size)
    if lo > hi:
        raise ConfigError(f"--speculative-ngram-min-match-window-size ({lo}) is larger than "
                          f"--speculative-ngram-max-match-window-size ({hi})")
    # The overlap scheduler stays as configured: the engine plans one step ahead only while the
    # speculation gate has drafting paused (a drafting step needs the known tokens).
    return cfg


def _chain(cfg: Any) -> Any:
    """A chain of `--speculative-num-steps` drafts per step. SGLang counts the verified root
    in `--speculative-num-draft-tokens` (steps + 1 for a chain); both spellings are accepted
    and the scheduler's bound becomes the chain's length. NEXTN's head is the target's own MTP
    layer: its path defaults to the target's checkpoint (the worker reads it there)."""
    alg = cfg.speculative_algorithm
    if alg == "EAGLE3" and not cfg.speculative_draft_model_path:
        raise ConfigError("--speculative-algorithm EAGLE3 needs --speculative-draft-model-path "
                          "(the EAGLE-3 head's directory)")
    if alg == "NEXTN":
        _check_nextn_parallel(cfg)
    steps, k = cfg.speculative_num_steps, cfg.speculative_num_draft_tokens
    if steps is None and k is None:
        raise ConfigError(f"--speculative-algorithm {alg} needs --speculative-num-steps or "
                          "--speculative-num-draft-tokens (the draft tokens per step)")
    steps = steps or k
    if k is not None and k not in (steps, steps + 1):
        raise ConfigError(f"--speculative-num-draft-tokens {k} with --speculative-num-steps "
                          f"{steps}: a chain verifies {steps} drafts (give {steps} or, counting "
                          f"the verified token as SGLang does, {steps + 1})")
    return dataclasses.replace(cfg, speculative_num_steps=steps,
                               speculative_num_draft_tokens=steps)


def _check_nextn_parallel(cfg: Any) -> None:
    """NEXTN runs on the ranks of one node: its MTP layer is sharded as the target's layers
    (tensor / expert parallelism, data-parallel attention in lockstep). Not on several nodes
    (untested) nor with pipeline stages (the layer would need the last stage's hidden states)."""
    for flag in ("pp_size", "nnodes"):
        value = getattr(cfg, flag, None)
        if value is not None and int(value) > 1:
            raise NotSupportedError([(f"not supported yet: --speculative-algorithm NEXTN with "
                                      f"--{flag.replace('_', '-')} {value} (the MTP draft "
                                      "layer runs on the ranks of one node, without pipeline "
                                      "stages)")])


def speculative_note(cfg: Any) -> str | None:
    """The start-up log line saying speculation is on and what it turned off."""
    if cfg.speculative_algorithm is None:
        return None
    return (f"speculative decoding: {cfg.speculative_algorithm}, up to "
            f"{cfg.speculative_num_draft_tokens} draft tokens per step; "
            + ("the overlap scheduler runs while the speculation gate has drafting paused; "
               if not cfg.disable_overlap_schedule else "")
            + ("pure verify steps and the draft head's drafting after them replay CUDA graphs "
               "(triton attention, not MLA); prompt and mixed steps and the drafting after them "
               "run eagerly"
               if cfg.speculative_algorithm in DRAFT_HEADS else
               "verify steps run without CUDA graphs"))


def _apply_vllm_config(cfg: Any, spec: Any) -> Any:
    if not isinstance(spec, dict):
        raise ConfigError("--speculative-config must be a JSON object")
    unknown = sorted(set(spec) - {"method", *_VLLM_KEYS})
    if unknown:
        raise ConfigError(f"--speculative-config: {unknown[0]!r} is not supported yet "
                          f"(supported keys: method, {', '.join(_VLLM_KEYS)})")
    method = spec.get("method")
    if method not in _METHODS:
        raise ConfigError(f"--speculative-config: unknown method {method!r} "
                          f"(known: {', '.join(_METHODS)})")
    algorithm = _METHODS[method]
    if algorithm is None:
        raise NotSupportedError([(f"not supported yet: --speculative-config (method {method!r}: "
                                 "not built yet; available now: ngram, eagle3, mtp / "
                                 "deepseek_mtp)")])
    changes: dict[str, Any] = {"speculative_algorithm": algorithm}
    for key, dest in _VLLM_KEYS.items():
        if key == "model" and key in spec:
            if algorithm not in DRAFT_HEADS or not isinstance(spec[key], str):
                raise ConfigError("--speculative-config: model (a path) is for method eagle3 or "
                                  "mtp")
            changes[dest] = spec[key]
        elif key in spec:
            value = spec[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"--speculative-config: {key} must be a positive integer, "
                                  f"got {value!r}")
            changes[dest] = value
    for dest, value in changes.items():
        given = getattr(cfg, dest)
        flag_default = None if dest in ("speculative_algorithm", "speculative_num_draft_tokens") \
            else given
        if given is not None and given != value and given != flag_default:
            raise ConfigError(f"--speculative-config sets {dest} = {value!r}, but the flag says "
                              f"{given!r}")
    return dataclasses.replace(cfg, **changes)
