"""LoRA adapters made with `peft` for the tests, and their merged transformers reference."""

from __future__ import annotations

from pathlib import Path

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir: Path, out_dir: Path, targets: list[str], r: int = 8,
                 alpha: float = 16, seed: int = 0, std: float = 0.15, **extra):
    """A PEFT LoRA adapter of `base_dir` with random A and B (large enough to change the
    greedy tokens), saved to `out_dir`; returns the transformers model with it merged."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                        init_lora_weights=False, **extra)
    model = get_peft_model(base, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(str(out_dir))
    return model.merge_and_unload().eval()
