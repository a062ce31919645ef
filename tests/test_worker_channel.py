"""WorkerChannel (tokenspeed._core) against a real shm segment written by a PlanWriter (the channel's writing end):
plans and results round-trip through the Rust codec into numpy views, named and typed by the
schema `_core` declares."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from tokenspeed import _core
from tokenspeed.worker.plan import NEUTRAL_SAMPLING, PLAN_DTYPES, RESULT_DTYPES, StepOutput, StepPlan

PlanWriter = _core.PlanWriter


@pytest.fixture
def name(request):
    return f"ts-pytest-{os.getpid()}-{request.node.name}"[:200]


def random_plan(rng: np.random.Generator, step_id: int) -> StepPlan:
    """A plan with every section filled with random rows (list fields of random lengths)."""
    def ids(n: int) -> list[int]:
        return rng.integers(0, 2**32, n, dtype=np.uint64).tolist()

    new = [{"slot": int(rng.integers(0, 256)), "temperature": float(rng.random()),
            "top_p": float(rng.random()), "top_k": int(rng.integers(-1, 100)),
            "min_p": float(rng.random()), "repetition_penalty": float(rng.random() + 0.5),
            "frequency_penalty": float(rng.random()), "presence_penalty": float(rng.random()),
            "seed": int(rng.integers(-1, 2**62)), "top_logprobs": int(rng.integers(0, 21)),
            "min_tokens": int(rng.integers(0, 9)), "stop_ids": ids(int(rng.integers(0, 4))),
            "prompt_logprobs": bool(rng.integers(0, 2)),
            "logit_bias_ids": ids(2), "logit_bias_values": [float(x) for x in rng.normal(size=2)]}
           for _ in range(int(rng.integers(0, 4)))]
    return StepPlan.build(
        step_id, finished=ids(int(rng.integers(0, 4))), new=new,
        page_tables=[(int(rng.integers(0, 256)), int(rng.integers(0, 64)), ids(int(rng.integers(0, 6))))
                     for _ in range(int(rng.integers(0, 4)))],
        copies=[(int(rng.integers(0, 999)), int(rng.integers(0, 999)), int(rng.integers(0, 3)))
                for _ in range(int(rng.integers(0, 3)))],
        scheduled=[(int(rng.integers(0, 256)), int(rng.integers(0, 4096)),
                    ids(int(rng.integers(1, 9))), bool(rng.integers(0, 2)))
                   for _ in range(int(rng.integers(0, 5)))])


def test_every_plan_section_round_trips_into_zero_copy_numpy_views(name):
    w = PlanWriter.create(name, 1)
    ch = _core.WorkerChannel.attach(name, 0)
    rng = np.random.default_rng(0)
    for step in range(50):
        sent = random_plan(rng, step)
        w.send_plan(step, sent.arrays())
        d = ch.recv(1000)
        assert d["step_id"] == step
        assert set(d) - {"step_id"} == set(PLAN_DTYPES)
        for key, dtype in PLAN_DTYPES.items():
            arr = d[key]
            assert arr.dtype == dtype, key
            assert not arr.flags.owndata and not arr.flags.writeable, key
            np.testing.assert_array_equal(arr, getattr(sent, key), err_msg=key)
    w.close()


def test_results_round_trip_per_request_events(name):
    w = PlanWriter.create(name, 1)
    ch = _core.WorkerChannel.attach(name, 0)
    w.send_plan(1, StepPlan.build(1).arrays())
    assert ch.recv(1000) is not None
    # Two events: slot 5 asked for 2 top logprobs, slot 1 for none (its padding is cut).
    out = StepOutput(slots=np.array([5, 1]), tokens=np.array([7, 8]), logprobs=np.array([-0.5, -1.0]),
                     top_ids=np.array([[7, 9], [8, 3]]), top_logprobs=np.array([[-0.5, -2.0], [-1.0, -3.0]]),
                     top_k=np.array([2, 0]))
    ch.send_result(42, out.arrays())
    r = w.recv_result(1000)
    assert r["step_id"] == 42
    got = {k: np.frombuffer(v, RESULT_DTYPES[k]).tolist() for k, v in r.items() if k != "step_id"}
    assert got["event_slot"] == [5, 1] and got["event_tokens"] == [7, 8]
    assert got["event_tokens_len"] == [1, 1] and got["event_top_k"] == [2, 0]
    assert got["event_top_ids"] == [7, 9] and got["event_top_ids_len"] == [2, 0]
    assert got["event_top_logprobs"] == [-0.5, -2.0]
    # Several accepted tokens for one event, none for another, and an error code.
    arrays = {"event_slot": np.array([3, 4], np.uint32).tobytes(),
              "event_error": np.array([0, 1], np.uint32).tobytes(),
              "event_tokens_len": np.array([3, 0], np.uint32).tobytes(),
              "event_tokens": np.array([10, 11, 12], np.uint32).tobytes()}
    ch.send_result(43, arrays)
    r = w.recv_result(1000)
    assert np.frombuffer(r["event_tokens"], np.uint32).tolist() == [10, 11, 12]
    assert np.frombuffer(r["event_error"], np.uint32).tolist() == [0, 1]
    # Prompt logprobs: on slot 5's sampled event, and as a token-less event for slot 9's chunk.
    from tokenspeed.worker.prompt_logprobs import PromptLogprobs
    prompt = {5: PromptLogprobs(np.array([-1.0, -2.0]), np.array([[4, 6], [1, 2]]),
                                np.array([[-0.1, -0.2], [-0.3, -0.4]]), np.array([1, 3000])),
              9: PromptLogprobs(np.array([-3.0]), np.zeros((1, 0), np.int64), np.zeros((1, 0)),
                                np.array([7]))}
    out = StepOutput(slots=np.array([5, 1]), tokens=np.array([7, 8]), logprobs=np.array([-0.5, -1.0]),
                     top_ids=np.array([[7, 9], [8, 3]]), top_logprobs=np.array([[-0.5, -2.0], [-1.0, -3.0]]),
                     top_k=np.array([2, 0]), prompt=prompt)
    ch.send_result(44, out.arrays())
    got = {k: np.frombuffer(v, RESULT_DTYPES[k]).tolist()
           for k, v in w.recv_result(1000).items() if k != "step_id"}
    assert got["event_slot"] == [5, 1, 9] and got["event_tokens_len"] == [1, 1, 0]
    assert got["event_top_k"] == [2, 0, 0] and got["event_tokens"] == [7, 8]
    assert got["event_prompt_logprobs_len"] == [2, 0, 1]
    assert got["event_prompt_logprobs"] == [-1.0, -2.0, -3.0]
    assert got["event_prompt_top_ids"] == [4, 6, 1, 2] and got["event_prompt_top_ids_len"] == [4, 0, 0]
    assert got["event_prompt_top_logprobs"] == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert got["event_prompt_ranks"] == [1, 3000, 7] and got["event_prompt_ranks_len"] == [2, 0, 1]
    w.close()


def test_neutral_sampling_and_constants_come_from_the_rust_core():
    assert NEUTRAL_SAMPLING["temperature"] == 1.0 and NEUTRAL_SAMPLING["top_k"] == -1
    assert NEUTRAL_SAMPLING["seed"] == _core.NO_SEED == -1
    lists = {n.removesuffix("_len") for n in PLAN_DTYPES if n.startswith("new_") and n.endswith("_len")}
    assert set(NEUTRAL_SAMPLING) == {n.removeprefix("new_") for n in PLAN_DTYPES
                                     if n.startswith("new_") and not n.endswith("_len")
                                     and n != "new_slot" and n not in lists}
    assert _core.LAST_SAMPLED == 2**32 - 1
    # The slot bound grows with what a step can hold.
    assert _core.slot_bytes(256, 8448, 512) > _core.slot_bytes(16, 128, 32) > 0


def test_rings_are_sized_by_max_logprobs_and_refused_when_they_cannot_fit():
    from types import SimpleNamespace

    from tokenspeed.launch.ring_size import RingSizeError, check_rings, logprobs_width

    assert [logprobs_width(m, 49152) for m in (20, 0, 100_000, -1)] == [20, 0, 49152, 49152]
    limits = (2, 34, 512)
    plain, top20, full = (_core.slot_bytes(*limits, top_logprobs=k) for k in (0, 20, 49152))
    # Each of the 36 sampled and 34 prompt tokens of a step: k (id, logprob) pairs of 8 bytes
    # (a slot holds the larger of a plan and a result: at 20 the plan may still be larger).
    assert full >= (36 + 34) * 49152 * 8 and full > top20 >= plain
    cfg = SimpleNamespace(max_logprobs=-1, chunked_prefill_size=32)
    check_rings(cfg, full, plain, 1, 2, 49152, room=None)
    check_rings(cfg, full, plain, 1, 2, 49152, room=4 * (full - plain))
    with pytest.raises(RingSizeError, match=r"--max-logprobs -1.*--chunked-prefill-size 32.*MiB free"):
        check_rings(cfg, full, plain, 1, 2, 49152, room=4 * (full - plain) - 1)
    with pytest.raises(RingSizeError, match="at most 4095 MiB"):
        check_rings(cfg, 1 << 32, plain, 1, 2, 49152, room=None)


def test_timeout_and_shutdown(name):
    w = PlanWriter.create(name, 1)
    ch = _core.WorkerChannel.attach(name, 0)
    t = time.monotonic()
    assert ch.recv(50) is None
    assert time.monotonic() - t < 10  # a liveness bound, not a timing
    assert ch.server_alive() and not ch.is_shutdown()
    threading.Timer(0.1, w.shutdown).start()
    with pytest.raises(_core.ChannelShutdown):
        ch.recv(None)
    assert ch.is_shutdown()


def test_recv_releases_the_gil(name):
    _w = PlanWriter.create(name, 1)
    ch = _core.WorkerChannel.attach(name, 0)
    ticks = 0
    stop = False

    def spin():
        nonlocal ticks
        while not stop:
            ticks += 1
            time.sleep(0.001)

    th = threading.Thread(target=spin)
    th.start()
    assert ch.recv(300) is None
    stop = True
    th.join()
    assert ticks > 0  # the other thread ran while recv waited


def test_errors(name):
    w = PlanWriter.create(name, 2, slots=2, slot_bytes=256)
    with pytest.raises(ValueError):
        _core.WorkerChannel.attach(name, 2)
    r1 = _core.WorkerChannel.attach(name, 1)
    with pytest.raises(ValueError):  # rank 1 sends no results
        r1.send_result(0, {})
    with pytest.raises(ValueError):  # does not fit a 256-byte slot
        w.send_plan(0, StepPlan.build(scheduled=[(0, 0, list(range(1000)), True)]).arrays())
    with pytest.raises(OSError):
        _core.WorkerChannel.attach(name + "-missing", 0)
    r0 = _core.WorkerChannel.attach(name, 0)
    with pytest.raises(ValueError):  # two slots but one token length
        r0.send_result(0, {"event_slot": b"\0" * 8, "event_tokens_len": b"\0" * 4})
    with pytest.raises(ValueError):  # lengths that do not add up to the values
        r0.send_result(0, {"event_slot": b"\0" * 4, "event_tokens_len": np.array([2], np.uint32).tobytes(),
                           "event_tokens": b"\0" * 4})


CHILD = textwrap.dedent("""
    import sys
    sys.path[:0] = {path!r}
    from tokenspeed import _core
    import numpy as np
    ch = _core.WorkerChannel.attach({name!r}, {rank}, timeout_ms=10000)
    while True:
        try:
            d = ch.recv(10000)
        except _core.ChannelShutdown:
            break
        assert d["sched_tokens"].tolist() == [d["step_id"]] * 3, d
        if {rank} == 0:
            n = len(d["sched_slot"])
            ch.send_result(d["step_id"], {{"event_slot": d["sched_slot"].tobytes(),
                                           "event_tokens_len": np.ones(n, np.uint32).tobytes(),
                                           "event_tokens": (d["sched_slot"] * 2).tobytes()}})
""")


def test_two_ranks_in_child_processes(name):
    w = PlanWriter.create(name, 2, slots=4)
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD.format(path=sys.path, name=name, rank=r)])
        for r in range(2)
    ]
    for step in range(200):
        w.send_plan(step, StepPlan.build(step, scheduled=[(step % 5, 0, [step] * 3, True)]).arrays())
        r = w.recv_result(10000)
        assert r["step_id"] == step
        assert np.frombuffer(r["event_tokens"], np.uint32).tolist() == [2 * (step % 5)]
    assert w.reader_alive(0) and w.reader_alive(1)
    w.close()
    for p in procs:
        assert p.wait(10) == 0


def test_views_outlive_the_channel_object(name):
    import gc

    w = PlanWriter.create(name, 1)
    ch = _core.WorkerChannel.attach(name, 0)
    plan = StepPlan.build(3, scheduled=[(1, 0, [4, 5, 6], True)])
    w.send_plan(3, plan.arrays())
    d = ch.recv(1000)
    del ch
    w.close()
    gc.collect()
    assert d["sched_tokens"].tolist() == [4, 5, 6]  # still mapped: no crash
