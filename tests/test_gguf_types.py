"""GGUF weight types rewritten into the kernels' two block formats (`models/gguf_repack.py`).

Each type's blocks must give gguf-py's own dequantized values bit for bit: through the
rewritten blocks' arithmetic (`QuantizedWeight.dequantize`) and through the C++ kernels
(x = the identity gives the weights themselves). A GGUF written with such tensors
converts into a checkpoint whose dense weights its blocks decode to exactly, and a type
with no rewrite is named in the log, never silently widened.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from gpu.cpu.kernels.build import cpu_kernels
from gpu.cpu.linear import quantized_max_rows
from gpu.cpu.panel_blocks import PanelBlocks
from models import gguf_blocks, gguf_repack
from models.gguf_blocks import QuantizedWeight

KERNELS = cpu_kernels() if not torch.cuda.is_available() else None
needs_kernels = pytest.mark.skipif(
    KERNELS is None or quantized_max_rows(KERNELS) is None,
    reason="C++ CPU kernels not built here, or without vector paths")

# Byte offsets of each type's f16 fields, to be set to sane values (random bytes there
# could be NaN or huge); every other byte of these types is valid whatever its value.
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_0": (0,),
              "IQ4_NL": (0,), "IQ4_XS": (0,), "Q6_K": (208,), "Q3_K": (108,),
              "Q5_K": (0, 2)}
FORMAT = {"Q4_0": "q4_1", "Q4_1": "q4_1", "Q4_K": "q4_1", "Q6_K": "q8_16", "Q3_K": "q8_16"}


def random_blocks(type_name: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """[rows, bytes] of valid random blocks of `type_name` for a [rows, k] weight."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    per, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, k // per, size), dtype=np.uint8)
    for at in F16_FIELDS[type_name]:
        scale = (rng.standard_normal((rows, k // per)) * 0.01).astype(np.float16)
        raw[..., at:at + 2] = scale[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def gguf_values(type_name: str, raw: np.ndarray, rows: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32)
    return torch.from_numpy(values.reshape(rows, -1))


def rewritten(type_name: str, raw: np.ndarray, rows: int) -> QuantizedWeight:
    fmt, arrays = gguf_repack.repack(type_name, raw, rows)
    t = {k: torch.from_numpy(v) for k, v in arrays.items()}
    return QuantizedWeight(fmt, t["qweight"], t["scales"], t.get("mins"), t.get("supers"))


@pytest.mark.parametrize("type_name", sorted(gguf_repack.REPACKERS))
def test_each_type_decodes_to_gguf_pys_values_exactly(type_name):
    rows, k = 40, 512
    raw = random_blocks(type_name, rows, k)
    q = rewritten(type_name, raw, rows)
    assert q.format == FORMAT.get(type_name, "q8_0") and q.out_features == rows
    assert torch.equal(q.dequantize(), gguf_values(type_name, raw, rows))


@needs_kernels
@pytest.mark.parametrize("type_name", sorted(gguf_repack.REPACKERS))
def test_the_kernels_give_each_types_weights_exactly(type_name):
    """x = identity rows: every output is one weight, d * q (+ m) rounded once."""
    rows, k = 40, 256
    raw = random_blocks(type_name, rows, k, seed=1)
    q = rewritten(type_name, raw, rows)
    panels = PanelBlocks.of(q)
    op = getattr(KERNELS, f"{q.format}_linear")
    eye = torch.eye(k)
    values = gguf_values(type_name, raw, rows)
    for part in (slice(0, 1), slice(0, 5), slice(None)):  # per-block, direct, buffered
        assert torch.equal(op(eye[part], *panels.tensors, rows).T, values[:, part])


def test_a_type_without_a_rewrite_is_not_kept():
    raw = random_blocks("Q5_K", 8, 256)
    assert gguf_repack.repack("Q5_K", raw, 8) is None


def write_quantized_gguf(path, cfg, tensors: dict[str, np.ndarray], types: dict[str, str]):
    """A llama-architecture GGUF: float32 `tensors` (HF names), each written as its
    `types` entry (raw blocks, as llama-quantize would leave them) or as float32."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

    from models.resolve import default_gguf_path
    from tests.test_model_loading import gguf_name

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    for key, field in GGUFReader(default_gguf_path()).fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub)
    for name, array in tensors.items():
        kind = types.get(name)
        if kind is None:
            writer.add_tensor(gguf_name(name), array)
        else:
            writer.add_tensor(gguf_name(name), array,
                              raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


LAYER_TYPES = {"self_attn.q_proj": "Q4_K", "self_attn.k_proj": "Q4_K",
               "self_attn.v_proj": "Q5_0", "self_attn.o_proj": "IQ4_XS",
               "mlp.gate_proj": "Q4_K", "mlp.up_proj": "Q6_K", "mlp.down_proj": "Q5_K"}


@pytest.fixture(scope="module")
def k_quant_gguf(tmp_path_factory):
    """A two-layer llama GGUF whose linears mix K-quant and other types, as
    llama-quantize's K-quant mixes do (a Q6_K up projection beside Q4_K gate), with a
    type that has no rewrite (Q5_K), a Q6_K LM head and a Q4_K embedding (untied, as an
    8B's); the weights' blocks are random."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, rms_norm_eps=1e-6)
    shapes = {"self_attn.q_proj": (256, 256), "self_attn.k_proj": (128, 256),
              "self_attn.v_proj": (128, 256), "self_attn.o_proj": (256, 256),
              "mlp.gate_proj": (512, 256), "mlp.up_proj": (512, 256),
              "mlp.down_proj": (256, 512)}
    tensors: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": random_blocks("Q4_K", 49152, 256, seed=2),
        "lm_head.weight": random_blocks("Q6_K", 49152, 256, seed=1),
        "model.norm.weight": np.ones(256, np.float32)}
    types = {"lm_head.weight": "Q6_K", "model.embed_tokens.weight": "Q4_K"}
    for layer in range(2):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{layer}.{norm}.weight"] = np.ones(256, np.float32)
        for i, (module, (n, k)) in enumerate(shapes.items()):
            name = f"model.layers.{layer}.{module}.weight"
            tensors[name] = random_blocks(LAYER_TYPES[module], n, k, seed=10 * layer + i)
            types[name] = LAYER_TYPES[module]
    path = tmp_path_factory.mktemp("kquant") / "mixed.gguf"
    return write_quantized_gguf(path, cfg, tensors, types), types


def test_a_k_quant_gguf_converts_with_blocks_and_names_the_rest(k_quant_gguf, tmp_path,
                                                                 caplog):
    """The blocks decode to the checkpoint's values exactly (as a loader reads them, the
    kept ones dequantized from the blocks); the Q5_K weights are dense and the log names
    their type."""
    from models.gguf_convert import convert_gguf_to_hf_dir
    from models.weights import iter_safetensors

    path, types = k_quant_gguf
    with caplog.at_level(logging.WARNING):
        out = convert_gguf_to_hf_dir(path, tmp_path / "converted", "float32")
    assert "Q5_K" in caplog.text and "served dequantized" in caplog.text
    blocks = gguf_blocks.load(out)
    dense = dict(iter_safetensors(out, torch.float32))
    assert set(blocks) == {n for n, t in types.items() if t != "Q5_K"}
    assert {n.split(".")[-2]: q.format for n, q in blocks.items() if "layers.0" in n} == {
        "q_proj": "q4_1", "k_proj": "q4_1", "v_proj": "q8_0", "o_proj": "q8_0",
        "gate_proj": "q4_1", "up_proj": "q8_16"}
    assert blocks["lm_head.weight"].format == "q8_16"
    for name, q in blocks.items():
        assert torch.equal(q.dequantize(), dense[name]), name


def test_a_k_quant_gguf_serves_what_transformers_computes(k_quant_gguf, tmp_path,
                                                          monkeypatch):
    """transformers' own GGUF loader (gguf-py's dequantizer) reads the same file: greedy
    ids equal through the engine in float32, the split q/k/v (Q4_K beside Q5_0), the
    Q6_K layers and head on their blocks."""
    from models.resolve import CACHE_ENV
    from tests.hf_reference import gguf_greedy_both

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))  # its conversion: not the user's cache
    path, _ = k_quant_gguf
    ours, theirs = gguf_greedy_both(path, [[5, 600, 7000, 42, 9], [17] * 3,
                                           list(range(100, 140))], 8, 128)
    assert ours == theirs


@needs_kernels
@pytest.mark.parametrize("type_name", sorted(gguf_repack.REPACKERS))
def test_the_cpp_rewrite_is_the_reference_bit_for_bit(type_name):
    """The load's rewrite (`gguf_repack` in the CPU kernels) gives the numpy reference's
    levels, scales and minimums exactly, rows taken in the order asked (llama's q/k)."""
    rows, k = 48, 512
    raw = random_blocks(type_name, rows, k, seed=2)
    fmt, ref = gguf_repack.repack(type_name, raw, rows)
    order = np.random.default_rng(3).permutation(rows)
    for source_rows in (None, order):
        q, d, m = KERNELS.gguf_repack(type_name, torch.from_numpy(raw), None
                                      if source_rows is None else torch.from_numpy(order))
        pick = slice(None) if source_rows is None else order
        assert q.numpy().tobytes() == ref["qweight"][pick].tobytes()
        assert d.numpy().tobytes() == ref["scales"][pick].tobytes()
        third = {"q4_1": "mins", "q8_16": "supers"}.get(fmt)  # q8_0: none
        assert m.numpy().tobytes() == (ref[third][pick].tobytes() if third else b"")


def test_a_converted_gguf_keeps_no_copy_of_its_blocks(k_quant_gguf, tmp_path):
    """The directory records where the blocks lie and reads them from the GGUF itself:
    its files are a small fraction of the GGUF's bytes; blocks read through the C++
    rewrite equal the numpy reference's; a GGUF changed or gone since is refused by name
    rather than read as something else."""
    import os

    from models.gguf_convert import convert_gguf_to_hf_dir

    path, types = k_quant_gguf
    out = convert_gguf_to_hf_dir(path, tmp_path / "converted", "float32")
    kept = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()
               and f.name not in ("tokenizer.json", "model.safetensors"))
    assert kept < 0.01 * path.stat().st_size
    reference = gguf_blocks.load(out)
    if KERNELS is not None:
        fast = gguf_blocks.load(out, repack=KERNELS.gguf_repack)
        for name in ("model.layers.1.self_attn.q_proj.weight", "lm_head.weight",
                     "model.layers.0.mlp.up_proj.weight"):
            a, b = fast[name], reference[name]
            assert a.format == b.format and torch.equal(a.qweight, b.qweight)
            assert torch.equal(a.scales, b.scales)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(FileNotFoundError, match="has changed since"):
        gguf_blocks.load(out)
    path.rename(tmp_path / "moved.gguf")
    try:
        with pytest.raises(FileNotFoundError, match="no longer exists"):
            gguf_blocks.load(out)
    finally:
        (tmp_path / "moved.gguf").rename(path)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@needs_kernels
@pytest.mark.parametrize("type_name", sorted(gguf_repack.REPACKERS))
def test_panels_written_straight_from_the_gguf_are_the_row_orders(type_name):
    """`gguf_repack_panels_` (the load's one pass into the kernels' layout) gives what the
    row-order rewrite stacked and laid out by `PanelBlocks.of` gives, bit for bit: two
    parts stacked (the second from row 32, its rows reordered as llama's q/k are, its last
    panel partial and filled with zeros), and Q4_1's dot pairs."""
    k = 512
    parts = [random_blocks(type_name, 32, k, seed=4), random_blocks(type_name, 40, k, seed=5)]
    order = np.random.default_rng(6).permutation(40)
    rows = [rewritten(type_name, parts[0], 32), rewritten(type_name, parts[1][order], 40)]
    reference = PanelBlocks.of(QuantizedWeight.stack(rows))
    fmt = reference.format
    levels, *rest = (torch.full_like(t, 7) for t in reference.tensors)  # not zeros
    # Q8_16's scales are its codes and supers; the others' float32 scales (and mins).
    scales, mins, codes = ((None, None, rest) if fmt == "q8_16"
                           else (rest[0], rest[1] if len(rest) > 1 else None, (None, None)))
    dot = torch.full((3, k // 32, 4, 32), 7, dtype=torch.int32) if fmt == "q4_1" else None
    for raw, source_rows, row0 in ((parts[0], None, 0), (parts[1], order, 32)):
        KERNELS.gguf_repack_panels_(type_name, torch.from_numpy(raw), None if source_rows
                                    is None else torch.from_numpy(source_rows),
                                    levels.view(3, -1, 32), scales, mins, dot, *codes, row0)
    for a, b in zip((levels, *rest), reference.tensors, strict=True):
        assert a.numpy().tobytes() == b.numpy().tobytes()
    if dot is not None:
        assert torch.equal(dot, reference.dot_pairs(KERNELS))


@needs_kernels
def test_an_untied_embedding_is_looked_up_from_its_own_blocks(k_quant_gguf, tmp_path):
    """The fixture's Q4_K embedding (its head is a Q6_K tensor of its own): the load
    leaves the dense table unfilled and looks tokens up from the embedding's blocks, read
    into panels; the rows are the dense table's (gguf-py's values)."""
    from gpu.cpu.block_embedding import BlockEmbedding
    from gpu.cpu.packing import pack_linears, params_not_needed
    from models.gguf_convert import convert_gguf_to_hf_dir
    from tests.test_quantized_weights import load_model

    out = convert_gguf_to_hf_dir(k_quant_gguf[0], tmp_path / "converted", "float32")
    model = load_model(out)
    blocks = gguf_blocks.load(out, repack=KERNELS.gguf_repack)
    assert "embed_tokens.weight" in params_not_needed(model, blocks, KERNELS)
    dense = model.embed_tokens.weight.detach().clone()
    pack_linears(model, blocks, KERNELS)
    assert isinstance(model.embed_tokens, BlockEmbedding) and model.lm_head is not None
    ids = torch.tensor([0, 31, 32, 4097, 49151, 4097])
    assert torch.equal(model.embed_tokens(ids), dense[ids])
