"""Each GGUF weight type's blocks rewritten, exactly, in one of the kernels' formats.

The CPU kernels read three block formats (`models/gguf_blocks.py`): `q4_1`, 32 levels
of 4 bits with a float32 scale and minimum (w = d*q + m); `q8_0`, 32 int8 levels with a
float32 scale (w = d*q); `q8_16`, int8 levels in [-32, 31] with a scale per 16 given as an
int8 code times a float32 scale per 256 (w = (code * super) * q). The types
llama.cpp users ship are these in other clothes, so they are rewritten as a load reads
them rather than given kernels of their own (this module is the reference and the
portable path; `gpu/cpu/kernels/gguf_repack.cpp` does the same in one pass where the CPU
kernels are built):

| GGUF type | as | how |
| --- | --- | --- |
| Q4_0 | q4_1 | the same nibbles; m = -8d |
| Q4_K | q4_1 | per 32: d = d_f16 * sc, m = -(dmin_f16 * mn) (6-bit sc, mn); nibbles re-paired |
| Q5_0 | q8_0 | the 5-bit level minus 16 as int8 |
| IQ4_NL | q8_0 | the 4-bit index looked up in the type's 16 int8 values |
| IQ4_XS | q8_0 | per 32: d = d_f16 * (6-bit scale - 32), levels looked up as IQ4_NL |
| Q6_K | q8_16 | code = the int8 scale, super = d_f16; the 6-bit level minus 32 |
| Q3_K | q8_16 | code = 6-bit scale - 32, super = d_f16; 3-bit level, -4 where hmask is clear |

Exactness: gguf-py dequantizes each of these in float32 as `d * q` (and `- dm`), with d
and dm themselves products of an f16 and a small integer, exact in float32. Every scale
and minimum here is that same product (q8_16 keeps its two factors and multiplies them
where a weight is computed) and every level that same integer, so each weight
the kernels compute (`d * q + m`, or `q * d`) is gguf-py's bit for bit
(`tests/test_gguf_types.py` checks every type against `gguf.quants.dequantize`).
The cost is bytes: a Q4_K weight takes 0.75 bytes in q4_1 against 0.5625 in the file
(the CPU kernels read a Q4_K's own scale codes instead: `q4_1_scales.h`), an IQ4 or Q5_0
one 1.125 against ~0.56-0.69. A q8_16 weight takes 1.08 bytes in row order; the CPU
kernels' panels pack its levels to 6 bits (`gpu/cpu/panel_blocks.py`), 0.83 bytes, as
a Q6_K file's 0.82 (a Q3_K's 0.43).

Types not listed (Q5_1, Q2_K, Q5_K, the other IQ types) are not kept as blocks: those
weights are served from the dequantized checkpoint, and the conversion says so with
each type's name and weight count (`models/gguf_convert.py`).

The rows of llama's q and k are reordered too (`undo_qk_permutation`): llama.cpp
interleaves each head's rotary pairs, HF rotates its two halves.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

QK_K = 256  # weights per K-quant super-block
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                      dtype=np.int8)

# format -> its arrays per row: q4_1 {"qweight": uint8 [K/2], "scales", "mins": f32 [K/32]},
# q8_0 {"qweight": int8 [K], "scales": f32 [K/32]}, q8_16 {"qweight": int8 [K], "scales":
# int8 codes [K/16], "supers": f32 [K/256]}.
Arrays = dict[str, np.ndarray]


def _f16(raw: np.ndarray) -> np.ndarray:
    """Two bytes at the end of `raw`'s last axis' slice, as float32 values of an f16."""
    return raw.copy().view(np.float16).astype(np.float32)[..., 0]


def _pair_nibbles(levels: np.ndarray) -> np.ndarray:
    """Levels [..., 32] (0-15) as Q4_1's 16 bytes: byte j = level j | level j+16 << 4."""
    return (levels[..., :16] | (levels[..., 16:] << 4)).astype(np.uint8)


def _q4_0(blocks: np.ndarray) -> Arrays:
    d = _f16(blocks[..., 0:2])
    return {"qweight": blocks[..., 2:], "scales": d, "mins": d * np.float32(-8)}


def _q4_1(blocks: np.ndarray) -> Arrays:
    return {"qweight": blocks[..., 4:], "scales": _f16(blocks[..., 0:2]),
                    "mins": _f16(blocks[..., 2:4])}


def _q8_0(blocks: np.ndarray) -> Arrays:
    return {"qweight": blocks[..., 2:].view(np.int8), "scales": _f16(blocks[..., 0:2])}


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's twelve bytes of 6-bit scales and minimums: ([..., 8], [..., 8])."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(blocks: np.ndarray) -> Arrays:
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, mn = _k_scales(blocks[..., 4:16])
    qs = blocks[..., 16:].reshape(*blocks.shape[:-1], 4, 1, 32)  # 4 runs of 64 weights
    levels = (qs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F  # [.., 4, 2, 32]
    levels = levels.reshape(*blocks.shape[:-1], 8, 32)  # sub-block s = 2 * run + half
    shape = (*blocks.shape[:-2], -1)
    return {"qweight": _pair_nibbles(levels).reshape(shape),
                    "scales": (d[..., None] * sc).reshape(shape),
                    "mins": -(dmin[..., None] * mn).reshape(shape)}


def _q5_0(blocks: np.ndarray) -> Arrays:
    d = _f16(blocks[..., 0:2])
    high = blocks[..., 2:6].copy().view(np.uint32)  # [..., 1]: bit j is level j's fifth
    low = blocks[..., 6:22]
    nibbles = np.concatenate([low & 0x0F, low >> 4], axis=-1).astype(np.int16)
    fifth = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)
    return {"qweight": (nibbles | (fifth << 4)) - 16, "scales": d}


def _iq4_levels(qs: np.ndarray) -> np.ndarray:
    """16 bytes of IQ4 indices -> 32 int8 levels (low nibbles first, as in Q4_0)."""
    return IQ4_VALUES[np.concatenate([qs & 0x0F, qs >> 4], axis=-1)]


def _iq4_nl(blocks: np.ndarray) -> Arrays:
    return {"qweight": _iq4_levels(blocks[..., 2:]), "scales": _f16(blocks[..., 0:2])}


def _iq4_xs(blocks: np.ndarray) -> Arrays:
    d = _f16(blocks[..., 0:2])
    high = blocks[..., 2:4].copy().view(np.uint16)  # [..., 1]: 2 bits per sub-block
    low = blocks[..., 4:8]
    low = np.stack([low & 0x0F, low >> 4], axis=-1).reshape(*low.shape[:-1], 8)
    high = ((high >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8)
    scale = (low | (high << 4)).astype(np.float32) - 32
    levels = _iq4_levels(blocks[..., 8:].reshape(*blocks.shape[:-1], 8, 16))
    shape = (*blocks.shape[:-2], -1)
    scales = (d[..., None] * scale).reshape(shape)
    return {"qweight": levels.reshape(shape), "scales": scales}


def _q6_k(blocks: np.ndarray) -> Arrays:
    ql, qh = blocks[..., 0:128], blocks[..., 128:192]
    sc, d = blocks[..., 192:208].view(np.int8), _f16(blocks[..., 208:210])
    # Two runs of 128 weights: ql's 64 bytes give 32 weights per nibble half, qh's 32
    # bytes two bits per weight for four groups of 32.
    ql = ql.reshape(*ql.shape[:-1], 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
    ql = (ql & 0x0F).reshape(*blocks.shape[:-1], 2, 4, 32)
    qh = qh.reshape(*qh.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    levels = (ql | ((qh & 3) << 4)).astype(np.int16) - 32
    shape = (*blocks.shape[:-2], -1)
    return {"qweight": levels.reshape(shape), "scales": sc.reshape(shape),
            "supers": d.reshape(shape)}


def _q3_k(blocks: np.ndarray) -> Arrays:
    hmask, qs, packed = blocks[..., 0:32], blocks[..., 32:96], blocks[..., 96:108]
    d = _f16(blocks[..., 108:110])
    low = packed[..., 0:8].reshape(*packed.shape[:-1], 1, 8) >> np.array([0, 4], np.uint8
                                                                         ).reshape(2, 1)
    high = packed[..., 8:12].reshape(*packed.shape[:-1], 1, 4) >> np.array(
        [0, 2, 4, 6], np.uint8).reshape(4, 1)
    scale = ((low.reshape(*packed.shape[:-1], 16) & 0x0F)
             | ((high.reshape(*packed.shape[:-1], 16) & 3) << 4)).astype(np.int16) - 32
    low2 = qs.reshape(*qs.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8
                                                            ).reshape(4, 1)
    bit = hmask.reshape(*hmask.shape[:-1], 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
    low2 = (low2 & 3).reshape(*blocks.shape[:-1], 256).astype(np.int16)
    bit = (bit & 1).reshape(*blocks.shape[:-1], 256).astype(np.int16)
    levels = low2 - ((bit ^ 1) << 2)  # 4 is taken away where the high bit is clear
    shape = (*blocks.shape[:-2], -1)
    return {"qweight": levels.reshape(shape), "scales": scale.reshape(shape),
            "supers": d.reshape(shape)}


def undo_qk_permutation(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute()` on attn_q (n_head) / attn_k (n_head_kv) rows.

    llama.cpp stores each head's rotary rows interleaved (pairs x0,x1 adjacent) for its
    RoPE kernel; HF Llama rotates the two halves of a head (x_i with x_{i+d/2}). The
    forward map is `reshape(n_head, 2, d/2, ...).swapaxes(1, 2)`; this swaps back.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute {rows} rows into {n_head} heads of even size")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# GGUF type name -> (the kernels' format, weights per block, bytes per block, the rewrite
# of [rows, blocks, bytes]).
REPACKERS: dict[str, tuple[str, int, int, Callable[[np.ndarray], Arrays]]] = {
    "Q4_0": ("q4_1", 32, 18, _q4_0),
    "Q4_1": ("q4_1", 32, 20, _q4_1),
    "Q8_0": ("q8_0", 32, 34, _q8_0),
    "Q4_K": ("q4_1", QK_K, 144, _q4_k),
    "Q5_0": ("q8_0", 32, 22, _q5_0),
    "IQ4_NL": ("q8_0", 32, 18, _iq4_nl),
    "IQ4_XS": ("q8_0", QK_K, 136, _iq4_xs),
    "Q6_K": ("q8_16", QK_K, 210, _q6_k),
    "Q3_K": ("q8_16", QK_K, 110, _q3_k),
}
# Types served as the dense checkpoint's values, needing no blocks.
DENSE_TYPES = ("F32", "F16", "BF16")


def format_of(type_name: str) -> str | None:
    """The kernels' format a GGUF type is served in, or None where it has no rewrite."""
    entry = REPACKERS.get(type_name)
    return None if entry is None else entry[0]


def repack(type_name: str, raw: np.ndarray, rows: int) -> tuple[str, Arrays] | None:
    """One GGUF tensor's bytes ([rows, bytes per row], or flat) in a kernels' format, or
    None where `type_name` has no rewrite. Arrays are [rows, ...], contiguous."""
    entry = REPACKERS.get(type_name)
    if entry is None:
        return None
    fmt, _, per_block, rewrite = entry
    arrays = rewrite(np.asarray(raw, dtype=np.uint8).reshape(rows, -1, per_block))
    dtypes = {"qweight": np.uint8 if fmt == "q4_1" else np.int8,
              "scales": np.int8 if fmt == "q8_16" else np.float32, "mins": np.float32,
              "supers": np.float32}
    return fmt, {k: np.ascontiguousarray(v.reshape(rows, -1), dtype=dtypes[k])
                 for k, v in arrays.items()}
