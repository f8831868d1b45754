"""The KV-event socket carries every client's prompt tokens without authentication: by
default only this host may subscribe, and exposing it is a choice the server warns about."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from app.config import EngineConfig, ServerSettings
from app.engine.kv_events import DEFAULT_ENDPOINT, KVEventsConfig, ZmqPublisher, reach
from app.server.app import build_app

zmq = pytest.importorskip("zmq")


def _non_loopback_address() -> str | None:
    """This host's address on its default route, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: it picks the interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def _receives(endpoint: str, pub: ZmqPublisher, timeout: float = 1.5) -> bool:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # PUB drops until the subscription arrives
            pub.publish([{"type": "AllBlocksCleared"}])
            if sub.poll(50):
                return True
        return False
    finally:
        sub.close()


def test_the_default_endpoint_binds_loopback_only():
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true}')
    assert config.endpoint == DEFAULT_ENDPOINT
    try:
        pub = ZmqPublisher(config)
    except zmq.ZMQError as e:  # the port is another process's: check the same host on 0
        if e.errno != zmq.EADDRINUSE:
            raise
        config.endpoint = DEFAULT_ENDPOINT.rsplit(":", 1)[0] + ":*"
        pub = ZmqPublisher(config)
    try:
        bound = pub._socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        assert bound.startswith("tcp://127.0.0.1:"), bound
        port = bound.rsplit(":", 1)[1]
        assert _receives(f"tcp://127.0.0.1:{port}", pub)
        other = _non_loopback_address()
        if other is not None:  # another host would connect through this address
            assert not _receives(f"tcp://{other}:{port}", pub)
    finally:
        pub.close()


@pytest.mark.parametrize("endpoint, expected", [
    ("tcp://127.0.0.1:5557", "local"), ("tcp://localhost:5557", "local"),
    ("tcp://[::1]:5557", "local"), ("ipc:///tmp/kv", "local"),
    ("tcp://*:5557", "all"), ("tcp://0.0.0.0:5557", "all"), ("tcp://[::]:5557", "all"),
    ("tcp://10.0.0.5:5557", "interface"), ("tcp://eth0:5557", "interface"),
])
def test_reach_of_an_endpoint(endpoint, expected):
    assert reach(endpoint) == expected


def _start_log(kv_events_config: str | None, api_key: str | None, caplog) -> list:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ridgeline.server"):
        build_app(EngineConfig.from_kwargs(kv_events_config=kv_events_config),
                  ServerSettings(api_key=api_key))
    return [r for r in caplog.records if "KV-cache events" in r.getMessage()]


def test_exposing_the_socket_is_warned_about_louder_with_an_api_key(caplog):
    assert _start_log('{"enable_kv_cache_events": true}', "k", caplog) == []
    assert _start_log(None, "k", caplog) == []
    everywhere = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'
    (plain,) = _start_log(everywhere, None, caplog)
    assert plain.levelno == logging.WARNING and "unauthenticated" in plain.getMessage()
    assert "prompt" in plain.getMessage()
    (keyed,) = _start_log(everywhere, "k", caplog)
    assert keyed.levelno == logging.ERROR and "--api-key" in keyed.getMessage()
    (one,) = _start_log('{"enable_kv_cache_events": true, "endpoint": "tcp://10.0.0.5:5557"}',
                        None, caplog)
    assert one.levelno == logging.WARNING
