"""Engine ids are the server's: a client-chosen `request_id` / `rid` is a label that two
clients may share, and it cannot be used to abort someone else's request. Operator
routes want `--admin-api-key` when one is set."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from app.config import ServerSettings
from tests.server_harness import ServerThread, assert_idle_and_clean, metric, tiny_config

LONG = 120  # tokens: long enough that the other client acts while this one runs


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir), ServerSettings(log_stats_interval=0)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir), ServerSettings(
        api_key="client-key", admin_api_key="admin-key", log_stats_interval=0)).start()
    yield srv
    srv.stop()


def _auth(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


class Streamed:
    """A streamed call: its first event is read at once, the rest when asked."""

    def __init__(self, client: httpx.AsyncClient, url: str, body: dict, key: str | None = None):
        self.client, self.url, self.body, self.key = client, url, body, key

    async def start(self) -> dict:
        self._cm = self.client.stream("POST", self.url, json=self.body | {"stream": True},
                                      headers=_auth(self.key))
        self.response = await self._cm.__aenter__()
        assert self.response.status_code == 200, await self.response.aread()
        self._lines = self.response.aiter_lines()
        return await self._next()

    async def _next(self) -> dict | None:
        async for line in self._lines:
            if line.startswith("data:"):
                data = line[5:].strip()
                return None if data == "[DONE]" else json.loads(data)
        return None

    async def finish(self) -> list[dict]:
        events = []
        while (event := await self._next()) is not None:
            events.append(event)
        await self._cm.__aexit__(None, None, None)
        return events


def _generate(rid: str | None = None) -> dict:
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
    return body if rid is None else body | {"rid": rid}


def _chat(request_id: str | None = None, n: int = 1) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "n": n,
            "max_tokens": LONG, "ignore_eos": True}
    return body if request_id is None else body | {"request_id": request_id}


def _finish_reasons(events: list[dict]) -> list[str]:
    return [c["finish_reason"] for e in events for c in e.get("choices", ())
            if c.get("finish_reason")]


def test_two_clients_with_the_same_request_id_are_both_served(server):
    async def main():
        async with httpx.AsyncClient(timeout=60) as a, httpx.AsyncClient(timeout=60) as b:
            first = Streamed(a, server.url + "/v1/chat/completions", _chat("order-1001"))
            await first.start()  # in flight while the second arrives
            second = await b.post(server.url + "/v1/chat/completions",
                                  json=_chat("order-1001") | {"max_tokens": 4})
            gen_first = Streamed(a, server.url + "/generate", _generate("order-1001"))
            head = await gen_first.start()
            gen_second = await b.post(server.url + "/generate", json=_generate("order-1001"))
            return await first.finish(), second, head, await gen_first.finish(), gen_second

    events, second, head, gen_events, gen_second = asyncio.run(main())
    assert second.status_code == 200, second.text  # was 400 "already in use"
    assert second.json()["choices"][0]["finish_reason"] == "length"
    assert second.json()["id"] == "chatcmpl-order-1001"  # vLLM's echo of the label
    assert _finish_reasons(events) == ["length"]
    assert gen_second.status_code == 200, gen_second.text
    assert gen_second.json()["meta_info"]["id"] == "order-1001"  # SGLang's echo
    assert head["meta_info"]["id"] == "order-1001"
    assert gen_events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(gen_events[-1]["output_ids"]) == LONG
    assert_idle_and_clean(server)


def test_another_client_cannot_abort_by_the_id_the_owner_chose(server):
    async def main():
        async with httpx.AsyncClient(timeout=60) as owner, httpx.AsyncClient(timeout=60) as other:
            gen = Streamed(owner, server.url + "/generate", _generate("order-1002"))
            chat = Streamed(owner, server.url + "/v1/chat/completions", _chat("order-1003"))
            await gen.start()
            head = await chat.start()
            tries = []
            for rid in ("order-1002", "order-1003", head["id"], "chatcmpl-order-1003",
                        "order-1003-1"):
                r = await other.post(server.url + "/abort_request", json={"rid": rid})
                tries.append((r.status_code, r.json()["aborted"]))
            return tries, await gen.finish(), await chat.finish()

    tries, gen_events, chat_events = asyncio.run(main())
    assert tries == [(200, False)] * 5
    assert gen_events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(gen_events[-1]["output_ids"]) == LONG
    assert _finish_reasons(chat_events) == ["length"]
    assert_idle_and_clean(server)


def test_the_owner_aborts_every_choice_by_the_id_it_was_answered_with(server):
    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            chat = Streamed(c, server.url + "/v1/chat/completions", _chat(n=3))
            head = await chat.start()
            gen = Streamed(c, server.url + "/generate", _generate())
            gen_head = await gen.start()
            aborted = []
            for rid in (head["id"], gen_head["meta_info"]["id"]):
                r = await c.post(server.url + "/abort_request", json={"rid": rid})
                aborted.append(r.json()["aborted"])
            return aborted, await chat.finish(), await gen.finish()

    aborted, chat_events, gen_events = asyncio.run(main())
    assert aborted == [True, True]
    assert sorted(_finish_reasons(chat_events)) == ["abort"] * 3
    assert gen_events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(gen_events[-1]["output_ids"]) < LONG
    assert_idle_and_clean(server)


def test_operator_routes_want_the_admin_key(keyed):
    url = keyed.url
    reset = url + "/reset_prefix_cache"
    assert httpx.post(reset).status_code == 401
    assert httpx.post(reset, headers=_auth("wrong")).status_code == 401
    denied = httpx.post(reset, headers=_auth("client-key"))
    assert denied.status_code == 403
    assert denied.json()["error"]["type"] == "permission_error"
    assert set(denied.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.post(reset, headers=_auth("admin-key")).status_code == 200
    # the admin key opens the client routes too; the client key still works there
    for key in ("client-key", "admin-key"):
        assert httpx.get(url + "/v1/models", headers=_auth(key)).status_code == 200
    assert httpx.get(url + "/v1/models").status_code == 401
    everything = {"abort_all": True}
    assert httpx.post(url + "/abort_request", json=everything).status_code == 401
    r = httpx.post(url + "/abort_request", json=everything, headers=_auth("client-key"))
    assert r.status_code == 403 and r.json()["error"]["param"] == "abort_all"


@pytest.mark.parametrize("scheme,ok", [("Bearer", True), ("bearer", True), ("BEARER", True),
                                       ("Basic", False), ("", False)])
def test_the_bearer_scheme_is_case_insensitive(keyed, scheme, ok):
    """RFC 9110: an auth scheme matches whatever its case (clients send `bearer`); the
    key itself is compared exactly, and another scheme carrying the key is refused."""
    for value in (f"{scheme} client-key".strip(), f"{scheme}  client-key".strip()):
        got = httpx.get(keyed.url + "/v1/models", headers={"Authorization": value})
        assert got.status_code == (200 if ok else 401), (value, got.text)
    wrong = httpx.get(keyed.url + "/v1/models", headers={"Authorization": "bearer CLIENT-KEY"})
    assert wrong.status_code == 401


def test_the_prefix_cache_is_scoped_by_the_key_and_the_salt(server):
    """Tenants stay apart: the same prompt under another key (or another cache_salt)
    finds none of the first one's cached blocks; under the same key it does."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 12

    def hits_of(key: str, salt: str | None = None) -> float:
        before = metric(httpx.get(server.url + "/metrics").text, "prefix_cache_hits_total")
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
        reply = httpx.post(server.url + "/v1/completions", headers=_auth(key),
                           json=body if salt is None else body | {"cache_salt": salt})
        assert reply.status_code == 200, reply.text
        return metric(httpx.get(server.url + "/metrics").text, "prefix_cache_hits_total") - before

    hits_of("tenant-a")
    assert hits_of("tenant-a") > 0
    assert hits_of("tenant-b") == 0
    assert hits_of("tenant-a", salt="private") == 0
    assert_idle_and_clean(server)


def test_the_admin_aborts_by_a_label_and_aborts_all(keyed):
    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            by_label = Streamed(c, keyed.url + "/generate", _generate("order-7"), "client-key")
            await by_label.start()
            as_client = await c.post(keyed.url + "/abort_request", json={"rid": "order-7"},
                                     headers=_auth("client-key"))
            as_admin = await c.post(keyed.url + "/abort_request", json={"rid": "order-7"},
                                    headers=_auth("admin-key"))
            labelled = await by_label.finish()
            rest = [Streamed(c, keyed.url + "/v1/chat/completions", _chat(), "client-key")
                    for _ in range(2)]
            for s in rest:
                await s.start()
            everything = await c.post(keyed.url + "/abort_request", json={"abort_all": True},
                                      headers=_auth("admin-key"))
            return (as_client.json()["aborted"], as_admin.json()["aborted"], labelled,
                    everything.json()["aborted"], [await s.finish() for s in rest])

    as_client, as_admin, labelled, everything, rest = asyncio.run(main())
    assert (as_client, as_admin) == (False, True)
    assert labelled[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert everything is True
    assert [_finish_reasons(e) for e in rest] == [["abort"], ["abort"]]
    assert_idle_and_clean(keyed)


def test_without_an_admin_key_nobody_aborts_all_or_by_label(server):
    r = httpx.post(server.url + "/abort_request", json={"abort_all": True})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    assert httpx.post(server.url + "/abort_request", json={}).status_code == 400
    # the operator route stays open on a key-less server, as before
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 200
