"""Routing by cache: two replicas behind vllm-router, round_robin vs cache_aware vs
kv_aware, on a multi-tenant chat load (vLLM's prefix_repetition dataset).

    python benchmarks/routing.py [OUT_DIR] [--model DIR] [--num-prompts N]

Each policy gets a fresh pair of replicas (empty caches). The load: K = 4 tenants
(twice the replicas), each with its own ~768-token system prompt, short questions,
16 tokens out, 8 requests at a time. Reported per policy: the aggregate prefix-cache
hit rate read from the replicas' own /metrics, TTFT median and p99 and output tokens/s
from `ridgeline bench serve`.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

from app.replicas import Cluster

POLICIES = ("round_robin", "cache_aware", "kv_aware")


def counters(url: str) -> tuple[float, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^ridgeline:{name}(?:{{[^}}]*}})? (\S+)$",
                                                text, re.M))
    return total("prefix_cache_hits_total"), total("prefix_cache_queries_total")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", nargs="?", default="bench_results/routing")
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    serve = ["--dtype", "bfloat16", "--max-num-seqs", "8", "--served-model-name", "smollm2"]
    serve += ["--model", a.model] if a.model else []
    rows = []
    for policy in POLICIES:
        with Cluster(2, policy, serve, log_dir=str(out / policy)) as cluster:
            subprocess.run([sys.executable, "-m", "app.cli", "bench", "serve",
                            "--base-url", cluster.url, "--model", "smollm2",
                            "--dataset-name", "prefix_repetition",
                            "--prefix-repetition-prefix-len", "768",
                            "--prefix-repetition-suffix-len", "32",
                            "--prefix-repetition-num-prefixes", "4",
                            "--prefix-repetition-output-len", "16",
                            "--num-prompts", str(a.num_prompts), "--max-concurrency", "8",
                            "--ignore-eos", "--disable-tqdm", "--no-plots",
                            "--result-dir", str(out), "--result-filename", f"{policy}.json"],
                           check=True)
            hits = queries = 0.0
            for node in cluster.nodes:
                h, q = counters(node.url)
                hits, queries = hits + h, queries + q
        r = json.loads((out / f"{policy}.json").read_text())
        rows.append({"policy": policy, "hit_rate": hits / queries if queries else 0.0,
                     "median_ttft_ms": r["median_ttft_ms"], "p99_ttft_ms": r["p99_ttft_ms"],
                     "output_tok_s": r["output_throughput"], "completed": r["completed"]})
        print(rows[-1], flush=True)
    (out / "routing.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'policy':<14}{'hit rate':>10}{'TTFT med ms':>13}{'TTFT p99 ms':>13}"
          f"{'out tok/s':>11}")
    for r in rows:
        print(f"{r['policy']:<14}{r['hit_rate']:>10.2f}{r['median_ttft_ms']:>13.0f}"
              f"{r['p99_ttft_ms']:>13.0f}{r['output_tok_s']:>11.1f}")


if __name__ == "__main__":
    main()
