"""Offline entry point: `LLM.generate()` drives the same engine core the server uses."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from app.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.loras import lora_id
from app.engine.outputs import RequestOutput
from app.engine.roofline import RooflineTracker
from app.engine.sampling_params import SamplingParams
from models.tokenizer import apply_chat_template

# Text, token ids, or vLLM's prompt dicts: {"prompt": text} and {"prompt_token_ids": ids}.
Prompt = str | list[int] | dict[str, Any]


class LLM:
    """Batch generation in-process.

    >>> llm = LLM()  # the embedded SmolLM2-135M-Instruct
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))[0].text

    Every engine setting the server takes is a keyword here, by the same name
    (`LLM("dir", max_num_seqs=8, kv_cache_memory="1GiB", enforce_eager=True)`);
    `config` passes a ready `EngineConfig` instead.
    """

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None,
                 **settings: Any):
        if config is not None and (model is not None or settings):
            raise TypeError("pass either config or model and settings, not both")
        self.engine = EngineCore(config or EngineConfig.from_kwargs(model=model, **settings))
        self._ids = itertools.count()
        self.roofline = RooflineTracker(self.engine.peaks)  # where the steps sat

    @property
    def tokenizer(self):
        """The engine's tokenizer: `encode`, `decode`, `get_vocab`, the special tokens and
        `apply_chat_template`, as transformers names them (`models/tokenizer.py`); for a
        generic tokenizer.json it is not transformers' object, which
        `models.tokenizer.transformers_tokenizer` gives."""
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
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, as text, token ids or a prompt dict
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
            lora_id(self.engine.loras, sp.lora_name)  # an adapter not served: AdapterNotFound

        order: dict[str, int] = {}
        for i, (ids, sp) in enumerate(zip(token_lists, params)):
            rid = f"offline-{next(self._ids)}"
            order[rid] = i
            self.engine.add_request(rid, ids, sp, priority=priority[i] if priority else 0)
        results: list[RequestOutput | None] = [None] * n
        try:
            with tqdm(total=n, desc="Generating", disable=not use_tqdm, unit="req") as bar:
                while self.engine.has_work:
                    step = self.engine.step()
                    self.roofline.record(step.stats)
                    for out in step.outputs:
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
        if isinstance(prompt, dict):  # vLLM's TextPrompt / TokensPrompt
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown or len(prompt) != 1:
                raise ValueError("a prompt dict holds exactly one of 'prompt' (text) or "
                                 f"'prompt_token_ids'; got keys {sorted(prompt)}")
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise TypeError("token ids must be ints")
        return ids

    def shutdown(self) -> None:
        self.engine.shutdown()
