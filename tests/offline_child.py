"""A process that runs `tokenspeed.LLM` on CPU for test_offline.py's lifetime tests: it prints
one JSON line (its worker pids, its shared-memory names), then, by mode:
  exit:   generates, then exits without calling shutdown (interpreter exit cleans up)
  sigint: generates until the parent's SIGINT (Ctrl-C) ends it
  crash:  a worker is killed while it generates: prints the exception the caller gets
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from tokenspeed import LLM, SamplingParams


def main(mode: str) -> int:
    # Ctrl-C as at a terminal: a test run started in the background (`cmd &`, nohup) hands its
    # children SIGINT ignored, and Python then keeps it ignored, so the SIGINT never arrives.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    llm = LLM(device="cpu", max_total_tokens=4096, max_running_requests=8)
    group = llm.engine.group
    print(json.dumps({"pid": os.getpid(), "workers": [p.pid for p in group.workers],
                      "channels": group.channel_names}), flush=True)
    if mode == "exit":
        out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        print(json.dumps({"text": out[0].outputs[0].text}), flush=True)
        return 0
    if mode == "sigint":
        import faulthandler

        faulthandler.dump_traceback_later(60, exit=False)  # stacks in the log if it hangs
        print(json.dumps({"generating": True}), flush=True)
        llm.generate(["Count to one thousand:"] * 4, SamplingParams(max_tokens=4000, ignore_eos=True),
                     use_tqdm=False)
        return 0
    if mode == "crash":  # a worker dies while requests run
        import threading

        threading.Timer(1.0, os.kill, (group.workers[0].pid, signal.SIGKILL)).start()
        started = time.monotonic()
        try:
            llm.generate(["Hello"] * 4, SamplingParams(max_tokens=4000, ignore_eos=True), use_tqdm=False)
        except Exception as e:  # noqa: BLE001 - reporting what the caller sees
            print(json.dumps({"error": type(e).__name__, "message": str(e),
                              "after_s": time.monotonic() - started}), flush=True)
            return 0
        print(json.dumps({"error": None}), flush=True)
        return 1
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
