"""KV-cache events for vllm-router: what the block manager records, and the wire format
the router accepts (vLLM's: `[topic, seq, msgpack([ts, [tagged maps], rank])]`)."""

from __future__ import annotations

import time

import pytest

from app.engine.kv_blocks import BlockManager
from app.engine.kv_events import KVEventLog, KVEventsConfig, ZmqPublisher, unsigned

BS = 4


def named(bm: BlockManager, rid: str, seq: list[int]) -> list[int]:
    names: list[int] = []
    bm.block_names(lambda a, b: seq[a:b], names, len(seq))
    bm.allocate(rid, len(seq), bm.match_prefix(names[: (len(seq) - 1) // BS]))
    bm.register(rid, names, 0, len(seq) // BS, lambda a, b: seq[a:b])
    return names


def test_stores_chain_by_parent_and_carry_their_tokens():
    bm = BlockManager(16, BS)
    bm.events = KVEventLog(BS)
    a = list(range(1, 13))  # three full blocks
    names = named(bm, "a", a)
    (stored,) = bm.events.take()
    assert stored["type"] == "BlockStored" and stored["block_size"] == BS
    assert stored["block_hashes"] == [unsigned(n) for n in names]
    assert stored["parent_block_hash"] is None and stored["token_ids"] == a
    assert all(0 <= h < 2**64 for h in stored["block_hashes"])
    b = a[:8] + [99, 98, 97, 96]  # shares two blocks, adds one
    names_b = named(bm, "b", b)
    (more,) = bm.events.take()
    assert more["block_hashes"] == [unsigned(names_b[2])]
    assert more["parent_block_hash"] == unsigned(names[1]) and more["token_ids"] == b[8:]


def test_evictions_and_resets_are_published():
    bm = BlockManager(4, BS)
    bm.events = KVEventLog(BS)
    names = named(bm, "a", list(range(1, 13)))
    bm.free("a")
    bm.events.take()
    bm.allocate("b", 8)  # one free block left: one cached block is evicted (the tail)
    (removed,) = bm.events.take()
    assert removed == {"type": "BlockRemoved", "block_hashes": [unsigned(names[2])],
                       "medium": "GPU"}
    bm.free("b")
    bm.reset_prefix_cache()
    assert bm.events.take() == [{"type": "AllBlocksCleared"}]


def test_the_zmq_publisher_speaks_vllms_wire_format():
    zmq = pytest.importorskip("zmq")
    msgpack = pytest.importorskip("msgpack")
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true, '
                                  '"endpoint": "tcp://127.0.0.1:0"}')
    pub = ZmqPublisher(config)
    endpoint = pub._socket.getsockopt(zmq.LAST_ENDPOINT).decode()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    time.sleep(0.3)  # ZMQ's slow joiner: a subscriber misses what came before it connected
    try:
        pub.publish([{"type": "AllBlocksCleared"}])
        pub.publish([])  # nothing changed: nothing sent, seq unchanged
        pub.publish([{"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}])
        assert sub.poll(5000)
        topic, seq, payload = sub.recv_multipart()
        ts, events, rank = msgpack.unpackb(payload)
        assert topic == b"" and int.from_bytes(seq, "big") == 0 and rank == 0
        assert events == [{"type": "AllBlocksCleared"}] and ts > 0
        assert sub.poll(5000)
        assert int.from_bytes(sub.recv_multipart()[1], "big") == 1
    finally:
        sub.close(linger=0)
        pub.close()


def test_config_is_checked():
    assert not KVEventsConfig.parse(None).enable_kv_cache_events
    with pytest.raises(ValueError, match="unknown keys"):
        KVEventsConfig.parse('{"enable": true}')
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig.parse('{"publisher": "kafka"}')
