"""Everything that needs a GPU, in one command: `python3 scripts/gpu_check.py OUT_DIR`.

Sections, each guarded so that one failure leaves the others' results:
  kernels   pytest tests/test_kernels.py tests/test_graphs.py (if pytest is there),
            and a built-in comparison of every kernel with gpu/kernels/reference.py
  roofline  device-to-device copy bandwidth and bf16 matmul TFLOP/s
  attention paged decode attention bandwidth at long context (one layer's shapes)
  model     a random-weight Llama-3-8B-shaped model (32 layers by default, bf16)
            built through ModelRunner: memory profile, KV pool, CUDA graphs
  parity    CUDA-graph vs eager greedy decode, teacher-forced and free-running
  decode    step time at batch 1, 8, 64, 256; prefill tokens/s
and a final table of each figure against its roofline floor. Results go to
OUT_DIR/gpu_check.json after every section (a kill still leaves what was done).

Needs torch, triton and safetensors; imports nothing of app/ (no web stack), and
no network. `--cpu-smoke` runs every section on CPU with a tiny model and the
Triton interpreter, to catch import and logic errors before GPU time is spent.
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

# The interpreter must be chosen before triton is first imported.
os.environ.update({"TRITON_INTERPRET": "1"} if "--cpu-smoke" in sys.argv else {})
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo (gpu/, models/)

import torch
import triton
from gpu_check_roofline import (  # beside this file
    attention,
    builtin_kernel_check,
    device_time,
    print_table,
    roofline,
    table,
)

from app.config import EngineConfig
from gpu.batch import Batch, SamplingRow
from gpu.graphs import GraphRunner
from gpu.runner import ModelRunner, RunnerSpec

ROOT = Path(__file__).resolve().parent.parent
LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
    max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=128000,
    eos_token_id=128001,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=8192),
)
TINY = dict(LLAMA3_8B, vocab_size=1024, hidden_size=128, intermediate_size=256,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
# Sizes per mode: (GPU, CPU smoke).
SIZES = {
    "gpu": dict(copy_bytes=4 << 30, matmul=8192, decode_batches=[1, 8, 64, 256],
                decode_context=1024, prefill=[(1, 2048), (4, 2048)], max_model_len=4096,
                attention=[(1, 32768), (8, 16384), (64, 4096), (256, 2048)],
                prompts=[7, 33, 100, 250, 600], steps=8, max_num_seqs=256),
    "smoke": dict(copy_bytes=64 << 20, matmul=256, decode_batches=[1, 2, 4],
                  decode_context=64, prefill=[(1, 32), (2, 32)], max_model_len=512,
                  attention=[(1, 300), (2, 128)], prompts=[5, 9, 20], steps=3, max_num_seqs=4),
}
NEAR_TIE = 0.1  # nats: a graph/eager disagreement is only excused below this top-2 margin
GREEDY = SamplingRow(temperature=0.0)
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
        self.iters = 3 if self.smoke else 20  # the interpreter is ~1000x slower
        self.t0 = time.perf_counter()

    def section(self, name, fn):
        start = time.perf_counter()
        if start - self.t0 > self.args.budget_s:
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


def wall_time(fn, iters: int, warmup: int = 2) -> float:
    """Median wall seconds of a call that synchronizes by itself (runner.execute)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --- kernels -----------------------------------------------------------------------


def kernels(check: Check) -> dict:
    result = {"builtin": builtin_kernel_check(check)}
    files = ["tests/test_graphs.py"] if check.smoke else [
        "tests/test_kernels.py", "tests/test_sliding_window.py", "tests/test_graphs.py"]
    if importlib.util.find_spec("pytest") is None:
        result["pytest"] = "not installed: built-in comparison only"
    else:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider"],
                cwd=ROOT, capture_output=True, text=True, timeout=check.args.pytest_timeout_s)
        except subprocess.TimeoutExpired as e:
            (check.out / "pytest.txt").write_text(str(e.stdout or "") + str(e.stderr or ""))
            result["pytest"], result["ok"] = f"timed out after {e.timeout} s", False
        else:
            (check.out / "pytest.txt").write_text(proc.stdout + proc.stderr)
            tail = [line for line in proc.stdout.splitlines() if line.strip()][-1:]
            result["pytest"] = {"files": files, "returncode": proc.returncode, "summary": tail}
            result["ok"] = proc.returncode == 0
    result["ok"] = result.get("ok", True) and result["builtin"]["ok"]
    return result


# --- the model -----------------------------------------------------------------------


def random_weights(cfg: dict, device, dtype, seed: int = 0):
    """HF-named random tensors made on the device (no 16 GB file to write or read)."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]

    def rnd(*shape):  # HF's initializer_range; norms keep every layer's scale sane
        return torch.randn(*shape, generator=g, device=device, dtype=dtype).mul_(0.02)

    yield "model.embed_tokens.weight", rnd(vocab, h)
    yield "model.norm.weight", torch.ones(h, device=device, dtype=dtype)
    yield "lm_head.weight", rnd(vocab, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", torch.ones(h, device=device, dtype=dtype)
        yield p + "post_attention_layernorm.weight", torch.ones(h, device=device, dtype=dtype)
        for name, shape in (("self_attn.q_proj", (q, h)), ("self_attn.k_proj", (kv, h)),
                            ("self_attn.v_proj", (kv, h)), ("self_attn.o_proj", (h, q)),
                            ("mlp.gate_proj", (inter, h)), ("mlp.up_proj", (inter, h)),
                            ("mlp.down_proj", (h, inter))):
            yield p + name + ".weight", rnd(*shape)


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
                                    max_model_len=spec.max_model_len)
        runner.graphs.capture()
    check.runner = runner
    layers = [m for m in runner.model.layers.modules() if isinstance(m, torch.nn.Linear)]
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
        "layer_weight_bytes": sum(m.weight.numel() * m.weight.element_size() for m in layers),
        "layer_matmul_params": sum(m.weight.numel() for m in layers),
        "lm_head_params": cfg["vocab_size"] * cfg["hidden_size"],
        "attention_dims": [cfg["num_attention_heads"], cfg["head_dim"], cfg["num_hidden_layers"]],
    }


class Seqs:
    """Scheduler-like batches for a few sequences over fresh pages of the pool."""

    def __init__(self, prompts: list[list[int]], first_block: int, block_size: int = 16):
        self.tokens, self.bs, self.next = [list(p) for p in prompts], block_size, first_block
        self.tables: list[list[int]] = [[] for _ in prompts]
        self.done = [0] * len(prompts)

    def batch(self, row: SamplingRow) -> Batch:
        ids, pos, slots, qlens, ctx = [], [], [], [], []
        for i, toks in enumerate(self.tokens):
            while len(self.tables[i]) * self.bs < len(toks):
                self.tables[i].append(self.next)
                self.next += 1
            span = range(self.done[i], len(toks))
            ids += toks[span.start:]
            pos += span
            slots += [self.tables[i][p // self.bs] * self.bs + p % self.bs for p in span]
            qlens.append(len(span))
            ctx.append(len(toks))
        n = len(self.tokens)
        return Batch(ids, pos, slots, qlens, ctx, [list(t) for t in self.tables], list(range(n)),
                     [row] * n)

    def advance(self, tokens: list[int]) -> None:
        for i, t in enumerate(tokens):
            self.done[i] = len(self.tokens[i])
            self.tokens[i].append(t)


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


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


def decode_batch(batch: int, context: int, first_block: int, bs: int = 16) -> Batch:
    """`batch` rows at `context` tokens each on fresh pages; the KV contents do not matter."""
    per_seq = -(-context // bs)
    tables = [list(range(first_block + i * per_seq, first_block + (i + 1) * per_seq))
              for i in range(batch)]
    last = context - 1
    return Batch([1] * batch, [last] * batch, [t[last // bs] * bs + last % bs for t in tables],
                 [1] * batch, [context] * batch, tables, list(range(batch)), [GREEDY] * batch)


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
    parser.add_argument("--budget-s", type=float, default=450, help="skip sections after this")
    parser.add_argument("--pytest-timeout-s", type=float, default=240)
    check = Check(parser.parse_args())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        handlers=[logging.StreamHandler(sys.stdout),
                                  logging.FileHandler(check.out / "gpu_check.log", mode="w")])
    check.results["env"] = {
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    if not check.smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke for the CPU check")
        return 2
    check.section("kernels", kernels)
    check.section("roofline", roofline)
    check.section("attention", attention)
    check.section("model", build_model)
    if check.runner is None:  # e.g. capture failed: eager figures are still worth having
        check.section("model_eager", partial(build_model, eager=True))
    if check.runner is not None:
        check.section("parity", parity)
        check.section("speed", speed)
    rows = table(check.results)
    check.results["table"] = rows
    check.save()
    print_table(check, rows)
    return 0 if all(v.get("ok", True) for v in check.results.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
