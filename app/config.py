"""Every setting, written once: small frozen dataclasses validated on construction.

A default lives here and nowhere else. The CLI builds its flags from these fields
(`cli.py` reads name, type, default and help from them), the offline `LLM(**kwargs)`
and `EngineConfig.from_kwargs(**flat)` route flat names into the nested dataclasses
by field name (the names are vLLM's flag names), and the model thread's
`RunnerSpec.from_config(config.flat())` picks the fields it needs by name. Adding a
setting means adding a field here and reading it where it is used.

A bad value fails at start, naming the value and the limit, not deep in a step.
"""

from __future__ import annotations

import os
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from app.engine.spec.config import SpeculativeConfig

PREEMPTION_POLICIES = ("newest", "priority", "length")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
SPEC_METRICS_LEVELS = ("none", "summary", "detailed")  # vLLM's choices
KV_CACHE_DTYPES = ("auto", "bfloat16")  # vLLM's flag; its fp8 choices are not built

_SIZE_RE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str | int) -> int:
    """'2GiB' → 2147483648, '512MB' → 512e6, 1000 → 1000."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"cannot parse a byte size from {text!r} (examples: 1073741824, 2GiB)")
    unit = (m.group(2) or "").lower().rstrip("b")
    return int(float(m.group(1)) * _UNITS[unit])


def setting(default: Any = None, help: str = "", *, flags: tuple[str, ...] = (),
            choices: tuple[str, ...] | None = None, env: str | None = None,
            cli: bool = True) -> Any:
    """A config field with what the CLI needs to offer it as a flag.

    `flags` replaces the default `--field-name` (first entry) and adds aliases (vLLM
    names first, SGLang's spellings after); `env` names a variable whose value, when
    set, is the default.
    """
    meta = {"help": help, "flags": flags, "choices": choices, "env": env, "cli": cli}
    if env is not None:
        return field(default_factory=lambda: _from_env(env, default), metadata=meta)
    return field(default=default, metadata=meta)


def _from_env(name: str, default: Any) -> Any:
    value = os.environ.get(name)
    if value is None:
        return default
    return type(default)(value) if default is not None else value


def _positive(name: str, value: int | float | None, minimum: int | float = 1) -> None:
    if value is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int | None = setting(
        None, "longest prompt + output in tokens (default: the model's whole context, "
        "lowered with a log line where the KV cache cannot hold one sequence of it)")
    max_num_seqs: int = setting(256, "most requests in one batch",
                                flags=("--max-num-seqs", "--max-running-requests"))
    max_num_batched_tokens: int = setting(2048, "token budget of one step (prefill chunks "
                                          "and decodes together)")
    max_queued_requests: int | None = setting(None, "waiting requests beyond which new ones "
                                              "get 503 (default: unbounded)")
    long_prefill_token_threshold: int = setting(
        512, "a request's prefill chunk takes at most this many tokens a step, so a long "
        "prompt shares its steps with waiting and decoding requests (0: no cap; vLLM's "
        "name)")
    preemption_policy: str = setting("newest", "which running request gives up its KV blocks "
                                     "when the pool is full", choices=PREEMPTION_POLICIES)

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_model_len", self.max_model_len, 2)
        _positive("max_queued_requests", self.max_queued_requests)
        _positive("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        if self.preemption_policy not in PREEMPTION_POLICIES:
            raise ValueError(f"preemption_policy must be one of {PREEMPTION_POLICIES}, "
                             f"got {self.preemption_policy!r}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = setting(16, "tokens per KV block (a power of two)")
    kv_cache_memory: int | str | None = setting(None, "KV pool size in bytes, e.g. 2GiB (CPU "
                                          "default: 1GiB; CUDA: what memory allows)")
    gpu_memory_utilization: float = setting(
        0.9, "fraction of GPU memory for weights, activations and the KV pool",
        flags=("--gpu-memory-utilization", "--mem-fraction-static"))
    num_blocks: int | None = setting(None, "an exact KV pool size in blocks",
                                     flags=("--num-gpu-blocks-override", "--num-blocks"))
    kv_cache_dtype: str = setting(
        "auto", "dtype of the KV cache: auto (the model's; bfloat16 where --dtype auto "
        "serves float32 on a CPU), or bfloat16 under a float32 model on CPU: half the "
        "cache's bytes, so twice the tokens and half the attention reads; attention still "
        "computes in float32, keys and values rounded to bfloat16",
        choices=KV_CACHE_DTYPES)
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of prompt prefixes "
                                          "already computed (automatic prefix caching)")
    kv_events_config: str | None = setting(
        None, "publish prefix-cache events for vllm-router's kv_aware policy; vLLM's JSON, "
        "e.g. {\"enable_kv_cache_events\": true}. The socket is unauthenticated and carries "
        "prompt tokens: it binds tcp://127.0.0.1:5557 unless \"endpoint\" names another "
        "address (an interface a remote router reaches, or tcp://*:5557 for all)")

    def __post_init__(self) -> None:
        if isinstance(self.kv_cache_memory, str):  # '2GiB' from a flag or a caller
            object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory))
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        _positive("kv_cache_memory", self.kv_cache_memory)
        _positive("num_blocks", self.num_blocks)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")


@dataclass(frozen=True)
class LoRAConfig:
    """Serving LoRA adapters (docs/lora.md); vLLM's flags and defaults."""

    enable_lora: bool = setting(False, "serve LoRA adapters: a request's `model` names one")
    lora_modules: tuple[str, ...] | None = setting(
        None, "adapters to load at start: name=path, or vLLM's JSON {\"name\": ..., "
        "\"path\": ..., \"base_model_name\": ...}; each a PEFT directory")
    max_loras: int = setting(1, "most adapters in one step (the model thread's slots)")
    max_lora_rank: int = setting(16, "largest rank an adapter may have (a 400 at load beyond)")
    max_cpu_loras: int | None = setting(None, "adapters kept read in host memory, least "
                                        "recently used out (default: --max-loras)")
    lora_allowed_dirs: tuple[str, ...] | None = setting(
        None, "directories /v1/load_lora_adapter may read adapters from (default: those "
        "holding the --lora-modules adapters; none given: no runtime loading)")

    def __post_init__(self) -> None:
        _positive("max_loras", self.max_loras)
        _positive("max_lora_rank", self.max_lora_rank)
        _positive("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        for name in ("lora_modules", "lora_allowed_dirs"):
            value = getattr(self, name)
            if value is not None:  # one entry, or a list, from a flag or a caller
                object.__setattr__(self, name, (value,) if isinstance(value, str | dict)
                                   else tuple(value))
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = setting(None, "HF directory or .gguf file (default: the embedded "
                                "SmolLM2-135M-Instruct)")
    served_model_name: str | None = setting(None, "the model name clients use and metrics "
                                            "carry (default: the model's name)")
    dtype: str = setting("auto", "weights dtype, and the KV cache's unless --kv-cache-dtype says "
                         "otherwise (auto: bfloat16 on CUDA and on CPUs with bf16 arithmetic, "
                         "AMX or AVX512-BF16; float32 on other CPUs and with "
                         "--int8-activations)",
                         choices=DTYPES)
    device: str = setting("auto", "cpu, cuda, cuda:1, ... (auto: CUDA when there is one)")
    seed: int = setting(0, "seed of the generator shared by unseeded requests")
    enforce_eager: bool = setting(False, "never capture CUDA graphs")
    torch_threads: int | None = setting(
        None, "threads for torch's CPU kernels (default: every core the rest of the host "
        "leaves free, re-checked every 2 s, since OpenMP threads that spin beside a busy "
        "process slow every step; docs/robustness.md)")
    attention_backend: str = setting("auto", "auto: Triton on CUDA; on CPU torch with a C++ paged "
                                     "decode kernel (built once, plain torch if it cannot "
                                     "be); torch: plain torch",
                                     choices=ATTENTION_BACKENDS)
    cpu_quantized_matmul: bool = setting(
        True, "on CPU, matmuls of a few rows (decode) read a GGUF's Q4_1/Q8_0 blocks "
        "through a C++ kernel, multiplying in float32: in float32 the same weights in a "
        "sixth of the bytes; in bfloat16, few-row calls (on AMX, up to 64 rows) in a third")
    int8_activations: bool | None = setting(
        None, "on CPU, GGUF models in float32: quantize each matmul's input to int8 per "
        "block of 32, as llama.cpp does, and multiply bytes (AVX512-VNNI or AVX2): ~0.6x "
        "the matmuls' time, but tokens can differ from an exact run's. Unset: on where "
        "--dtype auto serves float32 (a CPU without bf16 arithmetic, AVX2)")
    int8_batches: bool = setting(
        True, "on CPUs without AMX, a bf16 model's GGUF layers quantize x to int8 per block "
        "of 32 in calls of 4 rows or more (prompts, decode steps of 4 or more sequences), "
        "as llama.cpp does in every call, and multiply bytes (AVX512-VNNI or AVX2): 2-4x "
        "the exact kernels' rate there; one to three rows (a few users' decode steps) and "
        "float32 models stay exact. --no-int8-batches: every call exact")
    chat_template: str | None = setting(None, "a Jinja chat template, or the path of a file "
                                        "holding one, replacing the tokenizer's own")
    chat_template_render_timeout: float = setting(
        5.0, "seconds one chat template render may take (a 400 beyond); renders run in "
        "worker processes that are killed past it")
    chat_template_render_memory: int | str = setting(
        "512MiB", "address space of each chat template worker process (RLIMIT_AS); a render "
        "that needs more is a 400")
    # Structured outputs: every grammar compile is bounded (app/engine/grammar_pool.py).
    grammar_compile_timeout: float = setting(
        10.0, "seconds a grammar (JSON schema, regex, choice, EBNF, tool schemas) may take "
        "to compile; past it the worker is killed and the request gets a 400")
    grammar_compile_memory: int | str = setting(
        512 << 20, "memory a grammar compile may add to its worker process, e.g. 512MiB "
        "(past it: a 400)")
    grammar_workers: int = setting(2, "grammar-compiling processes; with two or more, the "
                                   "first compiles only specs up to 1 KiB, so a short one "
                                   "never waits behind a large one")
    grammar_cache_bytes: int | str = setting(64 << 20, "bytes of compiled grammars kept "
                                             "for reuse (least recently used out first)")
    grammar_max_spec_bytes: int | str = setting(128 << 10, "largest grammar spec accepted "
                                                "(a schema, regex, EBNF...; 400 beyond)")
    tokenizer: str | None = setting(None, "load the tokenizer from this directory instead of "
                                    "the model's")
    skip_tokenizer_init: bool = setting(
        False, "serve without a tokenizer: prompts as token ids only (/generate's input_ids, "
        "/v1/completions' token-id prompts), outputs as token ids with empty text; routes "
        "that need text (chat, text prompts, /tokenize) answer a 400")
    speculative_config: str | dict | SpeculativeConfig | None = setting(
        None, "speculative decoding, vLLM's JSON: {\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5}; "
        "output is the same as without it (docs/speculative.md)")
    per_request_spec_decode_metrics: str = setting(
        "none", "with --speculative-config: each request's acceptance (mean acceptance "
        "length, draft acceptance rate, histogram of accepted drafts per step; detailed: "
        "each step's counts too) in the response's metrics.speculative_decoding, for n=1",
        choices=SPEC_METRICS_LEVELS)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        object.__setattr__(self, "chat_template_render_memory",
                           parse_bytes(self.chat_template_render_memory))
        _positive("chat_template_render_timeout", self.chat_template_render_timeout, 0.01)
        _positive("chat_template_render_memory", self.chat_template_render_memory, 64 << 20)
        _positive("torch_threads", self.torch_threads)
        for name in ("grammar_compile_memory", "grammar_cache_bytes", "grammar_max_spec_bytes"):
            if isinstance(getattr(self, name), str):  # '512MiB' from a flag or a caller
                object.__setattr__(self, name, parse_bytes(getattr(self, name)))
            _positive(name, getattr(self, name))
        _positive("grammar_workers", self.grammar_workers)
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be > 0, "
                             f"got {self.grammar_compile_timeout}")
        if self.int8_activations and not self.cpu_quantized_matmul:
            raise ValueError("int8_activations reads a GGUF's blocks: it needs "
                             "cpu_quantized_matmul")
        if self.skip_tokenizer_init and (self.tokenizer or self.chat_template):
            raise ValueError("skip_tokenizer_init loads no tokenizer: it cannot take "
                             "--tokenizer or --chat-template")
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.parse(self.speculative_config))
        level = self.per_request_spec_decode_metrics
        if level not in SPEC_METRICS_LEVELS:
            raise ValueError(f"per_request_spec_decode_metrics must be one of "
                             f"{SPEC_METRICS_LEVELS}, got {level!r}")
        if level != "none" and self.speculative_config is None:  # vLLM refuses it too
            raise ValueError("per_request_spec_decode_metrics requires speculative decoding "
                             "(--speculative-config)")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")

    @property
    def max_model_len(self) -> int | None:
        return self.scheduler.max_model_len

    @property
    def model_name(self) -> str:
        """What clients call the model: the served name, else what was asked for."""
        return self.served_model_name or self.model or "SmolLM2-135M-Instruct"

    @classmethod
    def from_kwargs(cls, **flat: Any) -> EngineConfig:
        """Route flat settings (vLLM's names) into the nested dataclasses by field name."""
        nested: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        top: dict[str, Any] = {}
        for key, value in flat.items():
            section = _SECTION_OF.get(key)
            if section is None:
                raise TypeError(f"unknown engine setting {key!r}")
            (top if section == "" else nested[section])[key] = value
        return cls(**top, **{name: _SECTIONS[name](**kw) for name, kw in nested.items()})

    def flat(self) -> dict[str, Any]:
        """Every leaf setting by its flat name (the inverse of `from_kwargs`)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _SECTIONS}
        for name in _SECTIONS:
            part = getattr(self, name)
            out |= {f.name: getattr(part, f.name) for f in fields(part)}
        return out


@dataclass(frozen=True)
class ServerSettings:
    """What only the HTTP server needs (the engine never reads these)."""

    host: str = setting("127.0.0.1", "address to listen on", env="RIDGELINE_HOST")
    port: int = setting(8000, "port to listen on", env="RIDGELINE_PORT")
    allowed_hosts: str | None = setting(
        None, "comma-separated Host names served besides loopback ones (*.example.com "
        "matches subdomains; * turns the check off). On a loopback --host any other Host "
        "gets 400, against DNS rebinding; on other addresses the check needs this list")
    api_key: str | None = setting(None, "require `Authorization: Bearer KEY` on every route "
                                  "but /health and /metrics", env="RIDGELINE_API_KEY")
    admin_api_key: str | None = setting(
        None, "the operator's key (SGLang's flag): required on /reset_prefix_cache when set, "
        "accepted on every route, and the only key that lets /abort_request abort by a "
        "client-chosen id or abort_all", env="RIDGELINE_ADMIN_API_KEY")
    reasoning_parser: str | None = setting(
        None, "split the model's <think>...</think> from its answer: reasoning_content in "
        "chat, thinking blocks in /v1/messages (vLLM's names)", choices=("qwen3", "deepseek_r1"))
    max_body_bytes: int = setting(4 << 20, "largest request body accepted (413 beyond)",
                                  flags=("--max-request-body-bytes",))
    max_chat_messages: int = setting(2048, "most messages in one chat request (400 beyond)")
    max_content_parts: int = setting(256, "most content parts in one chat message (400 "
                                     "beyond)")
    max_tools: int = setting(128, "most tools in one chat request (400 beyond)")
    trust_request_chat_template: bool = setting(
        False, "accept a chat template sent in a request (`chat_template`, or "
        "`chat_template_kwargs.chat_template`); without it such a request is a 400")
    shutdown_timeout: float = setting(30.0, "seconds a SIGTERM drain waits for requests in "
                                      "flight before ending them with an error")
    log_stats_interval: float = setting(10.0, "seconds between stats lines (0: never)")
    disable_uvicorn_access_log: bool = setting(
        False, "no access line per HTTP request (method, path, status, duration, request "
        "id, and an error answer's reason) in the log (vLLM's flag)")
    disable_web_ui: bool = setting(False, "no chat page at / (the page and its pool panel: "
                                   "docs/web_ui.md)")
    disable_log_requests: bool = setting(
        False, "no `request finished` / `request aborted` line per request (its tokens, "
        "times and finish reason) in the log (vLLM's flag)")
    header_timeout: float = setting(10.0, "seconds a client may take to send a request's "
                                    "headers, and again its body (408 beyond)")
    # Deadlines (see app/engine/admission.py): off unless set here or sent by the client
    # (X-Request-Timeout, the openai SDK's x-stainless-read-timeout, X-SLO-TTFT-Ms).
    max_queue_time: float | None = setting(None, "seconds a request may wait to start; later "
                                           "it is refused with 503 before any prefill")
    slo_ttft_ms: float | None = setting(None, "default time-to-first-token target: a request "
                                        "that cannot meet it is refused early with 503 "
                                        "(per request: header X-SLO-TTFT-Ms)")
    slo_tpot_ms: float | None = setting(None, "default time-per-output-token target: requests "
                                        "join the batch only while it holds (per request: "
                                        "header X-SLO-TPOT-Ms)")
    max_seqs_per_request: int = setting(
        256, "most sequences one request may put in flight (prompts x n); more is a 400")
    max_tokens_per_request: int | None = setting(
        None, "most tokens one request may ask for: its prompts' tokens plus sequences x "
        "max_tokens; more is a 400 (default: 64 x max_model_len, n=64 full contexts)")
    retry_after_seconds: int = setting(1, "the Retry-After sent with a 503 when no wait can "
                                       "be predicted", cli=False)
    # The Responses API's store (app/server/response_store.py), least recently used out.
    responses_store_max_entries: int = setting(
        1000, "most responses kept for previous_response_id and GET /v1/responses/{id} "
        "(0: none); the least recently used is dropped first")
    responses_store_max_bytes: int = setting(
        256 << 20, "most bytes of stored responses (each with its conversation, as JSON)")

    def __post_init__(self) -> None:
        _positive("max_seqs_per_request", self.max_seqs_per_request)
        _positive("max_tokens_per_request", self.max_tokens_per_request)
        _positive("max_chat_messages", self.max_chat_messages)
        _positive("max_content_parts", self.max_content_parts)
        _positive("max_tools", self.max_tools)
        if self.reasoning_parser not in (None, "qwen3", "deepseek_r1"):
            raise ValueError(f"reasoning_parser must be qwen3 or deepseek_r1, "
                             f"got {self.reasoning_parser!r}")
        _positive("responses_store_max_entries", self.responses_store_max_entries, 0)
        _positive("responses_store_max_bytes", self.responses_store_max_bytes, 0)

    @classmethod
    def from_kwargs(cls, **flat: Any) -> ServerSettings:
        return cls(**{k: v for k, v in flat.items() if k in _names(cls)})


_SECTIONS: dict[str, type] = {"scheduler": SchedulerConfig, "cache": CacheConfig,
                              "lora": LoRAConfig}


def _names(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}


_SECTION_OF: dict[str, str] = {
    **{n: "" for n in _names(EngineConfig) - set(_SECTIONS)},
    **{n: section for section, c in _SECTIONS.items() for n in _names(c)},
}


def setting_fields(*classes: type):
    """(dataclass field, its default) for every CLI setting of `classes`, nested included."""
    for cls in classes:
        for f in fields(cls):
            if f.name in _SECTIONS and cls is EngineConfig:
                yield from setting_fields(_SECTIONS[f.name])
            elif f.metadata.get("cli", False):
                default = f.default if f.default is not MISSING else f.default_factory()
                yield f, default
