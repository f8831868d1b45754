"""Models at the sizes users run on a CPU, served from the GGUF they download: Ridgeline
beside llama.cpp's server on the same file, in one run, each server in turn.

    python benchmarks/user_sizes.py make --llama-cpp DIR [--shape 1.7b|8b] [--out DIR]
    python benchmarks/user_sizes.py run --llama-cpp DIR --gguf FILE [--tokenizer HF_DIR]
        [--isa native avx512 avx2] [--rounds 2] [--out bench_results/user_sizes]

`make` writes a random-weight model of a real shape as a bf16 GGUF, tensor by tensor (an
8B model's 16 GB of bf16 never sit in memory; speed does not depend on the values), with
the embedded SmolLM2's tokenizer, and quantizes it with `llama-quantize` (built from the
same llama.cpp source as `llama-server`) to Q4_K_M. Shapes: SmolLM2-1.7B's and
Llama-3.1-8B's (without its rope frequency factors, which a random model does not need).

`run` starts each server on the file (Ridgeline with default flags, once per
`RIDGELINE_CPU_ISA` cap asked for; llama-server with two threads, continuous batching,
16 slots), waits for its first 200 on /health (start to ready: the first start of a
fresh Ridgeline cache is timed apart, on the first ISA), then drives it with
`ridgeline bench serve` (vLLM's flags and metrics):

| shape | prompts | in / out tokens | concurrency | reported |
| --- | --- | --- | --- | --- |
| conc1 | 6 | 128 / 64 | 1 | median TPOT |
| conc16 | 32 | 128 / 64 | 16 | output tok/s |
| prompt1024 | 3 | 1024 / 1 | 1 | median TTFT |

Each server's peak RSS (VmHWM) is read at the end, and the host's CPU and ISA flags are
recorded. Servers run in turn for `--rounds` rounds (A B A B), so the host's phase hits
each alike; the table gives each figure's median over the rounds and Ridgeline's ratio
to llama.cpp's. Results: `OUT/user_sizes.json` and `OUT/user_sizes.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
from host import describe

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # name: (prompts, input, output, concurrency)
    "conc1": (6, 128, 64, 1),
    "conc16": (32, 128, 64, 16),
    "prompt1024": (3, 1024, 1, 1),
}
MODEL_SHAPES = {
    "1.7b": dict(hidden=2048, ffn=8192, layers=24, heads=32, kv_heads=32, vocab=49152,
                 tied=True, theta=130000.0, ctx=8192),
    "8b": dict(hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8, vocab=49152,
               tied=False, theta=500000.0, ctx=8192),
}


# -- make --------------------------------------------------------------------------------

def make(args) -> None:
    """A random-weight bf16 GGUF of a real shape, then llama-quantize to Q4_K_M."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

    from models.resolve import default_gguf_path

    s = MODEL_SHAPES[args.shape]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bf16 = out / f"random-{args.shape}-bf16.gguf"
    quant = out / f"random-{args.shape}-Q4_K_M.gguf"
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(bf16), "llama")
    writer.add_block_count(s["layers"])
    writer.add_context_length(s["ctx"])
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(s["theta"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(32)  # MOSTLY_BF16
    for key, field in GGUFReader(default_gguf_path()).fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub)
    h, f, d = s["hidden"], s["ffn"], s["hidden"] // s["heads"]
    shapes = {"token_embd.weight": (s["vocab"], h), "output_norm.weight": (h,)}
    if not s["tied"]:
        shapes["output.weight"] = (s["vocab"], h)
    for i in range(s["layers"]):
        shapes |= {f"blk.{i}.attn_norm.weight": (h,), f"blk.{i}.ffn_norm.weight": (h,),
                   f"blk.{i}.attn_q.weight": (h, h),
                   f"blk.{i}.attn_k.weight": (s["kv_heads"] * d, h),
                   f"blk.{i}.attn_v.weight": (s["kv_heads"] * d, h),
                   f"blk.{i}.attn_output.weight": (h, h),
                   f"blk.{i}.ffn_gate.weight": (f, h), f"blk.{i}.ffn_up.weight": (f, h),
                   f"blk.{i}.ffn_down.weight": (h, f)}
    # Shapes and types first, then the data one tensor at a time.
    for name, shape in shapes.items():
        dtype = GGMLQuantizationType.F32 if len(shape) == 1 else GGMLQuantizationType.BF16
        nbytes = int(np.prod(shape)) * (4 if len(shape) == 1 else 2)
        writer.add_tensor_info(name, shape, np.dtype(np.float32 if len(shape) == 1
                                                      else np.uint16), nbytes, dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for shape in shapes.values():
        if len(shape) == 1:
            writer.write_tensor_data(np.ones(shape, np.float32))
            continue
        w = (rng.standard_normal(shape, dtype=np.float32) * 0.02).view(np.uint32)
        writer.write_tensor_data(((w + 0x7FFF + ((w >> 16) & 1)) >> 16).astype(np.uint16))
    writer.close()
    tool = Path(args.llama_cpp) / "llama-quantize"
    subprocess.run([str(tool), str(bf16), str(quant), "Q4_K_M", "2"], check=True)
    print(quant)


# -- run ---------------------------------------------------------------------------------

def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 900) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout} s")


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def bench(url: str, shape: str, tokenizer: str, out: Path) -> dict:
    prompts, n_in, n_out, conc = SHAPES[shape]
    run = subprocess.run(
        [sys.executable, "-m", "app.cli", "bench", "serve", "--base-url", url,
         "--tokenizer", tokenizer, "--num-prompts", str(prompts), "--input-len", str(n_in),
         "--output-len", str(n_out), "--max-concurrency", str(conc), "--ignore-eos",
         "--num-warmups", "1", "--ready-check-timeout-sec", "120",  # retry a first failure
         "--no-plots", "--save-result", "--result-dir", str(out),
         "--result-filename", "result.json", "--seed", str(list(SHAPES).index(shape))],
        cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if run.returncode != 0:  # the client's own words, not only its exit status
        sys.exit(f"bench serve failed on {url} ({shape}):\n"
                 f"{run.stdout[-2000:]}{run.stderr[-3000:]}")
    return json.loads((out / "result.json").read_text())


def servers(args, port: int) -> list[tuple[str, list[str], dict]]:
    llama = [str(Path(args.llama_cpp) / "llama-server"), "-m", args.gguf, "--port", str(port),
             "-t", "2", "-tb", "2", "-cb", "-np", "16", "-c", str(16 * 1280),
             "--no-kv-unified", "--sse-ping-interval", "-1", "--host", "127.0.0.1"]
    out = [("llama.cpp", llama, {})]
    for isa in args.isa:
        cmd = [sys.executable, "-m", "app.cli", "serve", "--model", args.gguf, "--port",
               str(port), "--max-model-len", "2048"]
        out.append((f"ridgeline ({isa})", cmd, {"RIDGELINE_CPU_ISA": isa}))
    return out


def run(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = 8123
    url = f"http://127.0.0.1:{port}"
    results: dict[str, dict] = {}
    cache = tempfile.mkdtemp(prefix="ridgeline-cache-")
    base_env = {**os.environ, "RIDGELINE_CACHE_DIR": cache}
    first_start = None
    for rnd in range(args.rounds):
        for name, cmd, env in servers(args, port):
            proc = subprocess.Popen(cmd, cwd=ROOT, env={**base_env, **env},
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                ready = wait_ready(url, proc)
                if name.startswith("ridgeline") and first_start is None:
                    first_start = ready  # a fresh cache: conversion and kernel build
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(60)
                    proc = subprocess.Popen(cmd, cwd=ROOT, env={**base_env, **env},
                                            stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)
                    ready = wait_ready(url, proc)
                row = results.setdefault(name, {"ready_s": [], "peak_rss_mb": []})
                row["ready_s"].append(ready)
                for shape in SHAPES:
                    r = bench(url, shape, args.tokenizer, out / "raw" / name / str(rnd) / shape)
                    row.setdefault(shape, []).append(r)
                row["peak_rss_mb"].append(peak_rss_mb(proc.pid))
                print(f"round {rnd} {name}: ready {ready:.1f} s", flush=True)
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    report(results, first_start, args, out)


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def report(results: dict, first_start: float | None, args, out: Path) -> None:
    size = Path(args.gguf).stat().st_size
    summary = {"host": describe(), "gguf": Path(args.gguf).name, "gguf_bytes": size,
               "ridgeline_first_start_s": first_start, "servers": {}}
    for name, row in results.items():
        summary["servers"][name] = {
            "ready_s": statistics.median(row["ready_s"]),
            "peak_rss_mb": max(row["peak_rss_mb"]),
            "conc1_median_tpot_ms": median(row["conc1"], "median_tpot_ms"),
            "conc16_output_tok_s": median(row["conc16"], "output_throughput"),
            "prompt1024_median_ttft_ms": median(row["prompt1024"], "median_ttft_ms"),
        }
    (out / "user_sizes.json").write_text(json.dumps(summary, indent=2) + "\n")
    base = summary["servers"].get("llama.cpp")
    keys = [("conc1_median_tpot_ms", "one user: median TPOT (ms)"),
            ("conc16_output_tok_s", "16 users: output tok/s"),
            ("prompt1024_median_ttft_ms", "1024-token prompt: TTFT (ms)"),
            ("peak_rss_mb", "peak RSS (MB)"), ("ready_s", "start to ready (s)")]
    names = list(summary["servers"])
    lines = [f"{summary['host']['cpu']} ({summary['host']['isa']}), {summary['gguf']} "
             f"({size / 1e9:.2f} GB)", "", "| | " + " | ".join(names) + " |",
             "| --- |" + " --- |" * len(names)]
    for key, label in keys:
        cells = []
        for n in names:
            v = summary["servers"][n][key]
            ratio = f" ({v / base[key]:.2f}x)" if base and n != "llama.cpp" else ""
            cells.append(f"{v:.1f}{ratio}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if first_start is not None:
        lines.append(f"\nRidgeline's first start (fresh cache): {first_start:.1f} s")
    (out / "user_sizes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--llama-cpp", required=True, help="folder with llama-quantize")
    m.add_argument("--shape", choices=sorted(MODEL_SHAPES), default="1.7b")
    m.add_argument("--out", default="bench_results/models")
    r = sub.add_parser("run")
    r.add_argument("--llama-cpp", required=True, help="folder with llama-server")
    r.add_argument("--gguf", required=True)
    r.add_argument("--tokenizer", default=None,
                   help="an HF directory of the model's tokenizer (default: the embedded "
                        "SmolLM2's, whose vocabulary the random models share)")
    r.add_argument("--isa", nargs="+", default=["native"], choices=["native", "avx512", "avx2"])
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--out", default="bench_results/user_sizes")
    args = p.parse_args()
    if args.cmd == "make":
        make(args)
        return
    if args.tokenizer is None:
        from models.resolve import resolve_model

        args.tokenizer = str(resolve_model(None))
    run(args)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
