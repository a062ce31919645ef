"""A/B of the decode-step kernel fusions: GPU time of the batch-1 decode CUDA graph with the fused
kernels (rotary_embedding_write_kv, paged_decode_attention(fused_reduce=True)) vs the old path
(separate rotary + KV write, split + reduce decode kernels). Llama-3.1-8B, dummy bf16 weights,
128-token prompt. Run each mode in its own process (the old path is patched in before capture):
    python3 benches/diagnostics/decode_fusion_ab.py new; python3 benches/diagnostics/decode_fusion_ab.py old
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scenarios"))  # gpu_bench (not a package)


def use_old_path() -> None:
    """Rotary applied by the Attention layer + write_kv_to_pages, and the two-kernel decode."""
    import tokenspeed_kernels
    from tokenspeed.layers.triton_attention import TritonBackend

    TritonBackend.fuses_rope = False
    fused = tokenspeed_kernels.paged_decode_attention

    def two_kernel(*args: Any, **kw: Any) -> torch.Tensor:
        return fused(*args, **kw, fused_reduce=False)

    tokenspeed_kernels.paged_decode_attention = two_kernel  # looked up at call time by the backend


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["new", "old"])
    p.add_argument("--tokenizer", type=Path, default=Path(".carry/llama3/tokenizer.json"))
    p.add_argument("--max-context", type=int, nargs="+", default=[1024, 8192],
                   help="max_context_len values (they set the decode split count)")
    args = p.parse_args()
    if args.mode == "old":
        use_old_path()
    from gpu_bench import write_model_dir
    from tokenspeed.bench.one_batch import decode_plan, prefill_plan
    from tokenspeed.worker.model_runner import ModelRunner

    model_dir = write_model_dir(Path(tempfile.mkdtemp()), args.tokenizer, 32, {})
    for max_ctx in args.max_context:
        pages = max_ctx // 16
        runner = ModelRunner(str(model_dir), dtype="bfloat16", device="cuda", load_format="dummy", page_size=16,
                             num_pages=pages + 8, max_slots=1, max_context_len=max_ctx, cuda_graph_max_bs=1)
        out = runner.step(prefill_plan(0, [list(range(1000, 1128))], pages, []))
        tokens, pos = out.tokens, 128
        for step_id in range(1, 6):  # warm-up decode steps (graph replays)
            out = runner.step(decode_plan(step_id, tokens, pos))
            tokens, pos = out.tokens, pos + 1
        graph = runner.graphs.graphs[1]
        runs = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(50):
                graph.replay()
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) * 1e3 / 50)
        print(f"{args.mode}: max_context_len {max_ctx}, B=1, context {pos}: decode graph "
              f"{statistics.median(runs):.1f} us (runs {' '.join(f'{r:.1f}' for r in runs)})", flush=True)
        del runner, graph
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
