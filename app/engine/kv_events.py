"""KV-cache events: what this replica's prefix cache holds, published for a router.

vllm-router's `kv_aware` policy routes a request to the replica that really holds
its prefix, from events each replica publishes — not from the router's guess. The
events and their transport are vLLM's (`vllm/distributed/kv_events.py`):

- a ZMQ PUB socket (bound: the router's SUB connects), topic `b""`;
- one multipart message per step that changed the cache: `[topic, seq as 8-byte
  big-endian, msgpack([timestamp, [event, ...], data_parallel_rank])]`, seq counting
  up from 0 (a gap makes the router drop what it knows of this replica and relearn);
- events as maps tagged by `type`: `BlockStored` (new named blocks, their parent's
  name, their token ids, the block size), `BlockRemoved` (evicted names),
  `AllBlocksCleared` (the cache was reset).

The router indexes by token ids; block names only have to be stable and unique,
which the block manager's hash chain is (as unsigned 64-bit integers here).

Enabled with `--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://*:5557"}'` (vLLM's flag and keys).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("ridgeline.kv_events")

U64 = (1 << 64) - 1


def unsigned(name: int | None) -> int | None:
    return None if name is None else name & U64


@dataclass
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    topic: str = ""

    @classmethod
    def parse(cls, text: str | None) -> KVEventsConfig:
        if not text:
            return cls()
        data = json.loads(text)
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown keys {sorted(unknown)}")
        config = cls(**data)
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be zmq or null, "
                             f"got {config.publisher!r}")
        return config


@dataclass
class KVEventLog:
    """Events the block manager records during a step; the publisher sends them after."""

    block_size: int
    events: list[dict[str, Any]] = field(default_factory=list)

    def stored(self, names: list[int], parent: int | None, token_ids: list[int]) -> None:
        self.events.append({"type": "BlockStored", "block_hashes": [unsigned(n) for n in names],
                            "parent_block_hash": unsigned(parent), "token_ids": token_ids,
                            "block_size": self.block_size, "lora_id": None, "medium": "GPU",
                            "lora_name": None})

    def removed(self, names: list[int]) -> None:
        self.events.append({"type": "BlockRemoved",
                            "block_hashes": [unsigned(n) for n in names], "medium": "GPU"})

    def cleared(self) -> None:
        self.events.append({"type": "AllBlocksCleared"})

    def take(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events


class ZmqPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        import msgpack
        import zmq

        self._pack = msgpack.packb
        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, 10_000)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(config.endpoint)
        self._topic = config.topic.encode()
        self._rank = data_parallel_rank
        self._seq = 0
        log.info("publishing KV-cache events on %s", config.endpoint)

    def publish(self, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        payload = self._pack([time.time(), events, self._rank], use_bin_type=True)
        try:  # never block the event loop: a slow subscriber loses messages, not us time
            self._socket.send_multipart([self._topic, self._seq.to_bytes(8, "big"), payload],
                                        flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            log.warning("KV events dropped: the subscriber is not keeping up")
        self._seq += 1

    def close(self) -> None:
        self._socket.close(linger=0)
