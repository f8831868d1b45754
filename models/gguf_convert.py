"""Convert a llama.cpp GGUF file into an HF-style model directory.

Everything downstream (the model, the weight loader, the tokenizer) reads one format,
an HF directory with `config.json` and safetensors. Converting a GGUF once into that
format lets it load like any HF checkpoint, so GGUF support is this one file rather
than a second loading path.
The weights whose GGUF type the CPU kernels read (Q4_0, Q4_1, Q4_K, Q5_0, Q8_0, Q3_K,
Q6_K, IQ4_NL, IQ4_XS: `models/gguf_blocks.py`, `models/gguf_repack.py`) are not
converted at all: the directory records where they lie in the GGUF, the CPU serves
them from those blocks alone, read from the file at each start, and a loader that needs
them dense (a GPU, `--attention-backend torch`) gets them dequantized from the blocks
(`models.weights.iter_safetensors`). So the directory is a few megabytes (config,
tokenizer, norms) whatever the model's size. The other tensors (norms, types with no
rewrite) are written dense in the dtype that will be served (bf16 on a GPU: half the
bytes of fp32, and the same values the loader would have cast to); float32 is the
exact path the parity tests use. `models.resolve.export_model` writes a complete HF
directory, every weight dense.

llama.cpp architectures `llama` (Llama, Mistral, SmolLM2), `qwen2` and `qwen3` map
onto HF checkpoints; others (phi3, gemma, ...) are refused, naming these. Only
`llama` permutes Q/K rows for its RoPE kernel; Qwen uses llama.cpp's NeoX rotation,
which is HF's rotate-half already.

The file is read with our own header reader (`models/gguf_file.py`: milliseconds,
where gguf-py's reader took seconds on a tokenizer's strings), not through
transformers, so the weight path stays independent of transformers' own GGUF loader;
the tests compare the two. gguf-py is imported only to dequantize a type with no
rewrite; serving an HF directory must work on a machine without it (the GPU box has
none). The tokenizer does go through transformers: rebuilding a BPE tokenizer from
GGUF vocab and merges is exactly what its converter already does well.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from models import gguf_blocks, gguf_repack
from models.gguf_file import GGUFFile, TensorInfo
from models.gguf_repack import undo_qk_permutation

log = logging.getLogger(__name__)

StrPath = str | os.PathLike[str]

# GGUF `general.architecture` -> the HF architecture its checkpoint becomes.
HF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
SUPPORTED_GGUF_ARCHITECTURES = tuple(HF_ARCHITECTURES)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# GGUF per-layer tensor suffix -> HF suffix under `model.layers.{i}.`; every architecture.
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# ... and the tensors only some architectures have (all of them required there).
_EXTRA_LAYER_TENSORS = {
    "llama": {},
    "qwen2": {f"attn_{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"},
    "qwen3": {"attn_q_norm.weight": "self_attn.q_norm.weight",
              "attn_k_norm.weight": "self_attn.k_norm.weight"},
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent when the embeddings are tied
}
_REQUIRED_GLOBAL = ("token_embd.weight", "output_norm.weight")


def convert_gguf_to_hf_dir(gguf_path: StrPath, out_dir: StrPath,
                           dtype: str = "float32") -> Path:
    """Write config, `dtype` safetensors, generation config and tokenizer to `out_dir`.

    The directory appears all at once: it is built in a temporary sibling and renamed
    into place, so a crash never leaves a half-written cache that looks complete. If
    another process renames its own finished copy in first, that copy is kept.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    if out_dir.exists():
        raise FileExistsError(f"output directory {out_dir} already exists")
    if dtype not in DTYPES:
        raise ValueError(f"cannot cache a GGUF as {dtype!r}; choose one of {tuple(DTYPES)}")
    reader = GGUFFile(gguf_path)
    meta = _Metadata(reader, gguf_path)
    _check_tensors(meta, reader)
    config = _hf_config(meta, reader, dtype)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # The pid in the name lets a later start tell an abandoned conversion from a live one.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.{os.getpid()}.", suffix=".tmp",
                                dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", _generation_config(config, meta))
        _save_tokenizer(gguf_path, meta, tmp)
        # The weights whose blocks are kept are not written at all: the load reads them
        # from the GGUF (`models/gguf_blocks.py`), and a loader that needs them dense
        # dequantizes them (`models.weights.iter_safetensors`).
        blocks = _block_sources(reader, config, gguf_path)
        save_file(_hf_tensors(reader, config, gguf_path, DTYPES[dtype], set(blocks)),
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "model.safetensors").chmod(0o644)
        gguf_blocks.save(blocks, gguf_path, tmp)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():
                raise
            log.info("another process finished converting %s first; using its copy", gguf_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
    return out_dir


class _Metadata:
    """Typed access to GGUF key-value metadata, with errors that name the file."""

    def __init__(self, reader: GGUFFile, path: Path) -> None:
        self.reader, self.path = reader, path
        self.arch = self.get("general.architecture")
        if self.arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise ValueError(f"{path}: GGUF architecture {self.arch!r} cannot be converted; "
                             f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)} (or pass "
                             "the model's HF directory)")

    def get(self, key: str, default: Any = ..., *, arch_key: bool = False) -> Any:
        value = self.reader.metadata.get(f"{self.arch}.{key}" if arch_key else key)
        if value is None:
            if default is ...:
                raise ValueError(f"{self.path}: GGUF metadata key {key!r} is missing")
            return default
        return value

    def arch_get(self, key: str, default: Any = ...) -> Any:
        return self.get(key, default, arch_key=True)


def _layer_tensors(arch: str) -> dict[str, str]:
    return _LAYER_TENSORS | _EXTRA_LAYER_TENSORS[arch]


def _check_tensors(meta: _Metadata, reader: GGUFFile) -> None:
    """Fail before the slow steps when the file lacks a tensor the model needs."""
    names = {t.name for t in reader.tensors}
    layers = int(meta.arch_get("block_count"))
    expected = _layer_tensors(meta.arch)
    missing = [n for n in _REQUIRED_GLOBAL if n not in names] + [
        f"blk.{i}.{s}" for i in range(layers) for s in expected if f"blk.{i}.{s}" not in names
    ]
    if missing:
        raise ValueError(f"{meta.path}: GGUF is missing {len(missing)} expected tensors, "
                         f"e.g. {missing[:3]}")
    if "rope_freqs.weight" in names:
        # Llama-3.1 style scaling baked into per-frequency factors; the HF parameters
        # (low/high frequency factors) cannot be recovered from them unambiguously.
        raise ValueError(f"{meta.path}: rope_freqs.weight (Llama 3.1 rope scaling) "
                         "is not supported")


def _hf_config(meta: _Metadata, reader: GGUFFile, dtype: str) -> dict[str, Any]:
    names = {t.name for t in reader.tensors}
    layers = int(meta.arch_get("block_count"))
    hidden = int(meta.arch_get("embedding_length"))
    heads = int(meta.arch_get("attention.head_count"))
    kv_heads = int(meta.arch_get("attention.head_count_kv", heads))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = int(meta.arch_get("vocab_size", int(embd.shape[-1])))  # GGUF shape: [hidden, vocab]
    bos = meta.get("tokenizer.ggml.bos_token_id", None)
    # An end-of-turn token distinct from eos (e.g. <|eot_id|>) must stop generation too.
    stop_ids = (meta.get(f"tokenizer.ggml.{key}_token_id", None) for key in ("eos", "eot"))
    eos_ids = list(dict.fromkeys(int(i) for i in stop_ids if i is not None))
    architecture, model_type = HF_ARCHITECTURES[meta.arch]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(meta.arch_get("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(meta.arch_get("attention.key_length", hidden // heads)),
        "rms_norm_eps": _f32(meta.arch_get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(meta.arch_get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.arch_get("context_length", 2048)),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "hidden_act": "silu",
        "torch_dtype": dtype,
    }
    if meta.arch == "llama":
        config |= {"attention_bias": False, "mlp_bias": False}
    else:
        config["use_sliding_window"] = False  # llama.cpp runs Qwen with full attention
    scaling = _rope_scaling(meta)
    if scaling:
        config["rope_scaling"] = scaling
    return config


def _f32(value: float) -> float:
    """GGUF stores float32: write 1e-05, not its float64 widening 9.999999747378752e-06."""
    return float(str(np.float32(value)))


def _rope_scaling(meta: _Metadata) -> dict[str, Any] | None:
    factor = meta.arch_get("rope.scaling.factor", None) or meta.arch_get("rope.scale_linear", None)
    kind = meta.arch_get("rope.scaling.type", "linear" if factor else "none")
    if kind == "none" or not factor or float(factor) == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        for gguf_key, hf_key in (
            ("rope.scaling.original_context_length", "original_max_position_embeddings"),
            ("rope.scaling.yarn_beta_fast", "beta_fast"),
            ("rope.scaling.yarn_beta_slow", "beta_slow"),
        ):
            value = meta.arch_get(gguf_key, None)
            if value is not None:
                scaling[hf_key] = value
        return scaling
    raise ValueError(f"{meta.path}: unsupported rope scaling type {kind!r}")


def _generation_config(config: dict[str, Any], meta: _Metadata) -> dict[str, Any]:
    pad = meta.get("tokenizer.ggml.padding_token_id", None)
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    if pad is not None:
        gen["pad_token_id"] = int(pad)
    return gen


def _hf_tensors(reader: GGUFFile, config: dict[str, Any], path: Path,
                dtype: torch.dtype, kept: set[str]) -> dict[str, torch.Tensor]:
    """Dequantize every tensor but those `kept` as blocks (to float32, then `dtype`) in
    HF shape, names and row order.

    Each tensor is cast as soon as it is dequantized, so the whole model is never held
    in float32 when a narrower dtype is asked for."""
    arch = reader.metadata["general.architecture"]
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _hf_name(t.name, arch)
        if name is None:
            log.warning("%s: skipping unknown GGUF tensor %s", path, t.name)
            continue
        if name in kept:
            continue
        shape = tuple(reversed(t.shape))  # GGUF lists dims fastest-first
        try:
            w = _dequantize(reader.read(t), t).reshape(shape)
        except Exception as e:
            raise ValueError(f"{path}: cannot dequantize tensor {t.name} "
                             f"({t.type_name}, shape {shape}): {e}") from e
        heads = _qk_heads(t.name, arch, config)
        out[name] = torch.tensor(w if heads is None else undo_qk_permutation(w, heads),
                                 dtype=dtype)  # a copy
    return out


def _dequantize(raw: np.ndarray, t: TensorInfo) -> np.ndarray:
    """A tensor's float32 values: the float types here, the others by gguf-py's
    dequantizer (imported only for them)."""
    if t.type_name == "F32":
        return raw.view(np.float32)
    if t.type_name == "F16":
        return raw.view(np.float16).astype(np.float32)
    if t.type_name == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(raw, GGMLQuantizationType[t.type_name]).astype(np.float32, copy=False)


def _block_sources(reader: GGUFFile, config: dict[str, Any], path: Path
                   ) -> dict[str, gguf_blocks.BlockSource]:
    """Where the blocks of every weight whose type the kernels read lie in the file
    (`models/gguf_repack.py`), by HF name. Logs the types left to the dense weights."""
    arch = reader.metadata["general.architecture"]
    sources, dense = {}, collections.Counter()
    for t in reader.tensors:
        name = _hf_name(t.name, arch)
        if not (name and t.rows):
            continue
        fmt = gguf_repack.format_of(t.type_name)
        if fmt is not None:
            sources[name] = gguf_blocks.BlockSource(
                t.name, t.type_name, t.offset, t.nbytes, t.rows, t.shape[0], fmt,
                _qk_heads(t.name, arch, config))
        elif t.type_name not in gguf_repack.DENSE_TYPES:
            dense[t.type_name] += t.n_elements
    if dense:
        log.warning("%s: no CPU kernel reads %s blocks yet: those weights are served "
                    "dequantized (%s)", path, ", ".join(dense),
                    ", ".join(f"{k} {n / 1e6:.1f}M weights" for k, n in dense.items()))
    return sources


def _qk_heads(gguf_name: str, arch: str, config: dict[str, Any]) -> int | None:
    """llama.cpp interleaves Q/K rotary rows only for `llama`: the heads to undo it over."""
    if arch != "llama":
        return None
    if gguf_name.endswith("attn_q.weight"):
        return config["num_attention_heads"]
    if gguf_name.endswith("attn_k.weight"):
        return config["num_key_value_heads"]
    return None


def _hf_name(gguf_name: str, arch: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    tensors = _layer_tensors(arch)
    if prefix == "blk" and layer.isdigit() and suffix in tensors:
        return f"model.layers.{layer}.{tensors[suffix]}"
    return None


def _save_tokenizer(gguf_path: Path, meta: _Metadata, out_dir: Path) -> None:
    """transformers' GGUF tokenizer conversion, with eos and chat template pinned to the GGUF."""
    tokenizer = _gguf_tokenizer(gguf_path)
    tokens = meta.get("tokenizer.ggml.tokens", [])
    eos_id = meta.get("tokenizer.ggml.eos_token_id", None)
    if eos_id is not None and int(eos_id) < len(tokens) and tokenizer.eos_token != tokens[eos_id]:
        tokenizer.eos_token = tokens[eos_id]
    template = meta.get("tokenizer.chat_template", None)
    if template and tokenizer.chat_template != template:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out_dir))


def _gguf_tokenizer(gguf_path: Path):
    """transformers' tokenizer for a GGUF. Where transformers has its GGUF tokenizer
    builder (5.x), call it directly: `AutoTokenizer` builds the same tokenizer but first
    parses the whole file for a model config (seconds, for nothing here)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
            get_gguf_tokenizer,
        )
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(gguf_path))
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return TokenizersBackend(tokenizer_object=backend, **tokenizer_config, **extra)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
