"""LoRA adapters through the real HTTP server: the openai SDK's `model` picks the
adapter (text equal to PEFT's merged model's), concurrent requests for three adapters
and the base, `/v1/models`, unknown names (404), load and unload at run time as admin
operations (while requests run), bad adapters (400, the server goes on), metrics."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from app.server import ServerSettings
from tests.hf_reference import hf_greedy
from tests.lora_adapters import ATTENTION, MLP, make_adapter
from tests.server_harness import ServerThread, assert_idle_and_clean, metric, tiny_config

pytest.importorskip("peft")

NUM_TOKENS = 12
ADMIN, CLIENT = "admin-key", "client-key"
TARGETS = {"a1": ATTENTION + MLP, "a2": ["q_proj", "v_proj", "down_proj"], "a3": MLP,
           "late": ATTENTION}


@pytest.fixture(scope="module")
def built(tmp_path_factory, smollm2_dir):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("lora-server")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      initializer_range=0.2, max_position_embeddings=256, bos_token_id=1,
                      eos_token_id=2, tie_word_embeddings=False)
    base = make_tiny_hf_model(root / "base", smollm2_dir, cfg)
    hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    prompt = torch.randint(3, 49000, (20,), generator=torch.Generator().manual_seed(9)).tolist()
    expected = {None: hf_greedy(hf, prompt, NUM_TOKENS)}
    for i, (name, targets) in enumerate(TARGETS.items()):
        merged = make_adapter(base, root / "adapters" / name, targets, r=8, seed=10 + i)
        expected[name] = hf_greedy(merged, prompt, NUM_TOKENS)
    return base, root / "adapters", prompt, expected


@pytest.fixture(scope="module")
def server(built):
    base, adapters, *_ = built
    config = tiny_config(base, max_model_len=128, enable_lora=True, max_loras=3,
                         lora_modules=[f"{n}={adapters / n}" for n in ("a1", "a2", "a3")])
    srv = ServerThread(config, ServerSettings(log_stats_interval=0.05, api_key=CLIENT,
                                              admin_api_key=ADMIN)).start()
    yield srv
    srv.stop()


def headers(key: str = CLIENT) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def text_of(ids: list[int], tokenizer) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


async def complete(url: str, prompt: list[int], model: str, key: str = CLIENT):
    async with httpx.AsyncClient(timeout=120) as client:
        return await client.post(url + "/v1/completions", headers=headers(key), json={
            "model": model, "prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0,
            "ignore_eos": True})


def test_openai_sdk_model_picks_the_adapter(server, built):
    from openai import OpenAI

    _, _, prompt, expected = built
    tok = server.engine.core.tokenizer
    client = OpenAI(base_url=server.url + "/v1", api_key=CLIENT)
    for model in ("tiny", "a1", "a2", "a3"):
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=NUM_TOKENS,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert reply.model == model
        assert reply.choices[0].text == text_of(expected[None if model == "tiny" else model],
                                                tok), model


def test_concurrent_requests_for_three_adapters_and_the_base(server, built):
    _, _, prompt, expected = built
    tok = server.engine.core.tokenizer
    models = ["a1", "tiny", "a2", "a3", "a1", "tiny", "a3", "a2"]

    async def all_at_once():
        return await asyncio.gather(*(complete(server.url, prompt, m) for m in models))

    for model, reply in zip(models, asyncio.run(all_at_once())):
        assert reply.status_code == 200, reply.text
        want = expected[None if model == "tiny" else model]
        assert reply.json()["choices"][0]["text"] == text_of(want, tok), model
    assert_idle_and_clean(server)


def test_models_lists_adapters_with_their_parent(server, built):
    data = httpx.get(server.url + "/v1/models", headers=headers()).json()["data"]
    by_id = {m["id"]: m for m in data}
    assert data[0]["id"] == "tiny" and data[0]["parent"] is None
    for name in ("a1", "a2", "a3"):
        assert by_id[name]["parent"] == "tiny"
        assert by_id[name]["root"].endswith(name)


def test_unknown_model_is_a_404_in_openai_shape(server, built):
    reply = asyncio.run(complete(server.url, built[2], "nope"))
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["message"] == "The model `nope` does not exist."
    assert error["code"] == "model_not_found" and error["param"] == "model"


def test_load_and_unload_are_admin_operations(server, built):
    _, adapters, *_ = built
    body = {"lora_name": "late", "lora_path": str(adapters / "late")}
    for key, status in ((None, 401), (CLIENT, 403)):
        h = headers(key) if key else {}
        assert httpx.post(server.url + "/v1/load_lora_adapter", json=body,
                          headers=h).status_code == status
        assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "a1"},
                          headers=h).status_code == status
    assert "late" not in server.engine.core.loras.adapters


def test_load_while_requests_run_then_unload(server, built):
    """An adapter loaded while other requests stream serves exact ids at once; an unload
    while one of its requests runs is a 409 and that request finishes whole; unloaded
    after, the name is a 404 again."""
    _, adapters, prompt, expected = built
    tok = server.engine.core.tokenizer
    url = server.url

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            busy = [asyncio.create_task(complete(url, prompt, m)) for m in ("a1", "tiny")]
            load = await client.post(url + "/v1/load_lora_adapter", headers=headers(ADMIN),
                                     json={"lora_name": "late",
                                           "lora_path": str(adapters / "late")})
            first = await complete(url, prompt, "late")
            long = asyncio.create_task(client.post(url + "/v1/completions", headers=headers(),
                                                   json={"model": "late", "prompt": prompt,
                                                         "max_tokens": 100, "temperature": 0,
                                                         "ignore_eos": True}))
            while not any(r.lora_id for r in server.engine.core.scheduler.running):
                await asyncio.sleep(0.005)
            unload = await client.post(url + "/v1/unload_lora_adapter", headers=headers(ADMIN),
                                       json={"lora_name": "late"})
            return load, first, await long, unload, await asyncio.gather(*busy)

    load, first, long, unload, busy = asyncio.run(scenario())
    assert load.status_code == 200 and "added successfully" in load.text
    assert first.json()["choices"][0]["text"] == text_of(expected["late"], tok)
    assert unload.status_code == 409, unload.text  # in use: it finishes on its weights
    assert unload.json()["error"]["code"] == "adapter_in_use"
    assert long.status_code == 200 and long.json()["usage"]["completion_tokens"] == 100
    assert [r.json()["choices"][0]["text"] for r in busy] == [
        text_of(expected["a1"], tok), text_of(expected[None], tok)]
    done = httpx.post(url + "/v1/unload_lora_adapter", headers=headers(ADMIN),
                      json={"lora_name": "late"})
    assert done.status_code == 200, done.text
    assert asyncio.run(complete(url, prompt, "late")).status_code == 404
    again = httpx.post(url + "/v1/unload_lora_adapter", headers=headers(ADMIN),
                       json={"lora_name": "late"})
    assert again.status_code == 404
    assert_idle_and_clean(server)


def test_bad_adapters_are_400_and_the_server_goes_on(server, built, tmp_path):
    _, adapters, prompt, expected = built
    tok = server.engine.core.tokenizer
    cases = [({"lora_name": "x", "lora_path": "/etc"}, "outside the directories"),
             ({"lora_name": "x", "lora_path": str(adapters / "missing")}, "not a directory"),
             ({"lora_name": "a1", "lora_path": str(adapters / "a2")}, "already been loaded"),
             ({"lora_name": "tiny", "lora_path": str(adapters / "a2")}, "base model"),
             ({"lora_name": "x"}, "lora_path"),
             ({"lora_name": "x", "lora_path": str(adapters / "a2") + "\x00/etc"}, "NUL byte")]
    for body, why in cases:
        reply = httpx.post(server.url + "/v1/load_lora_adapter", json=body,
                           headers=headers(ADMIN))
        assert reply.status_code == 400, (body, reply.text)
        assert why in reply.json()["error"]["message"], reply.text
        assert reply.json()["error"]["param"] in ("lora_path", "lora_name"), reply.text
    reply = asyncio.run(complete(server.url, prompt, "a2"))
    assert reply.json()["choices"][0]["text"] == text_of(expected["a2"], tok)


def test_metrics_say_which_adapters_run(server, built):
    text = httpx.get(server.url + "/metrics").text
    assert metric(text, "lora_requests_info", 'max_lora="3"') > 0
    assert 'running_lora_adapters=""' in text  # idle now


def test_bench_serve_spreads_requests_over_adapters(server, tmp_path):
    """`ridgeline bench serve --lora-modules a1 a2 a3`: every request names one of them,
    all succeed, and the server ran requests of more than one adapter."""
    import json

    from app.cli import main

    seen: set[int] = set()
    core = server.engine.core
    schedule = core.schedule

    def spy():
        step = schedule()
        if step is not None:
            seen.update(step.batch.lora_ids)
        return step

    server.call(setattr, core, "schedule", spy)
    try:
        code = main(["bench", "serve", "--base-url", server.url, "--api-key", CLIENT,
                     "--num-prompts", "12", "--input-len", "16", "--output-len", "4",
                     "--ignore-eos", "--max-concurrency", "6", "--lora-modules", "a1", "a2",
                     "a3", "--no-plots", "--result-dir", str(tmp_path),
                     "--metrics-interval", "0.1"])
    finally:
        server.call(delattr, core, "schedule")
    assert code == 0
    r = json.loads((tmp_path / "serve.json").read_text())
    assert r["completed"] == 12 and r["failed"] == 0
    assert len(seen - {0}) >= 2
