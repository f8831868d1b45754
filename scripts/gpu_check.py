"""Everything that needs a GPU, in one command: `python3 scripts/gpu_check.py OUT_DIR`.

Sections, each guarded so that one failure leaves the others' results (in this order:
the model's users first, then the sections that need its memory back):
  env          versions, compute capability, SM count, the Triton cache folder
  kernels      every kernel against gpu/triton/reference.py at Llama-3-8B head shapes
  roofline     device-to-device copy bandwidth and bf16 matmul TFLOP/s
  attention    paged decode at (1, 32k) .. (256, 2k) against copy bandwidth; decode rows
               of a mixed batch through the decode kernel vs through the prefill kernel
  model        a random-weight Llama-3-8B-shaped model (32 layers by default, bf16)
               built through ModelRunner: memory profile, KV pool, CUDA graphs
  sync_audit   host-device syncs per step under torch.cuda.set_sync_debug_mode (goal 1)
  parity       CUDA-graph vs eager greedy decode, teacher-forced and free-running
  bucket_sweep every bucket replayed with fewer rows than its size, mixed contexts, vs
               eager: no NaN, relative max |d logits| <= 3e-2, the pool outside the
               step's slots unchanged
  speed        step time at batch 1, 8, 64, 256; prefill tokens/s
  anatomy      torch.profiler over steps at batch 1, 64, 256: kernels per step, GPU busy
               vs wall (goal at batch >= 64: idle <= 15%)
  gil          a step at batch 64 on a thread beside a busy Python thread: slowdown at
               Python's default switch interval and at Ridgeline's (goal <= 10%)
  hf_parity    4 layers of Llama-3-8B (llama3 RoPE) against HF LlamaForCausalLM with the
               same weights: prefill + 8 graph decode steps; fp32 logits within 2e-3, bf16
               top-1 equal where HF's margin >= 0.1
  large_pool   a pool of more than 2**31 elements: store, decode, prefill on its last blocks
  engine       the offline LLM on a random model of a real shape: graphs vs --enforce-eager
  spec_decode  speculative decoding: a verify step (eager and in the verify graphs' padded
               layout) against the reference; greedy ids with ngram speculation through
               the decode and verify graphs equal plain decoding's on a tiny fp32 model,
               and with the draft model (draft_model) too
  lora         the per-row LoRA kernels against their reference at Llama-3-8B shapes (and
               their time beside the base linear's); a tiny model's greedy ids with two
               adapters and the base in one batch, graphs on, vs the adapters merged
  pytest       the kernel and graph tests, natively, with whatever time is left
and a final table of each figure against its roofline floor. Results go to
OUT_DIR/gpu_check.json after every section (a kill still leaves what was done).

Needs only the GPU machine's packages (torch, triton, transformers, safetensors; pytest
optional): nothing of the web stack, structlog or gguf, and no network. `--cpu-smoke`
runs every section on CPU with a tiny model and the Triton interpreter, to catch import
and logic errors before GPU time is spent.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path

# The interpreter must be chosen before triton is first imported; compiled kernels go to
# a fresh writable folder unless one is given.
os.environ.update({"TRITON_INTERPRET": "1"} if "--cpu-smoke" in sys.argv else {})
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="ridgeline-triton-"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo (gpu/, models/)

import torch
import triton
from gpu_check_audit import anatomy, bucket_sweep, gil, sync_audit  # beside this file
from gpu_check_common import (
    GREEDY,
    LLAMA3_8B,
    TINY,
    Seqs,
    decode_batch,
    random_prompts,
    random_weights,
    wall_time,
)
from gpu_check_engine import engine
from gpu_check_lora import lora
from gpu_check_parity import hf_parity, large_pool
from gpu_check_roofline import (
    attention,
    builtin_kernel_check,
    device_time,
    print_table,
    roofline,
    table,
)
from gpu_check_spec import spec_decode

from app.config import EngineConfig
from gpu.batch import SamplingRow
from gpu.graphs import GraphRunner
from gpu.runner import ModelRunner, RunnerSpec

ROOT = Path(__file__).resolve().parent.parent
# Sizes per mode: (GPU, CPU smoke).
SIZES = {
    "gpu": dict(copy_bytes=4 << 30, matmul=8192, decode_batches=[1, 8, 64, 256],
                decode_context=1024, prefill=[(1, 2048), (4, 2048)], max_model_len=4096,
                attention=[(1, 32768), (8, 16384), (16, 4096), (64, 4096), (256, 2048)],
                mixed=(64, 4096, 512), anatomy=[1, 64, 256], gil_batch=64,
                prompts=[7, 33, 100, 250, 600], steps=8, max_num_seqs=256,
                hf_prompts=[37, 100, 250], engine=dict(prompts=64, input_len=256,
                                                         output_len=128, layers=4)),
    "smoke": dict(copy_bytes=64 << 20, matmul=256, decode_batches=[1, 2],
                  decode_context=64, prefill=[(2, 16)], max_model_len=512,
                  attention=[(1, 300), (2, 128)], mixed=(2, 300, 20), anatomy=[2],
                  gil_batch=2, prompts=[5, 9, 20], steps=3, max_num_seqs=4,
                  hf_prompts=[5, 12], engine=dict(prompts=3, input_len=8, output_len=4,
                                                  layers=2)),
}
NEAR_TIE = 0.1  # nats: a graph/eager disagreement is only excused below this top-2 margin
log = logging.getLogger("gpu_check")


class Check:
    """Runs sections, keeps their results, saves them after each one."""

    def __init__(self, args):
        self.args, self.out = args, Path(args.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.smoke = args.cpu_smoke
        self.size = SIZES["smoke" if self.smoke else "gpu"]
        self.device = torch.device("cpu" if self.smoke else "cuda")
        self.dtype = torch.float32 if self.smoke else torch.bfloat16
        self.results: dict = {"mode": "cpu-smoke" if self.smoke else "gpu"}
        self.runner: ModelRunner | None = None
        self.iters = 2 if self.smoke else 20  # the interpreter is ~1000x slower
        self.t0 = time.perf_counter()

    def left_s(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.t0)

    def section(self, name, fn):
        start = time.perf_counter()
        if self.left_s() <= 0:
            self.results[name] = {"ok": False, "error": "skipped: time budget spent"}
        else:
            print(f"== {name}", flush=True)
            try:
                self.results[name] = {"ok": True, **fn(self)}
            except Exception:
                traceback.print_exc()
                self.results[name] = {"ok": False, "error": traceback.format_exc()}
        self.results[name]["seconds"] = round(time.perf_counter() - start, 2)
        self.save()

    def save(self):
        (self.out / "gpu_check.json").write_text(json.dumps(self.results, indent=1))

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def free_runner(self) -> None:
        """Hand the model's memory (weights, a KV pool of most of the GPU) back."""
        self.runner = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def env(check: Check) -> dict:
    out = {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
           "python": sys.version.split()[0], "triton_cache": os.environ["TRITON_CACHE_DIR"],
           "device": "cpu"}
    if torch.cuda.is_available() and not check.smoke:
        props = torch.cuda.get_device_properties(check.device)
        free, total = torch.cuda.mem_get_info(check.device)
        out |= {"device": props.name, "compute_capability": f"{props.major}.{props.minor}",
                "sm_count": props.multi_processor_count, "total_GiB": total / 2**30,
                "free_GiB": free / 2**30}
    for name in ("transformers", "safetensors", "starlette", "structlog", "gguf", "pytest"):
        out[name] = importlib.util.find_spec(name) is not None
    return out


def kernels(check: Check) -> dict:
    result = builtin_kernel_check(check)
    return result


def pytest_section(check: Check) -> dict:
    """The kernel and graph tests, natively; last, with whatever time is left."""
    files = ["tests/test_graphs.py"] if check.smoke else [
        "tests/test_kernels.py", "tests/test_fused_kernels.py", "tests/test_graphs.py",
        "tests/test_sliding_window.py", "tests/test_spec_verify_kernels.py",
        "tests/test_spec_verify_graphs.py", "tests/test_lora_kernels.py"]
    if importlib.util.find_spec("pytest") is None:
        return {"pytest": "not installed: built-in comparison only"}
    timeout = max(30.0, min(check.args.pytest_timeout_s, check.left_s()))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", *files, "-q", "-x", "-p", "no:cacheprovider"],
            cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        (check.out / "pytest.txt").write_text(str(e.stdout or "") + str(e.stderr or ""))
        return {"ok": False, "pytest": f"timed out after {e.timeout:.0f} s"}
    (check.out / "pytest.txt").write_text(proc.stdout + proc.stderr)
    tail = [line for line in proc.stdout.splitlines() if line.strip()][-1:]
    return {"ok": proc.returncode == 0, "files": files, "returncode": proc.returncode,
            "summary": tail}


# --- the model -----------------------------------------------------------------------


def build_model(check: Check, eager: bool = False) -> dict:
    if eager:  # a second try after a failed build: free what the first one left
        gc.collect()
        torch.cuda.empty_cache()
    cfg = dict(TINY if check.smoke else LLAMA3_8B)
    if check.args.layers:
        cfg["num_hidden_layers"] = check.args.layers
    model_dir = Path(tempfile.mkdtemp(prefix="gpu-check-model-"))
    (model_dir / "config.json").write_text(json.dumps(cfg))
    config = EngineConfig.from_kwargs(
        dtype="float32" if check.smoke else "bfloat16", device=check.device.type,
        max_model_len=check.size["max_model_len"], block_size=16,
        num_blocks=1024 if check.smoke else None, attention_backend="triton",
        max_num_seqs=check.size["max_num_seqs"], max_num_batched_tokens=8192,
        enforce_eager=eager,
    )
    spec = RunnerSpec.from_config(config.flat(), model_dir=str(model_dir))
    runner = ModelRunner(spec, weights=random_weights(cfg, check.device, check.dtype))
    if check.smoke and not eager:  # off CUDA the runner never captures: closures stand in
        runner.graphs = GraphRunner(runner.model, runner.backend, runner.k_caches,
                                    runner.v_caches, sizes=[1, 2, 4],
                                    max_model_len=spec.max_model_len, tables=runner.tables)
        runner.graphs.capture()
    check.runner = runner
    # nn.Linear, or (on a CPU smoke run) its oneDNN-packed stand-in: both know their shape.
    layers = [(m.out_features * m.in_features) for m in runner.model.layers.modules()
              if hasattr(m, "out_features") and hasattr(m, "in_features")]
    dtype_bytes = torch.tensor([], dtype=check.dtype).element_size()
    graphs = runner.graphs
    return {
        "layers": cfg["num_hidden_layers"], "enforce_eager": eager,
        "graph_sizes": graphs.sizes if graphs else [],
        "graph_capture_s": graphs.capture_seconds if graphs else 0.0,
        "graph_GiB": graphs.memory_bytes / 2**30 if graphs else 0.0,
        "graph_estimate_GiB": runner.profile.graph_bytes / 2**30,
        "peak_activation_GiB": runner.profile.peak_activation_bytes / 2**30,
        "kv_blocks": runner.plan.num_blocks, "kv_GiB": runner.plan.kv_bytes / 2**30,
        "kv_bytes_per_token": runner.plan.bytes_per_token,
        "weights_bytes": runner.plan.weights_bytes,
        "layer_weight_bytes": sum(layers) * dtype_bytes,
        "layer_matmul_params": sum(layers),
        "lm_head_params": cfg["vocab_size"] * cfg["hidden_size"],
        "attention_dims": [cfg["num_attention_heads"], cfg["head_dim"], cfg["num_hidden_layers"]],
    }


def parity(check: Check) -> dict:
    runner = check.runner
    graphs, vocab = runner.graphs, runner.config.vocab_size
    prompts = random_prompts(check.size["prompts"], vocab, seed=1)
    row = SamplingRow(temperature=0.0, logprobs=2)
    seqs = Seqs(prompts, first_block=1)
    seqs.advance(runner.execute(seqs.batch(row)).token_ids)
    forced, replays = [], graphs.replays
    try:  # teacher-forced: both paths see the same history, eager's tokens go on
        for _ in range(check.size["steps"]):
            batch = seqs.batch(row)
            runner.graphs = graphs
            got = runner.execute(batch)
            runner.graphs = None
            want = runner.execute(batch)  # rewrites this token's K/V: history stays eager's
            for g_tok, e_tok, (g_lp, _), (e_lp, top) in zip(got.token_ids, want.token_ids,
                                                            got.logprobs, want.logprobs):
                forced.append({"same": g_tok == e_tok, "margin": top[0][1] - top[1][1],
                               "dlogprob": abs(g_lp - e_lp) if g_tok == e_tok else None})
            seqs.advance(want.token_ids)
    finally:
        runner.graphs = graphs
    free, steps = {}, check.size["steps"]
    span = sum(-(-(len(p) + steps + 2) // 16) for p in prompts)  # pages a free run takes
    for name, use_graphs in (("graph", True), ("eager", False)):
        s = Seqs(prompts, first_block=seqs.next + (0 if use_graphs else span))
        runner.graphs = graphs if use_graphs else None
        try:
            for _ in range(steps + 1):
                s.advance(runner.execute(s.batch(GREEDY)).token_ids)
        finally:
            runner.graphs = graphs
        free[name] = [t[len(p):] for t, p in zip(s.tokens, prompts)]
    unexcused = [f for f in forced if not f["same"] and f["margin"] >= NEAR_TIE]
    deltas = [f["dlogprob"] for f in forced if f["same"]]
    same_prefix = [next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), len(g))
                   for g, e in zip(free["graph"], free["eager"])]
    return {
        "ok": not unexcused and graphs.replays > replays,
        "teacher_forced_tokens": len(forced),
        "agree": sum(f["same"] for f in forced),
        "near_tie_disagreements": sum(not f["same"] for f in forced) - len(unexcused),
        "unexcused_disagreements": unexcused,
        "max_dlogprob": max(deltas, default=0.0),
        "median_dlogprob": statistics.median(deltas) if deltas else 0.0,
        "free_running_same_prefix": same_prefix, "free_running_steps": steps + 1,
        "graph_replays": graphs.replays - replays,
    }


def speed(check: Check) -> dict:
    runner = check.runner
    graphs, context = runner.graphs, check.size["decode_context"]
    decode = []
    for n in check.size["decode_batches"]:
        batch = decode_batch(n, context, first_block=1)
        step = partial(runner.execute, batch)
        row = {"batch": n, "context": context, "step_ms": wall_time(step, check.iters) * 1e3}
        if graphs is not None:
            row["forward_ms"] = device_time(check, partial(graphs.run, batch)) * 1e3
        if n <= 8 and graphs is not None:  # what the graphs save where launches dominate
            runner.graphs = None
            try:
                row["eager_step_ms"] = wall_time(step, check.iters) * 1e3
            finally:
                runner.graphs = graphs
        decode.append(row)
    prefill = []
    for num_seqs, length in check.size["prefill"]:
        prompts = random_prompts([length] * num_seqs, runner.config.vocab_size, seed=2)
        batch = Seqs(prompts, first_block=1).batch(GREEDY)
        seconds = wall_time(partial(runner.execute, batch), min(check.iters, 5))
        prefill.append({"seqs": num_seqs, "tokens": num_seqs * length, "ms": seconds * 1e3,
                        "tokens_per_s": num_seqs * length / seconds})
    return {"decode": decode, "prefill": prefill}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU")
    parser.add_argument("--layers", type=int, default=0, help="fewer layers than the model's")
    parser.add_argument("--budget-s", type=float, default=330, help="skip sections after this")
    parser.add_argument("--pytest-timeout-s", type=float, default=150)
    parser.add_argument("--tokenizer", default=None,
                        help="an HF tokenizer folder for the engine section (default: "
                        "scripts/gpu_check_tokenizer if present, else a word-level one)")
    check = Check(parser.parse_args())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        handlers=[logging.StreamHandler(sys.stdout),
                                  logging.FileHandler(check.out / "gpu_check.log", mode="w")])
    if not check.smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke for the CPU check")
        return 2
    check.section("env", env)
    check.section("kernels", kernels)
    check.section("roofline", roofline)
    check.section("attention", attention)
    check.section("model", build_model)
    if check.runner is None:  # e.g. capture failed: eager figures are still worth having
        check.section("model_eager", partial(build_model, eager=True))
    if check.runner is not None:
        for name, fn in (("sync_audit", sync_audit), ("parity", parity),
                         ("bucket_sweep", bucket_sweep), ("speed", speed),
                         ("anatomy", anatomy), ("gil", gil)):
            check.section(name, fn)
    check.free_runner()
    check.section("hf_parity", hf_parity)
    check.section("large_pool", large_pool)
    check.section("engine", engine)
    check.section("spec_decode", spec_decode)
    check.section("lora", lora)
    check.section("pytest", pytest_section)
    rows = table(check.results)
    check.results["table"] = rows
    check.save()
    print_table(check, rows)
    return 0 if all(v.get("ok", True) for v in check.results.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
