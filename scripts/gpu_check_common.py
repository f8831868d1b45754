"""What every part of the GPU check shares: model shapes, random weights, batches, timing.

Batches here carry whole block tables (`Batch.block_tables`), the hand-made kind; the
engine's delta form is exercised by the engine section and the tests.
"""

from __future__ import annotations

import statistics
import time

import torch

from gpu.batch import Batch, SamplingRow

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
    max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=128000,
    eos_token_id=128001,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=8192),
)
TINY = dict(LLAMA3_8B, vocab_size=1024, hidden_size=128, intermediate_size=256,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
GREEDY = SamplingRow(temperature=0.0)


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


def decode_batch(batch: int, context: int | list[int], first_block: int, bs: int = 16,
                 row: SamplingRow = GREEDY) -> Batch:
    """`batch` rows at `context` tokens each (or one context per row) on fresh pages; the
    KV contents do not matter."""
    contexts = context if isinstance(context, list) else [context] * batch
    tables, nxt = [], first_block
    for c in contexts:
        per_seq = -(-c // bs)
        tables.append(list(range(nxt, nxt + per_seq)))
        nxt += per_seq
    last = [c - 1 for c in contexts]
    return Batch([1] * batch, last, [t[p // bs] * bs + p % bs for t, p in zip(tables, last)],
                 [1] * batch, contexts, tables, list(range(batch)), [row] * batch)


def capture_logits(runner):
    """Make `runner` record the logits it samples from; returns the list they go to."""
    seen: list[torch.Tensor] = []
    real = runner._sample

    def sample(logits, rows):
        seen.append(logits.float().clone())
        return real(logits, rows)

    runner._sample = sample
    return seen
