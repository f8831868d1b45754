"""Offline entry point: `LLM.generate()` drives the same engine core the server uses."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from app.config import CacheConfig, EngineConfig, SchedulerConfig, parse_bytes
from app.engine_core import EngineCore
from app.outputs import RequestOutput
from app.sampling_params import SamplingParams
from models.tokenizer import apply_chat_template

Prompt = str | list[int]


class LLM:
    """Batch generation in-process.

    >>> llm = LLM()  # the embedded SmolLM2-135M-Instruct
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))[0].text
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        kv_cache_memory: int | str | None = None,
        num_blocks: int | None = None,
        preemption_policy: str = "newest",
        seed: int = 0,
        device: str = "auto",
        attention_backend: str = "auto",
        config: EngineConfig | None = None,
    ):
        """Keyword arguments build the EngineConfig; `config` passes a ready one instead."""
        config = config or EngineConfig(
            model=model,
            dtype=dtype,
            device=device,
            seed=seed,
            attention_backend=attention_backend,
            max_model_len=max_model_len,
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                preemption_policy=preemption_policy,
            ),
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory=None if kv_cache_memory is None else parse_bytes(kv_cache_memory),
                num_blocks_override=num_blocks,
            ),
        )
        self.engine = EngineCore(config)
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        return cls(config=config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt through the scheduler; outputs come back in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, as text or as token ids
        n = len(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * n if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != n:
            raise ValueError(f"got {n} prompts but {len(params)} sampling params")
        token_lists = [self._encode(p) for p in prompts]
        for ids, sp in zip(token_lists, params):
            self.engine.validate(ids, sp)  # all or nothing: fail before queueing any

        order: dict[str, int] = {}
        for i, (ids, sp) in enumerate(zip(token_lists, params)):
            rid = f"offline-{next(self._ids)}"
            order[rid] = i
            self.engine.add_request(rid, ids, sp, priority=priority[i] if priority else 0)
        results: list[RequestOutput | None] = [None] * n
        try:
            with tqdm(total=n, desc="Generating", disable=not use_tqdm, unit="req") as bar:
                while self.engine.has_work:
                    for out in self.engine.step():
                        if out.finished:
                            results[order[out.request_id]] = out
                            bar.update(1)
        except BaseException:
            for rid in order:  # leave nothing queued or holding blocks
                self.engine.abort(rid)
            raise
        return results  # type: ignore[return-value]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [apply_chat_template(self.tokenizer, conv) for conv in conversations]
        return self.generate(ids, sampling_params, use_tqdm=use_tqdm)

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def shutdown(self) -> None:
        self.engine.shutdown()
