"""WorkerChannel (tokenspeed._core) against a real shm segment written by the test writer."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

try:
    from tokenspeed import _core
except ImportError:  # a standalone build of the binding (module `_core`)
    import _core

from tokenspeed.plan import StepPlan

KEYS = [f.name for f in dataclasses.fields(StepPlan)]
DTYPES = {f: (np.uint32 if f not in ("step_id",) else None) for f in KEYS}
DTYPES.update(
    new_temperature=np.float32, new_top_p=np.float32, new_top_k=np.int32, new_min_p=np.float32,
    new_repetition_penalty=np.float32, new_frequency_penalty=np.float32,
    new_presence_penalty=np.float32, new_seed=np.int64, sample=np.uint8,
)

PLAN = {
    "step_id": 42,
    "finished_slots": [3],
    "new_slots": [5, 6],
    "new_temperature": [0.0, 0.7],
    "new_top_p": [1.0, 0.9],
    "new_top_k": [-1, 40],
    "new_min_p": [0.0, 0.05],
    "new_repetition_penalty": [1.0, 1.1],
    "new_frequency_penalty": [0.0, 0.5],
    "new_presence_penalty": [0.0, 0.25],
    "new_seed": [-1, 1234],
    "new_top_logprobs": [0, 5],
    "pt_slots": [5, 6],
    "pt_first": [0, 0],
    "pt_count": [2, 1],
    "pt_pages": [10, 11, 12],
    "slots": [5, 6, 1],
    "num_tokens": [3, 2, 1],
    "start_pos": [0, 0, 17],
    "sample": [1, 0, 1],
    "input_ids": [1, 2, 3, 4, 5, 99],
}


@pytest.fixture
def name(request):
    return f"ts-pytest-{os.getpid()}-{request.node.name}"[:200]


def test_recv_gives_zero_copy_views_with_plan_py_keys(name):
    w = _core.create_test_writer(name, 1)
    ch = _core.WorkerChannel.attach(name, 0)
    w.send_plan_json(json.dumps(PLAN))
    d = ch.recv(1000)
    assert list(d) == KEYS
    assert d["step_id"] == 42
    for k, v in PLAN.items():
        if k == "step_id":
            continue
        arr = d[k]
        assert arr.dtype == DTYPES[k], k
        assert not arr.flags.owndata and not arr.flags.writeable, k
        assert isinstance(arr.base, memoryview), k
        np.testing.assert_allclose(arr, np.asarray(v, dtype=DTYPES[k]), err_msg=k)
    plan = StepPlan.from_dict(d)
    assert plan.input_ids.tolist() == PLAN["input_ids"]
    # Rank 0 answers; the writer decodes it (padding dropped).
    slots = np.array([5, 1], np.uint32)
    tokens = np.array([7, 8], np.uint32)
    lps = np.array([-0.5, -1.0], np.float32)
    top_ids = np.array([[7, 9], [8, 0xFFFFFFFF]], np.uint32)
    top_lps = np.array([[-0.5, -2.0], [-1.0, -np.inf]], np.float32)
    ch.send_results(42, slots.tobytes(), tokens.tobytes(), lps.tobytes(), top_ids.tobytes(),
                    top_lps.tobytes(), 2)
    r = w.recv_result(1000)
    assert r["step_id"] == 42 and r["slots"] == [5, 1] and r["tokens"] == [7, 8]
    assert r["top_ids"] == [[7, 9], [8]]
    assert r["top_logprobs"] == [[-0.5, -2.0], [-1.0]]
    w.close()


def test_empty_plan_and_defaults(name):
    w = _core.create_test_writer(name, 1)
    ch = _core.WorkerChannel.attach(name, 0)
    w.send_plan_json(json.dumps({"step_id": 1, "new_slots": [2]}))
    d = ch.recv(1000)
    assert d["input_ids"].shape == (0,) and d["sample"].shape == (0,)
    assert d["new_top_k"].tolist() == [-1] and d["new_seed"].tolist() == [-1]
    assert d["new_temperature"].tolist() == [1.0]


def test_timeout_and_shutdown(name):
    w = _core.create_test_writer(name, 1)
    ch = _core.WorkerChannel.attach(name, 0)
    t = time.monotonic()
    assert ch.recv(50) is None
    assert 0.04 < time.monotonic() - t < 2
    assert ch.server_alive() and not ch.is_shutdown()
    threading.Timer(0.1, w.shutdown).start()
    with pytest.raises(_core.ChannelShutdown):
        ch.recv(None)
    assert ch.is_shutdown()


def test_recv_releases_the_gil(name):
    _w = _core.create_test_writer(name, 1)
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
    assert ticks > 20


def test_errors(name):
    w = _core.create_test_writer(name, 2, slots=2, slot_bytes=256)
    with pytest.raises(ValueError):
        _core.WorkerChannel.attach(name, 2)
    r1 = _core.WorkerChannel.attach(name, 1)
    with pytest.raises(ValueError):  # rank 1 sends no results
        r1.send_results(0, b"", b"", b"", b"", b"", 0)
    with pytest.raises(ValueError):  # does not fit a 256-byte slot
        w.send_plan_json(json.dumps({"input_ids": list(range(1000))}))
    with pytest.raises(OSError):
        _core.WorkerChannel.attach(name + "-missing", 0)
    r0 = _core.WorkerChannel.attach(name, 0)
    with pytest.raises(ValueError):  # inconsistent lengths
        r0.send_results(0, b"\0" * 8, b"\0" * 4, b"\0" * 8, b"", b"", 0)


CHILD = textwrap.dedent("""
    import sys
    sys.path[:0] = {path!r}
    try:
        from tokenspeed import _core
    except ImportError:
        import _core
    import numpy as np
    ch = _core.WorkerChannel.attach({name!r}, {rank}, timeout_ms=10000)
    while True:
        try:
            d = ch.recv(10000)
        except _core.ChannelShutdown:
            break
        assert d["input_ids"].tolist() == [d["step_id"]] * 3, d
        if {rank} == 0:
            n = len(d["slots"])
            ch.send_results(d["step_id"], d["slots"].tobytes(), (d["slots"] * 2).tobytes(),
                            np.zeros(n, np.float32).tobytes(), b"", b"", 0)
""")


def test_two_ranks_in_child_processes(name):
    w = _core.create_test_writer(name, 2, slots=4)
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD.format(path=sys.path, name=name, rank=r)])
        for r in range(2)
    ]
    for step in range(200):
        plan = {"step_id": step, "slots": [step % 5], "num_tokens": [3], "start_pos": [0],
                "sample": [True], "input_ids": [step] * 3}
        w.send_plan_json(json.dumps(plan))
        r = w.recv_result(10000)
        assert r["step_id"] == step and r["tokens"] == [2 * (step % 5)]
    assert w.reader_alive(0) and w.reader_alive(1)
    w.close()
    for p in procs:
        assert p.wait(10) == 0


def test_views_outlive_the_channel_object(name):
    import gc

    w = _core.create_test_writer(name, 1)
    ch = _core.WorkerChannel.attach(name, 0)
    w.send_plan_json(json.dumps(PLAN))
    d = ch.recv(1000)
    del ch
    w.close()
    gc.collect()
    assert d["input_ids"].tolist() == PLAN["input_ids"]  # still mapped: no crash


def test_last_sampled_constant_matches_the_rust_core():
    from tokenspeed.plan import LAST_SAMPLED

    assert _core.LAST_SAMPLED == LAST_SAMPLED == 2**32 - 1
