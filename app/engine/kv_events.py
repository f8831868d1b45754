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

Enabled with `--kv-events-config '{"enable_kv_cache_events": true}'` (vLLM's flag and
keys). The socket has no authentication and its `BlockStored` events carry every
client's prompt tokens, so it binds loopback (`tcp://127.0.0.1:5557`) unless the
endpoint names another address: a router on another host needs the address of an
interface it reaches (`"endpoint": "tcp://10.0.0.5:5557"`), and all interfaces
(`tcp://*:5557`, vLLM's default) must be asked for by name. The server logs a warning
for any endpoint beyond loopback (`exposure_warning`), an error when `--api-key` is
set, since the key does not guard this socket.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("ridgeline.kv_events")

U64 = (1 << 64) - 1
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"  # vLLM's port; loopback, not vLLM's `*`


def unsigned(name: int | None) -> int | None:
    return None if name is None else name & U64


@dataclass
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = DEFAULT_ENDPOINT
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


def reach(endpoint: str) -> str:
    """Who can subscribe: "local" (ipc, inproc, loopback), "interface" (one address or
    interface name: the hosts that reach it) or "all" (every interface)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return "local"
    host = rest.rpartition(":")[0].strip("[]")
    if host in ("*", "0.0.0.0", "::"):
        return "all"
    if host == "localhost":
        return "local"
    try:
        return "local" if ipaddress.ip_address(host).is_loopback else "interface"
    except ValueError:  # an interface name (eth0) or a host name
        return "interface"


def exposure_warning(config: KVEventsConfig, api_key_set: bool) -> tuple[int, str] | None:
    """The log level and line for an event socket that other hosts can subscribe to."""
    if not config.enable_kv_cache_events or config.publisher != "zmq":
        return None
    where = reach(config.endpoint)
    if where == "local":
        return None
    scope = "every interface" if where == "all" else "a non-loopback address"
    line = (f"KV-cache events are published on {config.endpoint} ({scope}): the socket is "
            "unauthenticated and its events carry the token ids of every client's prompt; "
            "any host that reaches the port can read them")
    if api_key_set:
        return logging.ERROR, line + ". --api-key does not protect this socket"
    return logging.WARNING, line


@dataclass
class KVEventLog:
    """Events the block manager records during a step; the publisher sends them after."""

    block_size: int
    events: list[dict[str, Any]] = field(default_factory=list)

    def stored(self, names: list[int], parent: int | None, token_ids: list[int],
               lora_id: int | None = None) -> None:
        self.events.append({"type": "BlockStored", "block_hashes": [unsigned(n) for n in names],
                            "parent_block_hash": unsigned(parent), "token_ids": token_ids,
                            "block_size": self.block_size, "lora_id": lora_id, "medium": "GPU",
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
