"""DNS rebinding: a server on loopback answers only Host names that mean loopback, plus
`--allowed-hosts`; anything else is a 400 in OpenAI's error shape."""

from __future__ import annotations

import httpx
import pytest

from app.config import ServerSettings
from app.server.hosts import HostCheckMiddleware, hostname
from tests.server_harness import ServerThread, tiny_config


@pytest.fixture(scope="module")
def guarded(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir), ServerSettings(
        allowed_hosts="llm.internal,*.corp.example", log_stats_interval=0)).start()
    yield srv
    srv.stop()


def _get(srv: ServerThread, path: str, host: str | None) -> httpx.Response:
    headers = {} if host is None else {"Host": host}
    return httpx.get(srv.url + path, headers=headers)


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example",
                                  "localhost.evil.example", "corp.example", "0.0.0.0:8000",
                                  "192.168.1.10"])
def test_a_foreign_host_gets_a_json_400(guarded, host):
    for path in ("/v1/models", "/health", "/metrics"):
        r = _get(guarded, path, host)
        assert r.status_code == 400, (host, path)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_host"
        assert set(error) == {"message", "type", "param", "code"}
        assert r.headers["x-request-id"]
    body = {"prompt": "hi", "max_tokens": 2}
    posted = httpx.post(guarded.url + "/v1/completions", json=body, headers={"Host": host})
    assert posted.status_code == 400


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:1234", "localhost.", "127.0.0.1",
                                  "127.0.0.1:8000", "127.1.2.3", "[::1]", "[::1]:8000",
                                  "llm.internal:443", "a.corp.example", "x.y.corp.example"])
def test_loopback_names_and_the_allow_list_are_served(guarded, host):
    r = _get(guarded, "/v1/models", host)
    assert r.status_code == 200, host


def test_real_clients_still_work(guarded):
    import openai

    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key="unused")
    out = client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
    assert out.choices[0].text is not None


def test_the_check_follows_the_listen_address_and_star_turns_it_off():
    def enabled(listen: str, allowed: str | None) -> bool:
        return HostCheckMiddleware(None, listen, allowed).enabled

    assert enabled("127.0.0.1", None) and enabled("::1", None) and enabled("localhost", None)
    assert not enabled("0.0.0.0", None) and not enabled("10.0.0.5", None)
    assert enabled("0.0.0.0", "llm.internal")  # an allow-list applies wherever we listen
    assert not enabled("127.0.0.1", "*") and not enabled("127.0.0.1", "a.example,*")
    check = HostCheckMiddleware(None, "127.0.0.1", None)
    assert check.allows(None)  # HTTP/1.0 without Host: not a browser
    assert not check.allows("evil.example")
    assert hostname("[::1]:80") == "::1" and hostname("Example.COM.:80") == "example.com"
