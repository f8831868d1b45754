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
