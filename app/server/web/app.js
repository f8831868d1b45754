// Ridgeline's chat page (app/server/web_ui.py serves it): a chat streamed over
// /v1/chat/completions, and the KV pool polled from /metrics. Everything a user or the
// model wrote is set as text (textContent), never parsed as HTML. No library, nothing
// fetched from elsewhere: the server's Content-Security-Policy allows only this origin.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "ridgeline-api-key";
const state = { history: [], controller: null, key: sessionStorage.getItem(KEY) || "" };

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.key) h.Authorization = "Bearer " + state.key;
  return h;
}

// GET with the key; a 401 asks for it once (kept in this tab's sessionStorage).
async function authorized(url) {
  let r = await fetch(url, { headers: headers() });
  if (r.status === 401) {
    const key = window.prompt("This server needs an API key:");
    if (key) {
      state.key = key;
      sessionStorage.setItem(KEY, key);
      r = await fetch(url, { headers: headers() });
    }
  }
  return r;
}

async function loadModels() {
  const r = await authorized("/v1/models");
  if (!r.ok) return;
  const select = $("model");
  select.replaceChildren();
  for (const m of (await r.json()).data) {
    const option = document.createElement("option");
    option.value = m.id;
    option.textContent = m.id;
    select.append(option);
  }
}

function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = "msg " + role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  const stats = document.createElement("div");
  stats.className = "stats";
  box.append(body, stats);
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return { body, stats };
}

// One streamed answer: the SSE lines of /v1/chat/completions, read as they arrive.
async function send(event) {
  event.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || state.controller) return;
  $("prompt").value = "";
  state.history.push({ role: "user", content: text });
  addMessage("user", text);
  const out = addMessage("assistant", "");
  const controller = new AbortController();
  state.controller = controller;
  $("send").disabled = true;
  $("stop").disabled = false;
  const started = performance.now();
  let first = null, tokens = 0, answer = "", stopped = false;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({
        model: $("model").value, messages: state.history, stream: true,
        temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
        stream_options: { include_usage: true },
      }),
    });
    if (!r.ok) {
      out.body.textContent = "Error " + r.status + ": " + (await r.text());
      state.history.pop();
      return;
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const lines = buffer.slice(0, end).split("\n");
        buffer = buffer.slice(end + 2);
        for (const line of lines) {
          if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
          const chunk = JSON.parse(line.slice(6));
          if (chunk.usage) tokens = chunk.usage.completion_tokens;
          const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta.content;
          if (delta) {
            if (first === null) first = performance.now();
            answer += delta;
            out.body.textContent = answer;
          }
        }
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") out.body.textContent = answer + "\n[" + e + "]";
    stopped = true;
  } finally {
    state.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
  if (answer) state.history.push({ role: "assistant", content: answer });
  const ended = performance.now();
  const parts = [];
  if (first !== null) parts.push("first token " + Math.round(first - started) + " ms");
  if (tokens && first !== null && ended > first)
    parts.push((tokens / ((ended - first) / 1000)).toFixed(1) + " tokens/s");
  if (stopped) parts.push("stopped");
  out.stats.textContent = parts.join(" · ");
}

// The pool: a few gauges of /metrics (summed over their labels), the last two minutes.
const WINDOW = 120;
const series = { used: [], cached: [], running: [] };

function gauge(text, name, label) {
  let sum = null;
  for (const line of text.split("\n")) {
    if (!line.startsWith("ridgeline:" + name)) continue;
    const rest = line.slice(("ridgeline:" + name).length);
    if (rest[0] !== "{" && rest[0] !== " ") continue;
    if (label && !rest.includes(label)) continue;
    sum = (sum || 0) + Number(line.slice(line.lastIndexOf(" ") + 1));
  }
  return sum;
}

function draw(id, values, top) {
  const points = values.map((v, i) =>
    ((i + WINDOW - values.length) * 300 / (WINDOW - 1)).toFixed(1) + "," +
    (118 - 116 * v / top).toFixed(1));
  $(id).setAttribute("points", points.join(" "));
}

async function poll() {
  let text;
  try {
    const r = await fetch("/metrics");
    text = await r.text();
  } catch (e) {
    return;
  }
  const used = gauge(text, "kv_blocks", 'state="used"');
  const cached = gauge(text, "kv_blocks", 'state="cached"');
  const free = gauge(text, "kv_blocks", 'state="free"');
  const running = gauge(text, "num_requests_running");
  const values = { "blocks-used": used, "blocks-cached": cached, "blocks-free": free,
                   running, waiting: gauge(text, "num_requests_waiting"),
                   preemptions: gauge(text, "num_preemptions_total") };
  for (const [id, v] of Object.entries(values)) $(id).textContent = v === null ? "–" : v;
  if (used === null) return;
  for (const [name, v] of Object.entries({ used, cached, running })) {
    series[name].push(v);
    if (series[name].length > WINDOW) series[name].shift();
  }
  const blocks = used + cached + free;
  draw("line-used", series.used, blocks);
  draw("line-cached", series.cached, blocks);
  draw("line-running", series.running, Math.max(1, ...series.running));
}

// The last decode step's share of the host's measured bandwidth and compute (/plan).
async function pollPlan() {
  let step;
  try {
    const r = await fetch("/plan", { headers: headers() });
    if (!r.ok) return;
    step = (((await r.json()).live || {}).last_step || {}).decode;
  } catch (e) {
    return;
  }
  $("mbu").textContent = step ? Math.round(100 * step.mbu) + " %" : "–";
  $("mfu").textContent = step ? Math.round(100 * step.mfu) + " %" : "–";
}

$("ask").addEventListener("submit", send);
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("clear").addEventListener("click", () => {
  state.history = [];
  $("messages").replaceChildren();
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("ask").requestSubmit();
  }
});
loadModels();
poll();
pollPlan();
setInterval(poll, 1000);
setInterval(pollPlan, 2000);
