#!/usr/bin/env python3
"""What EAGLE-3 drafting alone costs per step (worker/draft_chain.py `ChainDrafter.propose`: the
head over the step's verified rows, then the chain), at batch 1 / 8 / 32, on whatever device
is here. Target: Llama-3.1-8B with dummy weights (`--model smollm2` for a quick CPU run), a
random one-layer head of the public layout (benches/diagnostics/eagle3_dummy_head.py's config),
`--context` prompt tokens per request; the timed step is a verify step of every request (its
last token and the head's `--steps` drafts; random drafts are rejected, so one verified row
per request, as at acceptance length 1).

Columns: draft = propose() wall time (synced: it ends with the drafts' device → host copy),
through the head's CUDA graphs where they are captured (worker/draft_graph.py; a GPU with the
triton backend); eager = the same with the graphs off; head = eager with a chain of 1 (the
verified rows' head forward and the first draft), so chain = eager - head; step = the whole
verify step (target forward, sampling, verification, drafting) for scale. Medians over `--reps`.

    python benches/diagnostics/eagle3_draft_cost.py                      # GPU: 8B, batch 1 8 32
    python benches/diagnostics/eagle3_draft_cost.py --layers 8 --context 64 --reps 3   # CPU

The script only calls `ModelRunner.launch` and `drafter.propose`, so the same file run in an
older checkout times that checkout's drafting (before/after comparisons on one machine).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenspeed.bench.model_configs import LLAMA31_8B, SMOLLM2_135M
from tokenspeed.bench.one_batch import median_wall_ms, prefill_plan
from tokenspeed.worker.draft_chain import DraftSpec
from tokenspeed.worker.model_runner import ModelRunner
from tokenspeed.worker.plan import StepPlan

PAGE = 16


def write_dirs(root: Path, model: dict[str, Any], layers: int) -> tuple[Path, Path]:
    """A config-only target (dummy weights) and a config-only EAGLE-3 head for it."""
    target, head = root / "target", root / "head"
    target.mkdir()
    head.mkdir()
    (target / "config.json").write_text(json.dumps({**model, "num_hidden_layers": layers}))
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "rms_norm_eps", "rope_theta", "rope_scaling", "vocab_size",
            "max_position_embeddings")
    (head / "config.json").write_text(json.dumps({k: model[k] for k in keys if k in model} | {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "draft_vocab_size": min(32000, model["vocab_size"]), "hidden_act": "silu",
        "target_hidden_size": model["hidden_size"], "tie_word_embeddings": False}))
    return target, head


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["llama31-8b", "smollm2"], default=None,
                   help="default: llama31-8b on a GPU, smollm2 on the CPU")
    p.add_argument("--layers", type=int, default=None, help="target layers (default: the model's)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=3, help="draft tokens per step (the chain)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--attention-backend", default=None)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    args.model = args.model or ("llama31-8b" if cuda else "smollm2")
    model = LLAMA31_8B if args.model == "llama31-8b" else SMOLLM2_135M
    target, head = write_dirs(Path(tempfile.mkdtemp()), model, args.layers or model["num_hidden_layers"])
    max_bs, ctx = max(args.batch_sizes), args.context + 4 * args.steps + 8
    pps = -(-ctx // PAGE)
    runner = ModelRunner(str(target), dtype="bfloat16" if cuda else "float32",
                         device="cuda" if cuda else "cpu", load_format="dummy", page_size=PAGE,
                         num_pages=max_bs * pps, max_slots=max_bs, max_context_len=ctx,
                         attention_backend=args.attention_backend,
                         draft=DraftSpec("EAGLE3", str(head), args.steps))
    drafter = runner.drafter
    assert drafter is not None
    seen: list[tuple] = []
    propose = drafter.propose

    def recording(plan: StepPlan, aux: torch.Tensor, out: Any) -> list[np.ndarray]:
        seen[:] = [(plan.copy(), aux, out)]
        return propose(plan, aux, out)

    drafter.propose = recording  # type: ignore[method-assign]
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, {args.model} "
          f"({args.layers or model['num_hidden_layers']} layers), backend {runner.attention_backend}, "
          f"context {args.context}, chain of {args.steps}, draft graphs "
          f"{'none' if getattr(drafter, 'graphs', None) is None else drafter.graphs.sizes}")
    print(f"{'batch':>5} {'draft ms':>9} {'eager ms':>9} {'head ms':>8} {'chain ms':>9} "
          f"{'step ms':>8}")
    live: list[int] = []
    for step_id, bs in enumerate(args.batch_sizes):
        prompts = [[(7 * i + 13 * s) % 30000 + 100 for i in range(args.context)] for s in range(bs)]
        out = runner.launch(prefill_plan(2 * step_id, prompts, pps, live)).wait()
        live = list(range(bs))
        assert out.draft_tokens is not None
        plan = StepPlan.build(2 * step_id + 1, scheduled=[
            (s, args.context, [int(out.tokens[s]), *out.draft_tokens[s].tolist()], True,
             len(out.draft_tokens[s])) for s in range(bs)])
        step = median_wall_ms(lambda plan=plan: runner.launch(plan).wait(), args.reps, sync)
        again = (lambda rec=seen[0]: propose(*rec))  # the last step's drafting, again
        draft = median_wall_ms(again, args.reps, sync)
        graphs = getattr(drafter, "graphs", None)  # (older checkouts have none)
        drafter.graphs = None  # the eager drafting, whole, then with a chain of 1
        eager = median_wall_ms(again, args.reps, sync)
        drafter.num_steps = 1
        head_ms = median_wall_ms(again, args.reps, sync)
        drafter.num_steps, drafter.graphs = args.steps, graphs
        print(f"{bs:>5} {draft:>9.3f} {eager:>9.3f} {head_ms:>8.3f} {eager - head_ms:>9.3f} "
              f"{step:>8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
