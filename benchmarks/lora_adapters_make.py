"""Random PEFT LoRA adapters for a base model, for the LoRA benchmarks: saved by `peft`'s
own `save_pretrained`, so any engine that reads PEFT's format (ours, vLLM) can serve them.

    python benchmarks/lora_adapters_make.py MODEL_DIR OUT_DIR [--count 16] [--rank 16]

Each adapter adapts q/k/v/o and gate/up/down (vLLM's and PEFT's usual "all linears"),
with its own seed; an existing adapter directory is kept, so a rerun is cheap.
"""

from __future__ import annotations

import argparse
from pathlib import Path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: str | Path, out_dir: str | Path, count: int, rank: int = 16,
                  std: float = 0.02) -> list[Path]:
    """`count` adapters `out_dir/lora{i}`, rank `rank`, alpha 2 x rank; returns their paths."""
    import torch

    out_dir = Path(out_dir)
    paths = [out_dir / f"lora{i}" for i in range(count)]
    todo = [p for p in paths if not (p / "adapter_model.safetensors").is_file()]
    if not todo:
        return paths
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                            init_lora_weights=False))
    for path in todo:
        g = torch.Generator().manual_seed(paths.index(path))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        model.save_pretrained(str(path))
    return paths


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("out_dir")
    p.add_argument("--count", type=int, default=16)
    p.add_argument("--rank", type=int, default=16)
    a = p.parse_args()
    for path in make_adapters(a.model_dir, a.out_dir, a.count, a.rank):
        print(path)


if __name__ == "__main__":
    main()
