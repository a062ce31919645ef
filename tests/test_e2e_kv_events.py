"""KV events (--kv-events-config) end to end: a ZMQ subscriber, decoding with msgspec structs laid
out as vLLM's consumers declare them, sees BlockStored for a prompt's pages, BlockRemoved when a
small pool evicts, AllBlocksCleared after /flush_cache, and a replayed view that matches the
cached page count /get_server_info reports."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest
import zmq

from server_harness import Server, free_port, start_server, stop_server

# 16 pages of 4 tokens; each prompt 28 tokens (7 pages): the third prompt must evict.
PAGE, POOL = 4, 16
SMALL_POOL = ["--max-total-tokens", str(PAGE * POOL), "--page-size", str(PAGE),
              "--context-length", "48"]
TOPIC = "kv@test"


# The consumer's side, as vLLM's kv_events_subscriber.py and SGLang declare it.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


class Subscriber:
    """A SUB socket and the router's view: the set of block hashes the server holds."""

    def __init__(self, port: int) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.view: set[int] = set()
        self.events: list[KVCacheEvent] = []
        self.seqs: list[int] = []
        self.replay_port = 0

    def drain(self, timeout_s: float) -> None:
        """Applies every batch that arrives within `timeout_s` of the previous one."""
        while self.sock.poll(int(timeout_s * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == TOPIC.encode()
            self.seqs.append(int.from_bytes(seq, "big"))
            batch = DECODER.decode(payload)
            assert batch.data_parallel_rank == 0
            for e in batch.events:
                self.events.append(e)
                if isinstance(e, BlockStored):
                    assert e.block_size == PAGE and e.medium == "GPU"
                    assert len(e.token_ids) == PAGE * len(e.block_hashes)
                    self.view.update(e.block_hashes)
                elif isinstance(e, BlockRemoved):
                    assert set(e.block_hashes) <= self.view, "removed a block never stored"
                    self.view.difference_update(e.block_hashes)
                else:
                    self.view.clear()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Subscriber]]:
    port, replay = free_port(), free_port()
    config = {"publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": TOPIC,
              "replay_endpoint": f"tcp://*:{replay}"}
    server = start_server(str(tmp_path_factory.mktemp("kv_events")), *SMALL_POOL,
                          "--kv-events-config", json.dumps(config))
    sub = Subscriber(port)
    try:
        # A new SUB misses what is published before its subscription lands: flush until the
        # AllBlocksCleared of one flush arrives, from which on the view is exact.
        deadline = time.monotonic() + 15
        while not any(isinstance(e, AllBlocksCleared) for e in sub.events):
            assert time.monotonic() < deadline, "no AllBlocksCleared after /flush_cache"
            assert httpx.post(f"{server.url}/flush_cache", timeout=10).status_code == 200
            sub.drain(0.3)
        sub.replay_port = replay
        yield server, sub
    finally:
        stop_server(server)


def _complete(server: Server, prompt: list[int]) -> None:
    body = {"model": server.info()["served_model_name"], "prompt": prompt, "max_tokens": 1, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def _cached(server: Server, sub: Subscriber) -> int:
    """The cached pages once the events have caught up (the engine is idle after a request)."""
    sub.drain(0.5)
    return server.info()["kv_pages"]["cached"]


def test_stored_removed_and_cleared_match_the_server(served: tuple[Server, Subscriber]) -> None:
    server, sub = served
    first = len(sub.events)
    prompt = [100 + i for i in range(28)]
    _complete(server, prompt)
    assert _cached(server, sub) == len(sub.view) > 0
    stored = [e for e in sub.events[first:] if isinstance(e, BlockStored)]
    assert stored and stored[0].parent_block_hash is None
    # The pages chain in prompt order: the tokens of the stored blocks are the prompt's.
    tokens = [t for e in stored for t in e.token_ids]
    assert tokens == prompt[:len(tokens)]
    assert all(b.parent_block_hash == a.block_hashes[-1] for a, b in itertools.pairwise(stored))
    # The same prompt again hashes the same way: nothing new is stored.
    seen = len(sub.events)
    _complete(server, prompt)
    assert _cached(server, sub) == len(sub.view)
    assert not [e for e in sub.events[seen:] if isinstance(e, BlockStored)
                and not set(e.block_hashes).isdisjoint(stored[0].block_hashes)]
    # Two more distinct prompts overflow the 16-page pool: the oldest pages are evicted.
    for k in (1, 2):
        _complete(server, [1000 * k + i for i in range(28)])
    assert _cached(server, sub) == len(sub.view)
    removed = [h for e in sub.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert set(stored[0].block_hashes) & set(removed), "the first prompt's pages were evicted"
    # A flush clears the view; sequence numbers never skipped one.
    assert httpx.post(f"{server.url}/flush_cache", timeout=10).status_code == 200
    assert _cached(server, sub) == 0 and sub.view == set()
    assert isinstance(sub.events[-1], AllBlocksCleared)
    assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))


def test_replay_resends_the_buffered_batches(served: tuple[Server, Subscriber]) -> None:
    server, sub = served
    _complete(server, [7] * 12)
    sub.drain(0.5)
    # vLLM's replay protocol: [start_seq] in, every buffered [seq, payload] from there out, then
    # [-1, b""]. A DEALER reads the whole stream (a REQ would take only its first reply).
    start = sub.seqs[0]
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{sub.replay_port}")
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    seqs = []
    while True:
        assert dealer.poll(10_000), "replay stream ended without its end marker"
        _, seq, payload = dealer.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            assert payload == b""
            break
        DECODER.decode(payload)
        seqs.append(int.from_bytes(seq, "big"))
    dealer.close(linger=0)
    assert seqs == list(range(start, start + len(seqs))) and seqs[-1] >= sub.seqs[-1]


def test_bad_configs_are_refused_at_start() -> None:
    from tokenspeed.config import parse_serve_args
    from tokenspeed.config.errors import ConfigError

    def resolved(cfg: dict) -> dict | None:
        return parse_serve_args(["--kv-events-config", json.dumps(cfg)]).kv_events_config

    assert resolved({"publisher": "null"}) is None
    assert resolved({"publisher": "zmq"})["endpoint"] == "tcp://*:5557"
    for bad, says in [({"publisher": "kafka"}, "unknown publisher"),
                      ({"publisher": "zmq", "endpoint": "ipc:///tmp/kv"}, "only tcp"),
                      ({"publisher": "zmq", "hwm": 5}, "hwm 5"),
                      ({"publisher": "zmq", "buffer_steps": -1}, "buffer_steps"),
                      ({"publisher": "zmq", "bogus": 1}, "unknown key 'bogus'")]:
        with pytest.raises(ConfigError, match=says):
            resolved(bad)
