"""A checkpoint's `generation_config.json`: its default sampling values and extra EOS ids.

Model authors put the sampling they tuned for here (Qwen2.5-Instruct: temperature 0.7,
top_p 0.8, top_k 20, repetition_penalty 1.05) and, often, more end tokens than
`config.json` names (Llama 3 Instruct ends a turn with <|eot_id|>, not
<|end_of_text|>). vLLM's behaviour is followed: the defaults replace the engine's own
for any value a request does not set, and a request's own values always win.
`do_sample` is not consulted (vLLM does not either): a request asks for greedy with
temperature 0.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

log = logging.getLogger(__name__)

FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field (vLLM's list).
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True)
class GenerationDefaults:
    # SamplingParams field name -> the checkpoint's default; only keys the file sets.
    sampling: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    eos_token_ids: tuple[int, ...] = ()

    def apply(self, requested: Mapping[str, Any]) -> dict[str, Any]:
        """The request's values over the checkpoint's defaults.

        `requested` holds only what the request set (pydantic's
        `model_dump(exclude_unset=True)`, or the non-None keyword arguments), so an
        absent temperature takes the checkpoint's and an explicit one is kept."""
        return {**self.sampling, **{k: v for k, v in requested.items() if v is not None}}


def load_generation_defaults(model_dir: str | os.PathLike[str]) -> GenerationDefaults:
    """Read `generation_config.json` if the directory has one; an empty default if not."""
    path = Path(model_dir) / FILE
    if not path.is_file():
        return GenerationDefaults()
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    return parse_generation_config(raw)


def parse_generation_config(raw: Mapping[str, Any]) -> GenerationDefaults:
    sampling = {ours: raw[key] for key, ours in SAMPLING_KEYS.items() if raw.get(key) is not None}
    if sampling.get("top_k") == 0:
        del sampling["top_k"]  # HF's "no top-k" is already the engine's default
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    if sampling:
        log.info("generation_config.json sets default sampling %s (a request's own values win)",
                 ", ".join(f"{k}={v}" for k, v in sampling.items()))
    return GenerationDefaults(MappingProxyType(sampling), tuple(int(i) for i in eos_ids))
