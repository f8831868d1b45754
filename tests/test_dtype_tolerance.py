"""`--dtype auto` on CPU: which dtype it picks, and the tolerance bfloat16 is held to
where it is picked (`docs/cpu.md`, "Which dtype `auto` picks").

bfloat16 cannot give float32's greedy tokens (the parity prompts part ways within a few
tokens on some questions), so its tolerance is stated over scored text instead: the
perplexity of the real SmolLM2 on fixed English text, and how often both dtypes agree on
the most likely next token. `benchmarks/dtype_tolerance.py` measures the same on more text.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.engine.sampling_params import SamplingParams
from app.llm import LLM
from gpu.cpu.capabilities import onednn
from gpu.dtypes import choose_dtype

TEXT = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
TOKENS = 384
PERPLEXITY_TOLERANCE = 0.01  # |ppl(bf16) / ppl(fp32) - 1|
TOP1_AGREEMENT = 0.93


def test_auto_is_bfloat16_exactly_where_the_cpu_multiplies_bf16():
    dtype, why = choose_dtype("auto", torch.device("cpu"))
    assert dtype == (torch.bfloat16 if onednn()[1] else torch.float32)
    assert why.startswith("auto: ")
    assert choose_dtype("float32", torch.device("cpu"))[0] == torch.float32


def scored(dtype: str) -> tuple[list[float], list[int]]:
    # bf16's own tolerance: without AMX a bf16 model's prompts also take int8 x by default,
    # whose tolerance `tests/test_cpu_int8_batches.py` states apart.
    llm = LLM(dtype=dtype, int8_batches=False, max_model_len=512)
    try:
        ids = llm.tokenizer.encode(TEXT.read_text())[:TOKENS]
        (out,) = llm.generate([{"prompt_token_ids": ids}],
                              SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0),
                              use_tqdm=False)
    finally:
        llm.shutdown()
    entries = out.prompt_logprobs[1:]
    return [e[0] for e in entries], [e[2][0][0] for e in entries]


@pytest.mark.skipif(not onednn()[1], reason="bfloat16 is not auto's choice on this CPU")
def test_bfloat16_perplexity_and_top_token_stay_within_the_stated_tolerance():
    fp32, fp32_top = scored("float32")
    bf16, bf16_top = scored("bfloat16")
    assert len(fp32) == len(bf16) == TOKENS - 1
    ratio = torch.tensor(-sum(bf16) / len(bf16) + sum(fp32) / len(fp32)).exp().item()
    assert abs(ratio - 1) <= PERPLEXITY_TOLERANCE, ratio
    agreement = sum(a == b for a, b in zip(fp32_top, bf16_top)) / len(fp32_top)
    assert agreement >= TOP1_AGREEMENT, agreement
