"""LoRA adapters in PEFT's format, read into the decoder's own (fused) linears.

An adapter is a directory with `adapter_config.json` and `adapter_model.safetensors`,
as `peft`'s `save_pretrained` writes it. Each adapted HF linear `W` (out x in) carries
`lora_A` (r x in) and `lora_B` (out x r); the adapted layer computes
`W x + scale * B (A x)`, `scale = lora_alpha / r` (rsLoRA: `lora_alpha / sqrt(r)`).

Our decoder fuses HF's q/k/v and gate/up projections into one linear each
(`checkpoint_layout`). Their adapters are fused the same way: the parts' A matrices are
stacked (rank r_q + r_k + r_v) and their B matrices placed block-diagonally, each in the
rows its projection owns in the fused output, so one low-rank product gives every
part's delta in its own slice and nothing in the others. A checkpoint fused already
(Phi-3's `qkv_proj`, `gate_up_proj`) has adapters on the fused module: they apply
whole. The scale is folded into B here, once.

What the serving path does not do is refused with the reason (`AdapterError`), never
served wrong: DoRA, trained biases, `modules_to_save` (full copies of other layers),
per-module rank or alpha patterns, embedding or LM-head adapters, pickled weights.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` (an adapter name
# such as `.default` may follow lora_A/lora_B in files saved by some tools).
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?(?P<module>.+)\."
                     r"lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$")


class AdapterError(ValueError):
    """The adapter cannot be served: missing, corrupt, too large, or for another base."""


@dataclass(frozen=True)
class AdapterConfig:
    """What serving reads from `adapter_config.json`."""

    rank: int
    alpha: float
    use_rslora: bool
    base_model_name: str | None

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @classmethod
    def read(cls, adapter_dir: Path, max_rank: int) -> AdapterConfig:
        path = adapter_dir / CONFIG_FILE
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise AdapterError(f"{adapter_dir} has no {CONFIG_FILE}: not a PEFT adapter") from e
        except (OSError, ValueError) as e:
            raise AdapterError(f"{path} is not readable JSON: {e}") from e
        if not isinstance(raw, dict):
            raise AdapterError(f"{path} is not a JSON object")
        kind = raw.get("peft_type", "LORA")
        if str(kind).upper() != "LORA":
            raise AdapterError(f"{path}: peft_type {kind!r} is not served (only LORA)")
        refusals = {
            "use_dora": "DoRA adapters are not served",
            "modules_to_save": "modules_to_save (full copies of other layers) is not served",
            "rank_pattern": "per-module ranks (rank_pattern) are not served",
            "alpha_pattern": "per-module alphas (alpha_pattern) are not served",
            "fan_in_fan_out": "fan_in_fan_out (Conv1D bases) is not served",
            "use_qalora": "QALoRA adapters are not served",
        }
        for key, why in refusals.items():
            if raw.get(key):
                raise AdapterError(f"{path}: {why}")
        if raw.get("bias", "none") != "none":
            raise AdapterError(f"{path}: bias={raw['bias']!r}: adapters that train biases "
                               "are not served (only bias=\"none\")")
        rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise AdapterError(f"{path}: r must be a positive integer, got {rank!r}")
        if rank > max_rank:
            raise AdapterError(f"{path}: rank {rank} is above --max-lora-rank {max_rank}")
        if not isinstance(alpha, int | float) or isinstance(alpha, bool):
            raise AdapterError(f"{path}: lora_alpha must be a number, got {alpha!r}")
        return cls(rank, float(alpha), bool(raw.get("use_rslora", False)),
                   raw.get("base_model_name_or_path"))


@dataclass(frozen=True)
class Target:
    """Where an HF linear's adapter lands: our linear, and its rows in that linear's output."""

    module: str
    offset: int
    rows: int


def read_adapter(adapter_dir: str | Path, targets: Mapping[str, Target],
                 shapes: Mapping[str, tuple[int, int]], max_rank: int,
                 dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapter's low-rank pair per linear of ours: `{module: (A, B)}`, A (R x in) and
    B (out x R) with the scale folded in, fused parts stacked (R = the parts' ranks).

    `targets`: HF module name (without `model.`) -> `Target`, for every linear an adapter
    may name; `shapes`: our module -> (out, in). Raises AdapterError on anything it
    cannot serve exactly."""
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise AdapterError(f"{adapter_dir} is not a directory")
    config = AdapterConfig.read(adapter_dir, max_rank)
    pairs = _read_pairs(adapter_dir)
    if not pairs:
        raise AdapterError(f"{adapter_dir / WEIGHTS_FILE} holds no lora_A/lora_B tensors")
    parts: dict[str, list[tuple[Target, torch.Tensor, torch.Tensor]]] = {}
    for name, (a, b) in sorted(pairs.items()):
        target = targets.get(name)
        if target is None:
            raise AdapterError(f"the adapter adapts {name!r}, which this model has no "
                               "adaptable linear for (q/k/v/o and gate/up/down are served)")
        out, inp = shapes[target.module]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise AdapterError(f"{name}: lora_A {tuple(a.shape)} and lora_B "
                               f"{tuple(b.shape)} are not a low-rank pair")
        if r > max_rank:
            raise AdapterError(f"{name}: rank {r} is above --max-lora-rank {max_rank}")
        if a.shape[1] != inp or b.shape[0] != target.rows:
            raise AdapterError(
                f"{name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit this "
                f"model's layer ({target.rows} x {inp}): an adapter for another base model?")
        parts.setdefault(target.module, []).append((target, a, b))
    return {module: _fuse(p, shapes[module][0], config.scale, dtype)
            for module, p in parts.items()}


def _read_pairs(adapter_dir: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF module name -> (lora_A, lora_B), float32, from the safetensors file."""
    path = adapter_dir / WEIGHTS_FILE
    if not path.is_file():
        pickled = adapter_dir / "adapter_model.bin"
        why = " (a pickled adapter_model.bin is not loaded: save with safetensors)" \
            if pickled.exists() else ""
        raise AdapterError(f"{adapter_dir} has no {WEIGHTS_FILE}{why}")
    halves: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                m = _TENSOR.match(key)
                if m is None:
                    raise AdapterError(f"{path}: tensor {key!r} is not a LoRA A or B weight "
                                       "(embedding, LM-head, bias or DoRA tensors are not "
                                       "served)")
                halves.setdefault(m["module"], {})[m["ab"]] = f.get_tensor(key).float()
    except AdapterError:
        raise
    except Exception as e:
        raise AdapterError(f"{path} is not a readable safetensors file (truncated or "
                           f"corrupt?): {e}") from e
    pairs = {}
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{path}: {module} has lora_{'A' if 'A' in ab else 'B'} "
                               "without its other half")
        pairs[module] = (ab["A"], ab["B"])
    return pairs


def _fuse(parts: list[tuple[Target, torch.Tensor, torch.Tensor]], out: int, scale: float,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One linear's pair from its parts: A stacked, B block-diagonal in the parts' rows."""
    parts = sorted(parts, key=lambda p: p[0].offset)
    a = torch.cat([p[1] for p in parts])
    b = torch.zeros(out, a.shape[0])
    col = 0
    for target, pa, pb in parts:
        b[target.offset:target.offset + target.rows, col:col + pa.shape[0]] = pb * scale
        col += pa.shape[0]
    return a.to(dtype).contiguous(), b.to(dtype).contiguous()


def adaptable(model: torch.nn.Module, names: tuple[str, ...]) -> tuple[
        dict[str, Target], dict[str, int]]:
    """The linears of `model` an adapter may adapt (attribute names in `names`): HF module
    name -> `Target`, and our module -> how many HF parts it fuses (its rank budget is
    that many times the largest rank)."""
    layout = model.checkpoint_layout()
    ours = {prefix: m for prefix, m in model.named_modules() if prefix.rsplit(".", 1)[-1] in names}
    targets: dict[str, Target] = {}
    fused: dict[str, int] = {}
    for hf, (param, offset, rows) in layout.items():
        module = param.removesuffix(".weight")
        if hf.endswith(".weight") and module in ours:
            targets[hf.removesuffix(".weight")] = Target(module, offset, rows)
            fused[module] = fused.get(module, 0) + 1
    for prefix, m in ours.items():
        targets.setdefault(prefix, Target(prefix, 0, m.out_features))
        fused.setdefault(prefix, 1)
    return targets, fused
