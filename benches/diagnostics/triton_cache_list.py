"""The kernels in a Triton cache directory in the order they were compiled (file times), with
their warps, stages and constexprs: run a server with TRITON_CACHE_DIR set to an empty folder,
and whatever appears after its start-up log line was compiled while serving (a step that paid
for a compile). Session 13 found `_rotary_kv_kernel` compiled again at S1's first eager step
with an odd token count this way (host_copy.ALIGN).

    TRITON_CACHE_DIR=/tmp/tc python3 benches/scenarios/gpu_bench.py ...
    python3 benches/diagnostics/triton_cache_list.py /tmp/tc
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(root: str) -> None:
    rows = []
    for folder, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".json") or f.startswith("__grp__"):
                continue
            path = os.path.join(folder, f)
            try:
                with open(path) as fh:
                    meta = json.load(fh)
            except (OSError, ValueError):
                continue
            rows.append((os.path.getmtime(path), f[:-5], meta.get("num_warps"),
                         meta.get("num_stages"), str(meta.get("constants", ""))[:80]))
    for mtime, name, warps, stages, consts in sorted(rows):
        stamp = time.strftime("%H:%M:%S", time.localtime(mtime)) + f"{mtime % 1:.2f}"[1:]
        print(stamp, name, f"warps={warps} stages={stages}", consts)


if __name__ == "__main__":
    main(sys.argv[1])
