"""The engine end to end on the device: the offline `LLM`, CUDA graphs on and off.

A random-weight model of a real shape (Llama-3-8B layers, fewer of them, and the
vocabulary of the tokenizer it is given) is written to a temporary folder with the
tokenizer, then served twice through the very engine `ridgeline bench throughput`
drives: once with CUDA graphs, once with `--enforce-eager`. Output tokens per second
and the mean step time come back for each.

The tokenizer: `--tokenizer DIR`, else `scripts/gpu_check_tokenizer/` (copy the SmolLM2
tokenizer files there before carrying the tree to the GPU machine: `ridgeline
export-model` writes them), else a word-level tokenizer built on the spot, so the
section runs without network or the embedded model either way.
"""

from __future__ import annotations

import gc
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from gpu_check_common import LLAMA3_8B, TINY, random_prompts, random_weights
from safetensors.torch import save_file

from models.tiny import TOKENIZER_FILES

HERE = Path(__file__).resolve().parent


def tokenizer_dir(check, out: Path) -> tuple[Path, int]:
    """A folder holding tokenizer files, and the tokenizer's vocabulary size."""
    from transformers import AutoTokenizer

    given = check.args.tokenizer or (HERE / "gpu_check_tokenizer")
    if Path(given).is_dir() and (Path(given) / "tokenizer.json").exists():
        source = Path(given)
    else:
        source = out / "word-level-tokenizer"
        _word_level_tokenizer(source, 4096 if check.smoke else 32768)
    return source, len(AutoTokenizer.from_pretrained(source))


def _word_level_tokenizer(out: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(out)


def write_model(check, out: Path) -> tuple[Path, dict]:
    source, vocab = tokenizer_dir(check, out)
    size = check.size["engine"]
    cfg = dict(TINY if check.smoke else LLAMA3_8B, num_hidden_layers=size["layers"],
               vocab_size=vocab, bos_token_id=1, eos_token_id=2)
    model = out / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(cfg))
    tensors = {name: t.cpu() for name, t in random_weights(cfg, check.device, check.dtype)}
    save_file(tensors, str(model / "model.safetensors"))
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, model / name)
    return model, cfg


def _serve(model: Path, check, enforce_eager: bool) -> dict:
    from app.engine.sampling_params import SamplingParams
    from app.llm import LLM

    size = check.size["engine"]
    llm = LLM(str(model), dtype="float32" if check.smoke else "bfloat16",
              device=check.device.type, max_model_len=size["input_len"] + size["output_len"],
              max_num_seqs=size["prompts"], enforce_eager=enforce_eager,
              gpu_memory_utilization=0.5, **({"kv_cache_memory": 64 << 20} if check.smoke
                                              else {}))
    try:
        vocab = llm.engine.model_config.vocab_size
        prompts = random_prompts([size["input_len"]] * size["prompts"], vocab, seed=4)
        params = SamplingParams(max_tokens=size["output_len"], temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        steps = 0
        real_step = llm.engine.step

        def counted():
            nonlocal steps
            steps += 1
            return real_step()

        llm.engine.step = counted
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        runner = llm.engine.worker.wait_ready()
        return {"output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                "steps": steps, "mean_step_ms": seconds / steps * 1e3,
                "graph_replays": runner.graphs.replays if runner.graphs else 0}
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if check.device.type == "cuda":
            torch.cuda.empty_cache()


def engine(check) -> dict:
    out = Path(tempfile.mkdtemp(prefix="gpu-check-engine-"))
    try:
        model, cfg = write_model(check, out)
        graphs = _serve(model, check, enforce_eager=False)
        eager = _serve(model, check, enforce_eager=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    expected = check.size["engine"]["prompts"] * check.size["engine"]["output_len"]
    return {"ok": graphs["output_tokens"] == eager["output_tokens"] == expected
            and (check.smoke or graphs["graph_replays"] > 0),
            "layers": cfg["num_hidden_layers"], "vocab": cfg["vocab_size"],
            "graphs": graphs, "enforce_eager": eager,
            "speedup": graphs["tokens_per_s"] / eager["tokens_per_s"]}
