"""vLLM's `--tokenizer` (the tokenizer from another directory) and `--skip-tokenizer-init`
(a model directory without a tokenizer: token ids in, token ids out, text routes 400)."""

from __future__ import annotations

import shutil

import httpx
import pytest

from app.cli import build_parser
from app.config import EngineConfig
from tests.server_harness import ServerThread, assert_idle_and_clean, tiny_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "vocab.json", "merges.txt")


def without_tokenizer(src, dst):
    shutil.copytree(src, dst)
    for name in TOKENIZER_FILES:
        (dst / name).unlink(missing_ok=True)
    assert not (dst / "tokenizer.json").exists()
    return dst


@pytest.fixture(scope="module")
def bare_dir(tiny_dir, tmp_path_factory):
    return without_tokenizer(tiny_dir, tmp_path_factory.mktemp("bare") / "model")


def test_flags_parse_as_vllm_spells_them():
    a = build_parser().parse_args(["serve", "--model", "m", "--tokenizer", "/tok",
                                   "--skip-tokenizer-init"])
    assert a.tokenizer == "/tok" and a.skip_tokenizer_init is True
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        EngineConfig.from_kwargs(model="m", tokenizer="/tok", skip_tokenizer_init=True)


def test_skip_tokenizer_init_serves_token_ids_and_refuses_text(bare_dir):
    srv = ServerThread(tiny_config(bare_dir, skip_tokenizer_init=True)).start()
    try:
        ids = [1, 2, 3, 4, 5]
        r = httpx.post(srv.url + "/generate", json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}},
            timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        assert len(out["output_ids"]) == 6 and out["text"] == ""
        assert out["meta_info"]["prompt_tokens"] == 5
        r = httpx.post(srv.url + "/v1/completions", json={
            "prompt": ids, "max_tokens": 4, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {"prompt_tokens": 5, "completion_tokens": 4,
                                     "total_tokens": 9}
        refused = [
            ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]},
             "messages"),
            ("/generate", {"text": "Hello"}, "text"),
            ("/tokenize", {"prompt": "Hello"}, "prompt"),
            # what is matched or built in text cannot be honoured without one either
            ("/v1/completions", {"prompt": ids, "stop": ["a"]}, "stop"),
            ("/v1/completions", {"prompt": ids, "echo": True}, "echo"),
            ("/v1/completions", {"prompt": ids, "response_format": {"type": "json_object"}},
             "response_format"),
        ]
        for path, body, param in refused:
            r = httpx.post(srv.url + path, json=body, timeout=60)
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert "--skip-tokenizer-init" in err["message"] and err["param"] == param, err
        assert_idle_and_clean(srv)
    finally:
        srv.stop()


def test_tokenizer_from_another_directory(bare_dir, tiny_dir):
    """The model's directory has no tokenizer; `--tokenizer` names the one that does."""
    srv = ServerThread(tiny_config(bare_dir, tokenizer=str(tiny_dir))).start()
    try:
        tokens = httpx.post(srv.url + "/tokenize", json={"prompt": "Hello there"}).json()
        r = httpx.post(srv.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
            "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        srv.stop()
    from models.tokenizer import load_tokenizer

    assert tokens["tokens"] == load_tokenizer(tiny_dir).encode("Hello there",
                                                               add_special_tokens=True)
    with pytest.raises(Exception):  # noqa: B017 - without the flag there is no tokenizer
        ServerThread(tiny_config(bare_dir)).start(timeout=60)
