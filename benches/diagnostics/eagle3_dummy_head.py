#!/usr/bin/env python3
"""Writes a config-only EAGLE-3 head directory for a dummy target (default: Llama-3.1-8B, the
layout of yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: one layer, hidden 4096, draft vocabulary
32000), which `tokenspeed serve --load-format dummy --speculative-algorithm EAGLE3
--speculative-draft-model-path DIR` fills with random weights. Random drafts are rejected
(acceptance length 1.0): the run measures what drafting and verifying cost.

    python benches/diagnostics/eagle3_dummy_head.py /tmp/eagle3-head
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenspeed.bench.model_configs import LLAMA31_8B


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "eagle3-head")
    out.mkdir(parents=True, exist_ok=True)
    t = LLAMA31_8B
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "rms_norm_eps", "rope_theta", "rope_scaling", "vocab_size", "max_position_embeddings")
    cfg = {k: t[k] for k in keys if k in t} | {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "draft_vocab_size": 32000, "target_hidden_size": t["hidden_size"], "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
