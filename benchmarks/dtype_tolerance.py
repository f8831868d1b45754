"""How far bfloat16 moves SmolLM2 from float32 on this CPU: the tolerance `--dtype auto`
is held to where it picks bfloat16 (`docs/cpu.md`, "Which dtype `auto` picks").

    python benchmarks/dtype_tolerance.py [--text FILE] [--chunks 8] [OUT.json]

Scores fixed English text (default: the GPL-3 shipped in /usr/share/common-licenses) in
512-token chunks with prompt logprobs under each dtype and reports the mean negative
log-likelihood per token, the perplexity ratio, how often the two dtypes' most likely next
token agree, and where their greedy answers to the parity questions first differ.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from host import describe

from app.engine.sampling_params import SamplingParams
from app.llm import LLM

CHUNK = 512
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one paragraph why the sky is blue.",
    "List three prime numbers greater than 50.",
]


def score(llm: LLM, chunks: list[list[int]]) -> tuple[list[float], list[int]]:
    """Per position: the text's token's log-probability and the model's top token."""
    outs = llm.generate([{"prompt_token_ids": c} for c in chunks],
                        SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0),
                        use_tqdm=False)
    logprobs, top = [], []
    for out in outs:
        for logprob, _rank, best in out.prompt_logprobs[1:]:
            logprobs.append(logprob)
            top.append(best[0][0])
    return logprobs, top


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("out", nargs="?")
    args = parser.parse_args()
    text = Path(args.text).read_text()
    results, tops, answers = {}, {}, {}
    greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for dtype in ("float32", "bfloat16"):
        llm = LLM(dtype=dtype, max_model_len=1024)
        ids = llm.tokenizer.encode(text)[: CHUNK * args.chunks]
        logprobs, tops[dtype] = score(llm, [ids[i:i + CHUNK] for i in range(0, len(ids), CHUNK)])
        nll = -sum(logprobs) / len(logprobs)
        results[dtype] = {"tokens": len(logprobs), "mean_nll": nll, "perplexity": math.exp(nll)}
        outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], greedy,
                        use_tqdm=False)
        answers[dtype] = [list(o.token_ids) for o in outs]
        llm.shutdown()
    agree = sum(a == b for a, b in zip(tops["float32"], tops["bfloat16"])) / len(tops["float32"])
    report = {
        **describe(),
        "text": args.text,
        "by_dtype": results,
        "perplexity_ratio_bf16_over_fp32": results["bfloat16"]["perplexity"]
        / results["float32"]["perplexity"],
        "top1_agreement": agree,
        "greedy_first_difference_of_64": [first_difference(a, b) for a, b in
                                          zip(answers["float32"], answers["bfloat16"])],
    }
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
