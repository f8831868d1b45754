"""Stream the tensors of an HF safetensors checkpoint, one at a time, in the wanted dtype.

Streaming (rather than building a whole state dict) keeps peak memory at one tensor
above the model itself, and lets the model decide where each tensor goes (fused QKV,
sharded, moved to the GPU) as it arrives.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from models import gguf_blocks
from models.gguf_blocks import GGUFBlocks

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str | os.PathLike[str]) -> list[Path]:
    """The checkpoint's files: the shards its index names, else every *.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e}") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {model_dir}")
    return files


def iter_safetensors(
    model_dir: str | os.PathLike[str], dtype: torch.dtype | None = None,
    placeholders: Collection[str] = (), blocks: GGUFBlocks | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor cast to `dtype`) for every tensor of the checkpoint: those
    of its safetensors files, then the weights a converted GGUF keeps only as blocks
    (`models/gguf_convert.py`), dequantized to float32 (then `dtype`), except those named
    in `placeholders`: a caller that will not read their values (it serves them from
    the blocks) gets a meta tensor of their shape instead, and nothing is dequantized.
    `blocks`: those weights as the caller loaded them (`gguf_blocks.load` with the C++
    rewrite), else loaded here.

    `dtype` None: each tensor as the file stores it, a view of the mapped file (no copy,
    nothing read until used). The model's loader copies these into its parameters,
    converting as it copies: one pass over the bytes instead of a cast and then a copy.

    A truncated or corrupt file raises ValueError naming it; safetensors' own errors
    say what is wrong but not which of several shards is at fault.
    """
    seen = set()
    for path in safetensors_files(model_dir):
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as e:
            raise ValueError(f"{path} is not a readable safetensors file "
                             f"(truncated or corrupt?): {e}") from e
        with handle:
            for name in handle.keys():
                try:
                    tensor = handle.get_tensor(name)
                except Exception as e:
                    raise ValueError(f"{path}: cannot read tensor {name}: {e}") from e
                seen.add(name)
                yield name, tensor if dtype is None else tensor.to(dtype)
    # Written dense too in an export; the placeholders' blocks are never read.
    blocks = gguf_blocks.load(model_dir) if blocks is None else blocks
    for name in blocks:
        if name in seen:
            continue
        if name in placeholders:
            src = blocks.sources[name]
            yield name, torch.empty((src.out_features, src.in_features),
                                    dtype=dtype or torch.float32, device="meta")
        else:
            weight = blocks[name].dequantize()
            yield name, weight if dtype is None else weight.to(dtype)
