"""Claude Code and Codex CLI, the coding agents people point at a local server, run
against `ridgeline serve` unchanged: each completes a session in which the model calls
one of the agent's tools, the agent runs it and sends its result back, and the model
answers (`docs/api.md`, "Coding agents").

The agents come from the npm registry, installed once into `~/.cache/ridgeline/agents`
(skipped where npm or the registry is not reachable). The model is a tiny random-weight
llama of SmolLM2's vocabulary with a 64k context: the agents' first prompts run to 20k
tokens and more, and the protocol, not the model's wit, is under test. A recording proxy
between agent and server keeps every request (the fields each agent sends) and steers
the random model where a real one would go by itself, with the API's own fields: the
first request's `tool_choice` names the agent's shell tool, whose schema is narrowed to
one harmless command (`echo`, so the arguments are the ones a model would write, and the
agent really runs it), and once the tool's result is in the conversation the answer is
a short JSON object (`output_config.format`, `text.format`), so that every turn ends (a
random model given free text would run to its token limit).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from app.server.app import ServerSettings
from tests.server_harness import ServerThread, free_port, tiny_config

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

PACKAGES = ("@anthropic-ai/claude-code@2", "@openai/codex")
SHORT_ANSWER = {"type": "object", "required": ["answer"], "additionalProperties": False,
                "properties": {"answer": {"type": "string", "maxLength": 8}}}
COMMAND = "echo ridgeline-tool-ran"


def one_command(argument: str) -> dict:
    """A shell tool's schema narrowed to COMMAND (its other arguments are optional)."""
    return {"type": "object", "required": [argument], "additionalProperties": False,
            "properties": {argument: {"type": "string", "enum": [COMMAND]}}}


@pytest.fixture(scope="module")
def agents() -> Path:
    """The folder of the agents' executables, installed from npm on first use."""
    root = Path(os.environ.get("RIDGELINE_AGENTS_DIR")
                or Path.home() / ".cache" / "ridgeline" / "agents")
    bin_dir = root / "node_modules" / ".bin"
    if not all((bin_dir / name).exists() for name in ("claude", "codex")):
        if shutil.which("npm") is None:
            pytest.skip("npm is not installed: the agents come from the npm registry")
        root.mkdir(parents=True, exist_ok=True)
        try:
            done = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix",
                                   str(root), *PACKAGES], capture_output=True, text=True,
                                  timeout=600)
        except subprocess.TimeoutExpired:
            pytest.skip("npm install of the agents timed out")
        if done.returncode != 0:
            pytest.skip(f"npm install of the agents failed: {done.stderr[-500:]}")
    return bin_dir


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):
    from models.tiny import make_tiny_llama

    model = make_tiny_llama(tmp_path_factory.mktemp("tiny64k"), smollm2_dir,
                            max_position_embeddings=65536)
    srv = ServerThread(tiny_config(model, max_model_len=65536),
                       ServerSettings(log_stats_interval=0)).start(timeout=300)
    yield srv
    srv.stop()


class RecordingProxy:
    """Forwards every request to `upstream`, streaming the answer back, and records each
    request's path, headers and body beside its status; `steer` may rewrite a body."""

    def __init__(self, upstream: str, steer):
        self.upstream, self.steer, self.records = upstream, steer, []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        assert self._ready.wait(30)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw) if raw and request.content_type == "application/json" else None
        record = {"method": request.method, "path": request.path, "body": body,
                  "headers": dict(request.headers)}
        self.records.append(record)
        if isinstance(body, dict):
            body = self.steer(request.path, body)
            raw = json.dumps(body).encode()
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in ("host", "content-length")}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s, \
                s.request(request.method, self.upstream + request.path_qs, data=raw,
                          headers=headers) as upstream:
            record["status"] = upstream.status
            answer = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items()
                if k.lower() not in ("content-length", "transfer-encoding")})
            await answer.prepare(request)
            chunks = []
            async for chunk in upstream.content.iter_any():
                chunks.append(chunk)
                await answer.write(chunk)
            record["answer"] = b"".join(chunks).decode(errors="replace")
            await answer.write_eof()
            return answer

    def posts(self, path: str) -> list[dict]:
        return [r for r in self.records if r["method"] == "POST" and r["path"] == path]


def steer_claude(path: str, body: dict) -> dict:
    if path != "/v1/messages":
        return body
    results = any(isinstance(m.get("content"), list) and any(
        b.get("type") == "tool_result" for b in m["content"]) for m in body["messages"])
    if not results:
        body["tool_choice"] = {"type": "tool", "name": "Bash"}
        for tool in body["tools"]:
            if tool["name"] == "Bash":
                tool["input_schema"] = one_command("command")
    else:
        body["tool_choice"] = {"type": "none"}
        body.setdefault("output_config", {})["format"] = {"type": "json_schema",
                                                          "schema": SHORT_ANSWER}
    return body


def steer_codex(path: str, body: dict) -> dict:
    if path != "/v1/responses":
        return body
    results = any(i.get("type") == "function_call_output" for i in body["input"])
    if not results:
        body["tool_choice"] = {"type": "function", "name": "exec_command"}
        for tool in body["tools"]:
            if tool.get("name") == "exec_command":
                tool["parameters"] = one_command("cmd")
    else:
        body["tool_choice"] = "none"
        body["text"] = {"format": {"type": "json_schema", "name": "answer",
                                   "schema": SHORT_ANSWER}}
    return body


def agent_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir()
    keep = ("PATH", "LANG", "SSL_CERT_FILE", "NODE_EXTRA_CA_CERTS")
    return {**{k: os.environ[k] for k in keep if k in os.environ}, "HOME": str(home), **extra}


@pytest.mark.slow
def test_claude_code_runs_a_session_with_a_tool_call(agents, server, tmp_path):
    proxy = RecordingProxy(server.url, steer_claude)
    env = agent_env(tmp_path, ANTHROPIC_BASE_URL=proxy.url, ANTHROPIC_API_KEY="unused",
                    ANTHROPIC_MODEL="tiny", ANTHROPIC_SMALL_FAST_MODEL="tiny",
                    CLAUDE_CODE_MAX_OUTPUT_TOKENS="256", DISABLE_TELEMETRY="1",
                    CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1")
    done = subprocess.run([str(agents / "claude"), "-p", "Say hello from the shell.",
                           "--allowedTools", f"Bash({COMMAND})"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    posts = proxy.posts("/v1/messages")
    assert done.returncode == 0, (done.stdout[-1000:], done.stderr[-1000:],
                                  [(p["status"], p["answer"][:300]) for p in posts])
    assert [p["status"] for p in posts] == [200] * len(posts) and len(posts) >= 2
    first = posts[0]["body"]
    # What Claude Code always sends, accepted: its context edit, its effort, adaptive
    # thinking, a mid-conversation system message, tens of thousands of prompt tokens.
    assert first["output_config"]["effort"] and first["thinking"]["type"] == "adaptive"
    assert first["context_management"]["edits"][0]["type"].startswith("clear_thinking")
    assert any(m["role"] == "system" for m in first["messages"])
    call = next(json.loads(line.removeprefix("data: "))["content_block"]
                for line in posts[0]["answer"].splitlines()
                if line.startswith("data: ") and '"content_block_start"' in line
                and '"tool_use"' in line)
    assert call["name"] == "Bash"
    results = [b for m in posts[-1]["body"]["messages"] if isinstance(m["content"], list)
               for b in m["content"] if b.get("type") == "tool_result"]
    assert [r["tool_use_id"] for r in results] == [call["id"]]
    assert "ridgeline-tool-ran" in json.dumps(results[0]["content"])  # the command ran
    assert json.loads(done.stdout.strip())["answer"] is not None  # the last turn's answer


@pytest.mark.slow
def test_codex_runs_a_session_with_a_tool_call(agents, server, tmp_path):
    proxy = RecordingProxy(server.url, steer_codex)
    codex_home = tmp_path / "codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(
        'model = "tiny"\nmodel_provider = "ridgeline"\n\n[model_providers.ridgeline]\n'
        f'name = "Ridgeline"\nbase_url = "{proxy.url}/v1"\nwire_api = "responses"\n'
        'env_key = "RIDGELINE_API_KEY"\n')
    work = tmp_path / "work"
    work.mkdir()
    env = agent_env(tmp_path, CODEX_HOME=str(codex_home), RIDGELINE_API_KEY="unused")
    done = subprocess.run([str(agents / "codex"), "exec", "--skip-git-repo-check",
                           "Say hello from the shell."], cwd=work, env=env, capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)
    posts = proxy.posts("/v1/responses")
    assert done.returncode == 0, (done.stdout[-1000:], done.stderr[-1000:],
                                  [(p["status"], p["answer"][:300]) for p in posts])
    assert [p["status"] for p in posts] == [200] * len(posts) and len(posts) >= 2
    first = posts[0]["body"]
    # What Codex always sends, accepted: its metadata, hosted and grouped tools, its
    # cache key, encrypted reasoning asked for, nothing stored.
    assert "client_metadata" in first and first["store"] is False
    assert {t["type"] for t in first["tools"]} >= {"function", "web_search", "namespace"}
    call = next(json.loads(line.removeprefix("data: "))["item"]
                for line in posts[0]["answer"].splitlines()
                if line.startswith("data: ") and '"response.output_item.done"' in line
                and '"function_call"' in line)
    assert call["name"] == "exec_command" and json.loads(call["arguments"]) == {"cmd": COMMAND}
    outputs = [i for i in posts[-1]["body"]["input"] if i.get("type") == "function_call_output"]
    assert [o["call_id"] for o in outputs] == [call["call_id"]]
    assert "ridgeline-tool-ran" in json.dumps(outputs[0]["output"])  # the command ran
    assert "answer" in done.stdout
