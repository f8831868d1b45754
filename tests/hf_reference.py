"""Reference generation with Hugging Face transformers, the parity oracle."""

from __future__ import annotations

import torch


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Greedy ids from an HF causal LM, ignoring EOS, with its own KV cache."""
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(num_tokens - 1):
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                    use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def gguf_greedy_both(gguf, prompts: list[list[int]], num_tokens: int,
                     max_model_len: int) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy ids of a GGUF file through Ridgeline's engine in float32, and through
    transformers' own GGUF loader (gguf-py's dequantizer): the independent reader."""
    from transformers import AutoModelForCausalLM

    from app.engine.sampling_params import SamplingParams
    from app.llm import LLM

    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              dtype=torch.float32).eval()
    llm = LLM(str(gguf), dtype="float32", max_model_len=max_model_len)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=num_tokens, temperature=0,
                                                    ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.token_ids for o in outs], [hf_greedy(hf, p, num_tokens) for p in prompts]
