"""Speculative decoding (ngram, suffix, draft_model) against plain decoding on
SmolLM2, in one process.

    python benchmarks/spec_decode.py [--methods ngram,suffix] [--loads repeat,agent]
        [--draft-model DIR] [--rounds 3] [--max-tokens 256] [OUT.json]

Engines over the same model, one without speculation and one per method, alternate
round by round (the order reversed every other round), so host noise hits all alike.
Each round takes its code from another file of this repository, so what suffix
decoding's global tree learnt in an earlier round is no answer to this one. Loads:
- `repeat`: one user, greedy, a ~1,000-token prompt (code from this repository) that
  the answer largely repeats ("repeat this code with the variable renamed"); time per
  output token (decode time / (tokens - 1)) and the outputs' identity;
- `agent`: one user in an agent-like loop: the code, then `--turns` turns that each
  resend the whole history (the earlier answers included) with one more small change
  asked; time per output token over the turns;
- `random8`: 8 users at once, random-token prompts, a fixed number of tokens each
  (`ignore_eos`): output tokens per second, where speculation must back off (the
  default `disable_by_batch_size` is 8) and cost nothing;
- `random1`: one user, a random-token prompt: acceptance is low, the per-request
  back-off must keep time per output token as without speculation.
Reports per load the median of each engine's rounds and its ratio to plain decoding,
the drafts and acceptance, and the host CPU (model name and AMX / AVX-512 flags).
`draft_model` runs with `--draft-model` (any model sharing SmolLM2's vocabulary; the
target itself by default, which shows the method's cost more than its gain).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from host import describe

from app import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
              "prompt_lookup_max": 5},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 4},
}
FILES = ["app/engine/kv_blocks.py", "app/engine/scheduler.py", "app/engine/core.py",
         "app/engine/output_processor.py", "app/engine/admission.py"]
RENAMES = [("req", "request"), ("seq", "sequence"), ("out", "result"), ("self", "this")]


def code_of(tokenizer, round_: int, tokens: int) -> str:
    code = (ROOT / FILES[round_ % len(FILES)]).read_text()
    return tokenizer.decode(tokenizer.encode(code)[:tokens])


def chat(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # The answer starts the code block, as a model that follows the ask would.
    return ids + tokenizer.encode("```python\n")


def repeat_prompt(tokenizer, round_: int, tokens: int = 1000) -> list[int]:
    """A chat prompt asking to repeat ~`tokens` of real code with one name changed."""
    ask = ("Repeat the following Python code exactly, but rename the variable `table` to "
           "`blocks_of`. Output only the code.\n\n" + code_of(tokenizer, round_, tokens))
    return chat(tokenizer, [{"role": "user", "content": ask}])


def agent_turns(tokenizer, round_: int, turns: int, answer) -> list:
    """Turns that resend the history with one more rename asked; `answer(prompt_ids)`
    gives a turn's output (anything with `.text`); the outputs. The servers' benchmark
    (`spec_peers.py`) drives the same turns over HTTP."""
    code = code_of(tokenizer, round_, 500)
    messages = [{"role": "user", "content": "Here is a Python file. Output it with "
                 f"`{RENAMES[0][0]}` renamed to `{RENAMES[0][1]}`, only the code.\n\n"
                 + code}]
    outs = []
    for t in range(turns):
        out = answer(chat(tokenizer, messages))
        outs.append(out)
        old, new = RENAMES[(t + 1) % len(RENAMES)]
        messages += [{"role": "assistant", "content": "```python\n" + out.text},
                     {"role": "user", "content": f"Good. Now also rename `{old}` to "
                      f"`{new}` and output the whole file again."}]
    return outs


def agent_loop(llm: LLM, round_: int, turns: int, params: SamplingParams) -> list:
    return agent_turns(llm.tokenizer, round_, turns,
                       lambda ids: llm.generate([ids], params, use_tqdm=False)[0])


def tpot(out) -> float:
    m = out.metrics
    n = len(out.token_ids)
    return (m.finished_time - m.first_token_time) / max(1, n - 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default="bench_results/spec_decode.json")
    ap.add_argument("--methods", default="ngram,suffix")
    ap.add_argument("--loads", default="repeat,agent,random8,random1")
    ap.add_argument("--draft-model", default=None, help="draft_model's model (default: "
                    "the target itself)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--random-tokens", type=int, default=64)
    a = ap.parse_args()
    common = dict(max_model_len=4096, enable_prefix_caching=False)
    engines = {"plain": LLM(**common)}
    specs = {}
    for method in a.methods.split(","):
        specs[method] = dict(SPECS[method])
        if method == "draft_model":
            specs[method]["model"] = a.draft_model or str(engines["plain"].engine.model_dir)
        engines[method] = LLM(speculative_config=specs[method], **common)
    rng = random.Random(0)
    randoms = [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(8)]
    greedy = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    fixed = SamplingParams(max_tokens=a.random_tokens, temperature=0.0, ignore_eos=True)
    plain = engines["plain"]

    def run(name: str, llm: LLM, r: int) -> list:
        if name == "repeat":
            return llm.generate([repeat_prompt(plain.tokenizer, r)], greedy, use_tqdm=False)
        if name == "agent":
            return agent_loop(llm, r, a.turns, greedy)
        return llm.generate(randoms if name == "random8" else randoms[:1], fixed,
                            use_tqdm=False)

    loads = a.loads.split(",")
    results: dict = {name: {e: [] for e in engines} for name in loads}
    same: dict = {name: {e: True for e in engines} for name in loads}
    for r in range(a.rounds):
        for name in loads:
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            texts = {}
            for e in order:
                llm = engines[e]
                spec = llm.engine.speculator
                before = (spec.total.num_drafts, spec.total.num_draft_tokens,
                          spec.total.num_accepted_tokens) if spec else (0, 0, 0)
                t0 = time.perf_counter()
                outs = run(name, llm, r)
                wall = time.perf_counter() - t0
                tokens = sum(len(o.token_ids) for o in outs)
                after = (spec.total.num_drafts, spec.total.num_draft_tokens,
                         spec.total.num_accepted_tokens) if spec else (0, 0, 0)
                results[name][e].append({
                    "tpot_s": statistics.median(tpot(o) for o in outs),
                    "output_tokens_per_s": tokens / wall, "output_tokens": tokens,
                    "drafts": after[0] - before[0], "draft_tokens": after[1] - before[1],
                    "accepted_tokens": after[2] - before[2]})
                texts[e] = [o.token_ids for o in outs]
            for e in engines:
                same[name][e] &= texts[e] == texts["plain"]
            print(name, r, {e: round(v[-1]["tpot_s"] * 1e3, 2) for e, v in results[name].items()},
                  flush=True)
    summary = {}
    for name, by_engine in results.items():
        med = {e: {k: statistics.median(x[k] for x in runs) for k in runs[0]}
               for e, runs in by_engine.items()}
        summary[name] = {"median": med}
        for e in specs:
            summary[name][e] = {
                "tpot_ratio": med[e]["tpot_s"] / med["plain"]["tpot_s"],
                "throughput_ratio": med[e]["output_tokens_per_s"]
                / med["plain"]["output_tokens_per_s"],
                "acceptance": med[e]["accepted_tokens"] / max(1, med[e]["draft_tokens"]),
                "same_tokens": same[name][e]}
    report = {**describe(), "rounds": a.rounds, "max_tokens": a.max_tokens,
              "turns": a.turns, "speculative_configs": specs, "summary": summary,
              "runs": results}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2))
    print(report["cpu"])
    print(json.dumps({k: {kk: v[kk] for kk in v if kk != "median"} for k, v in summary.items()},
                     indent=2))
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
