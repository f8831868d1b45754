"""Speculative decoding (n-gram) against plain decoding on SmolLM2, in one process.

    python benchmarks/spec_decode.py [--rounds 3] [--max-tokens 256] [OUT.json]

Two engines over the same model, one with `--speculative-config` and one without,
alternate round by round, so host noise hits both alike. Loads:
- `repeat`: one user, greedy, a ~1,000-token prompt (code from this repository) that
  the answer largely repeats ("repeat this code with the variable renamed"); time per
  output token (decode time / (tokens - 1)) and the outputs' identity;
- `random8`: 8 users at once, random-token prompts, a fixed number of tokens each
  (`ignore_eos`): output tokens per second, where speculation must back off (the
  default `disable_by_batch_size` is 8) and cost nothing;
- `random1`: one user, a random-token prompt: acceptance is low, the per-request
  back-off must keep time per output token as without speculation.
Reports per load the median of each engine's rounds and their ratio, the drafts and
acceptance, and the host CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import time
from pathlib import Path

from app import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
        "prompt_lookup_max": 5}


def repeat_prompt(llm: LLM, tokens: int = 1000) -> list[int]:
    """A chat prompt asking to repeat ~`tokens` of real code with one name changed."""
    code = (ROOT / "app/engine/kv_blocks.py").read_text()
    ids = llm.tokenizer.encode(code)[:tokens]
    snippet = llm.tokenizer.decode(ids)
    ask = ("Repeat the following Python code exactly, but rename the variable `table` to "
           "`blocks_of`. Output only the code.\n\n" + snippet)
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": ask}],
                                             add_generation_prompt=True, tokenize=True)
    # The answer starts the code block, as a model that follows the ask would.
    return chat + llm.tokenizer.encode("```python\n")


def tpot(out) -> float:
    m = out.metrics
    n = len(out.token_ids)
    return (m.finished_time - m.first_token_time) / max(1, n - 1)


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default="bench_results/spec_decode.json")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--random-tokens", type=int, default=64)
    ap.add_argument("--speculative-config", default=json.dumps(SPEC))
    a = ap.parse_args()
    common = dict(max_model_len=2048, enable_prefix_caching=False)
    engines = {"plain": LLM(**common),
               "ngram": LLM(speculative_config=a.speculative_config, **common)}
    prompt = repeat_prompt(engines["plain"])
    rng = random.Random(0)
    randoms = [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(8)]
    greedy = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    fixed = SamplingParams(max_tokens=a.random_tokens, temperature=0.0, ignore_eos=True)
    loads = {"repeat": ([prompt], greedy), "random8": (randoms, fixed),
             "random1": (randoms[:1], fixed)}
    results: dict = {name: {e: [] for e in engines} for name in loads}
    texts: dict = {}
    for r in range(a.rounds):
        for name, (prompts, params) in loads.items():
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for e in order:
                llm = engines[e]
                spec = llm.engine.speculator
                before = (spec.total.num_drafts, spec.total.num_draft_tokens,
                          spec.total.num_accepted_tokens) if spec else (0, 0, 0)
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                wall = time.perf_counter() - t0
                tokens = sum(len(o.token_ids) for o in outs)
                after = (spec.total.num_drafts, spec.total.num_draft_tokens,
                         spec.total.num_accepted_tokens) if spec else (0, 0, 0)
                results[name][e].append({
                    "tpot_s": statistics.median(tpot(o) for o in outs),
                    "output_tokens_per_s": tokens / wall, "output_tokens": tokens,
                    "drafts": after[0] - before[0], "draft_tokens": after[1] - before[1],
                    "accepted_tokens": after[2] - before[2]})
                texts.setdefault(name, {})[e] = [o.token_ids for o in outs]
            print(name, r, {e: round(v[-1]["tpot_s"] * 1e3, 2) for e, v in results[name].items()},
                  flush=True)
    summary = {}
    for name, by_engine in results.items():
        med = {e: {k: statistics.median(x[k] for x in runs) for k in runs[0]}
               for e, runs in by_engine.items()}
        summary[name] = {
            "median": med,
            "tpot_ratio_ngram_over_plain": med["ngram"]["tpot_s"] / med["plain"]["tpot_s"],
            "throughput_ratio_ngram_over_plain":
                med["ngram"]["output_tokens_per_s"] / med["plain"]["output_tokens_per_s"],
            "same_tokens": texts[name]["ngram"] == texts[name]["plain"],
        }
    report = {"cpu": cpu_model(), "rounds": a.rounds, "max_tokens": a.max_tokens,
              "speculative_config": json.loads(a.speculative_config),
              "repeat_prompt_tokens": len(prompt), "summary": summary, "runs": results}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: {kk: v[kk] for kk in v if kk != "median"} for k, v in summary.items()},
                     indent=2))
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
