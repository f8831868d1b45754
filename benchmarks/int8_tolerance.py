"""How far int8 x (`--int8-batches`, a bf16 model's calls of four rows or more on a CPU
without AMX) moves a GGUF's prompt scores from the exact kernels: what docs/cpu.md
("Calls of many rows in int8 without AMX") quotes for a real-weight K-quant file.

    RIDGELINE_CPU_ISA=avx512 python benchmarks/int8_tolerance.py GGUF [--chunks 4] [OUT.json]

Scores fixed English text (default: the GPL-3 shipped in /usr/share/common-licenses) in
512-token chunks with prompt logprobs, once with `--no-int8-batches` and once with int8
batches, both bf16, and reports how often the two runs' most likely next token agree,
the median absolute difference of the text's tokens' log-probabilities and the
perplexity ratio. On a host with AMX, cap the ISA (as above): with AMX every call stays
exact. A real-weight K-quant file: the embedded SmolLM2 requantized, e.g.
`llama-quantize --allow-requantize SmolLM2-135M-Instruct.Q4_1.gguf out.gguf Q4_K_M`.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from dtype_tolerance import CHUNK, score
from host import describe

from app.llm import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf")
    parser.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("out", nargs="?")
    args = parser.parse_args()
    text = Path(args.text).read_text()
    runs = {}
    for int8 in (False, True):
        llm = LLM(model=args.gguf, dtype="bfloat16", int8_batches=int8, max_model_len=1024)
        try:
            assert llm.engine.worker.wait_ready().capabilities.int8_batches == int8, (
                "int8 batches not taken: a host with AMX keeps every call exact (cap the ISA)")
            ids = llm.tokenizer.encode(text)[: CHUNK * args.chunks]
            runs[int8] = score(llm, [ids[i:i + CHUNK] for i in range(0, len(ids), CHUNK)])
        finally:
            llm.shutdown()
    (exact, exact_top), (int8, int8_top) = runs[False], runs[True]
    deltas = sorted(abs(a - b) for a, b in zip(exact, int8, strict=True))
    report = {
        **describe(),
        "gguf": args.gguf,
        "text": args.text,
        "positions": len(exact),
        "top1_agreement": sum(a == b for a, b in zip(exact_top, int8_top)) / len(exact_top),
        "median_abs_logprob_delta": deltas[len(deltas) // 2],
        "perplexity_ratio_int8_over_exact": math.exp((sum(exact) - sum(int8)) / len(exact)),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
