"""A checkpoint's generation_config.json fills the sampling values a request leaves
unset (vLLM's behaviour); a request's own values win."""

from __future__ import annotations

import json
import shutil

import httpx

from tests.server_harness import ServerThread, tiny_config


def test_checkpoint_defaults_fill_what_the_request_leaves_unset(tiny_dir, tmp_path):
    model = tmp_path / "greedy-by-default"
    shutil.copytree(tiny_dir, model)
    (model / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "temperature": 0.0, "repetition_penalty": 1.0}))
    srv = ServerThread(tiny_config(model)).start()
    try:
        def text(**body):
            r = httpx.post(srv.url + "/v1/completions", json={
                "prompt": "Once upon", "max_tokens": 12, "ignore_eos": True, **body})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        greedy = text(temperature=0)
        assert text() == greedy == text()  # unset: the checkpoint's temperature 0
        sampled = {text(temperature=1.0, seed=s) for s in range(4)}
        assert len(sampled) > 1  # the request's own temperature wins
    finally:
        srv.stop()
