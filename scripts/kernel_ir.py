"""Compile the Triton kernels for Hopper (sm_90) without a GPU and report what matters.

`python3 scripts/kernel_ir.py [OUT_DIR] [--json]` builds each kernel at Llama-3-8B
shapes with Triton's own compiler and the `ptxas` it ships, and prints per kernel:
registers per thread, spill stores and loads (`ptxas -v`), shared memory, the
asynchronous copies the software pipeline issues (`async_copy_global_to_local` in the
TTGIR: 0 means every load waits for its data), and how many tiles deep its shared
buffers are (1: one tile in flight while the current one is used). With OUT_DIR the
TTGIR and PTX are written there; `--json` prints the figures as JSON instead of a table.
Nothing runs; no GPU is needed, only triton and its ptxas. Run it with
`TRITON_INTERPRET` unset (the interpreter's kernels cannot be compiled).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from gpu.triton import (  # noqa: E402
    decode_splits,
    kv_store,
    lora,
    paged_decode,
    prefill,
    rms_norm,
    rotary_kv_store,
)
from gpu.triton import silu_and_mul as silu  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BF16 = "*bf16"


def _specialize(fn, pointers: dict[str, str], constexprs: dict):
    """(signature, constexprs, attrs) as Triton's JIT would see them at real shapes: every
    stride of the last (head) dimension is 1, which the JIT turns into a constant; other
    strides and every pointer are multiples of 16 (`tt.divisibility`), which is what lets
    loads vectorize and go asynchronous. The float scalars named here are fp32."""
    floats = {"scale_log2", "eps"}
    sig, constants, attrs = {}, dict(constexprs), {}
    for i, name in enumerate(fn.arg_names):
        unit = name.startswith("stride") and (name.endswith("d") or name.endswith("_dim"))
        if name in constexprs or unit:
            sig[name] = "constexpr"
            constants.setdefault(name, 1)
        elif name in pointers:
            sig[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name.startswith("stride"):
            sig[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name in floats else "i32"
    return sig, constants, attrs


def kernels() -> dict[str, tuple]:
    """(jit function, pointer types, constexprs, options) per kernel, Llama-3-8B shapes."""
    decode_ptrs = {"q_ptr": BF16, "k_cache_ptr": BF16, "v_cache_ptr": BF16,
                   "block_tables_ptr": "*i32", "context_lens_ptr": "*i32",
                   "query_start_loc_ptr": "*i32", "out_ptr": BF16, "part_out_ptr": "*fp32",
                   "part_m_ptr": "*fp32", "part_l_ptr": "*fp32"}
    bf16 = triton.language.bfloat16
    decode_cx = dict(GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=16, BLOCK_D=128,
                     BLOCK_N=paged_decode.DECODE_BLOCK_N, SPLIT=True, DOT_DTYPE=bf16,
                     DOT_PRECISION="tf32", SLIDING=False, MIXED=False)
    prefill_ptrs = {"q_ptr": BF16, "k_cache_ptr": BF16, "v_cache_ptr": BF16,
                    "block_tables_ptr": "*i32", "query_start_loc_ptr": "*i32",
                    "context_lens_ptr": "*i32", "out_ptr": BF16}
    prefill_cx = dict(GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_M=128, BLOCK_N=64,
                      BLOCK_D=128, DOT_DTYPE=bf16, DOT_PRECISION="tf32",
                      SLIDING=False, SKIP_SINGLE=False)
    return {
        "paged_decode": (paged_decode._paged_decode_kernel, decode_ptrs, decode_cx,
                         dict(num_warps=4, num_stages=paged_decode.DECODE_STAGES)),
        "paged_decode_fp32": (paged_decode._paged_decode_kernel,
                              {k: "*fp32" if v == BF16 else v for k, v in decode_ptrs.items()},
                              decode_cx | dict(BLOCK_N=paged_decode.DECODE_BLOCK_N // 2,
                                               DOT_DTYPE=triton.language.float32,
                                               DOT_PRECISION="ieee"),
                              dict(num_warps=4, num_stages=paged_decode.DECODE_STAGES)),
        "reduce_splits": (decode_splits._reduce_splits_kernel,
                          {"part_out_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
                           "out_ptr": BF16, "context_lens_ptr": "*i32",
                           "query_start_loc_ptr": "*i32"},
                          dict(HEAD_DIM=128, BLOCK_S=64, BLOCK_D=128, BLOCK_N=32, SLIDING=False,
                               MIXED=False), dict(num_warps=4)),
        "prefill_128": (prefill._prefill_kernel, prefill_ptrs, prefill_cx,
                        dict(num_warps=8, num_stages=2)),
        "prefill_64": (prefill._prefill_kernel, prefill_ptrs, prefill_cx | dict(BLOCK_M=64),
                       dict(num_warps=4, num_stages=2)),
        "kv_store": (kv_store._store_kv_kernel,
                     {"k_ptr": BF16, "v_ptr": BF16, "k_cache_ptr": BF16, "v_cache_ptr": BF16,
                      "slot_mapping_ptr": "*i64"},
                     dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128),
                     dict(num_warps=4)),
        "rotary_kv_store": (rotary_kv_store._rotary_store_kv_kernel,
                            {"q_ptr": BF16, "k_ptr": BF16, "v_ptr": BF16, "cos_ptr": BF16,
                             "sin_ptr": BF16, "k_cache_ptr": BF16, "v_cache_ptr": BF16,
                             "slot_mapping_ptr": "*i64"},
                            dict(NUM_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, HALF=64,
                                 BLOCK_SIZE=16, BLOCK_H=32, BLOCK_KV=8, BLOCK_HALF=64,
                                 BLOCK_D=128, PARTIAL=False), dict(num_warps=4)),
        "add_rms_norm": (rms_norm._rms_norm_kernel,
                         {"x_ptr": BF16, "residual_ptr": BF16, "weight_ptr": BF16,
                          "out_ptr": BF16},
                         dict(BLOCK=4096, ADD_RESIDUAL=True), dict(num_warps=8)),
        "silu_and_mul": (silu._silu_and_mul_kernel, {"gate_up_ptr": BF16, "out_ptr": BF16},
                         dict(BLOCK=silu.BLOCK), dict(num_warps=4)),
        "lora_shrink": (lora._shrink_kernel,
                        {"x_ptr": BF16, "a_ptr": BF16, "slots_ptr": "*i32", "ranks_ptr": "*i32",
                         "inter_ptr": "*fp32"},
                        dict(BLOCK_R=lora.BLOCK_R, BLOCK_K=lora.BLOCK_K, K_SPLIT=lora.K_SPLIT),
                        dict(num_warps=4)),
        "lora_expand": (lora._expand_kernel,
                        {"inter_ptr": "*fp32", "bt_ptr": BF16, "slots_ptr": "*i32",
                         "spans_ptr": "*i32", "slices_ptr": "*i32", "y_ptr": BF16},
                        dict(BLOCK_R=lora.BLOCK_R, BLOCK_N=lora.BLOCK_N), dict(num_warps=4)),
    }


def ptxas_report(ptx: str) -> dict:
    # The CUDA 13 ptxas Triton ships reads the PTX versions it writes.
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    proc = subprocess.run([str(ptxas), "--gpu-name", "sm_90a", "-v", f.name, "-o", os.devnull],
                          capture_output=True, text=True)
    os.unlink(f.name)
    text = proc.stdout + proc.stderr
    num = lambda pattern: int(m.group(1)) if (m := re.search(pattern, text)) else None  # noqa: E731
    return {"registers": num(r"Used (\d+) registers"),
            "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads")}


def compile_one(fn, pointers, constexprs, options) -> dict:
    signature, constants, attrs = _specialize(fn, pointers, constexprs)
    src = ASTSource(fn, signature, constants, attrs)
    compiled = triton.compile(src, target=TARGET, options=options)
    ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
    depths = [int(d) for d in re.findall(r"memdesc<(\d+)x\d+x\d+x\w+, [^>]*mutable>", ttgir)]
    return {"shared_bytes": compiled.metadata.shared,
            "async_copies": ttgir.count("async_copy_global_to_local"),
            "buffer_depth": max(depths, default=0),
            "ttgir": ttgir, "ptx": ptx, **ptxas_report(ptx)}


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--json"]
    as_json = "--json" in sys.argv
    out = Path(args[0]) if args else None
    figures = {}
    if not as_json:
        print(f"{'kernel':18} {'regs':>5} {'spill st/ld':>12} {'smem KiB':>9} "
              f"{'async copies':>13} {'depth':>6}")
    for name, spec in kernels().items():
        r = compile_one(*spec)
        figures[name] = {k: v for k, v in r.items() if k not in ("ttgir", "ptx")}
        if not as_json:
            print(f"{name:18} {r['registers']!s:>5} {r['spill_stores']!s:>5}/"
                  f"{r['spill_loads']!s:<6} {r['shared_bytes'] / 1024:9.1f} "
                  f"{r['async_copies']:13d} {r['buffer_depth']:6d}")
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{name}.ttgir").write_text(r["ttgir"])
            (out / f"{name}.ptx").write_text(r["ptx"])
    if as_json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
