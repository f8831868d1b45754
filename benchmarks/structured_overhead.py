"""What constrained decoding costs per token, at batch 1 and 32, side by side.

    python benchmarks/structured_overhead.py [OUT.json]

The offline engine (SmolLM2 bf16) generates 64 tokens per prompt, once free and once
under a grammar that never ends on its own (`[a-z ,.]*` with min_tokens = max_tokens,
so both runs produce the same number of tokens). The difference is the grammar's
price: filling a bitmask row per request per step on the event loop's side, applying
it on the model thread, advancing the matcher. Rounds alternate free / constrained.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from app import LLM, SamplingParams
from app.engine.grammar import StructuredOutput

TOKENS = 64
ROUNDS = 3


def run(llm: LLM, batch: int, constrained: bool) -> float:
    prompts = [[1000 + i, 2000, 3000 + i] for i in range(batch)]
    params = SamplingParams(max_tokens=TOKENS, min_tokens=TOKENS, temperature=0.8, seed=1,
                            ignore_eos=True,
                            structured=StructuredOutput("regex", "[a-z ,.]*") if constrained
                            else None)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    assert all(len(o.token_ids) == TOKENS for o in outs)
    return elapsed


def main() -> None:
    llm = LLM(dtype="bfloat16", max_model_len=256, kv_cache_memory="512MiB")
    run(llm, 2, True)  # compile the grammar, warm up
    rows = []
    for batch in (1, 32):
        times = {"free": [], "constrained": []}
        for _ in range(ROUNDS):
            for kind in ("free", "constrained"):
                times[kind].append(run(llm, batch, kind == "constrained"))
        free, cons = min(times["free"]), min(times["constrained"])
        per_token = (cons - free) / (batch * TOKENS) * 1e6
        rows.append({"batch": batch, "free_s": free, "constrained_s": cons,
                     "overhead_us_per_token": per_token, "ratio": cons / free})
        print(f"batch {batch:>3}: free {free:.2f} s, constrained {cons:.2f} s "
              f"({cons / free:.2f}x), {per_token:.0f} us per token")
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "bench_results/structured.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1))
    llm.shutdown()


if __name__ == "__main__":
    main()
