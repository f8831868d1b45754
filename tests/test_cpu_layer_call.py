"""The fused decode call (`gpu/cpu/layer_call.py`, `kernels/decode_layers.cpp`) against
the module path, on a tiny random bf16 Llama whose linears hold Q4_1 blocks, and on one
mixed as a Q4_K_M file mixes them (some layers' v and down in Q6_K: a `SplitLinear` qkv).

The fused call runs the module path's kernels in its order, so every decode step's
hidden states, logits, greedy ids and KV pools must be the module path's bit for bit.
Two copies of the pools run the same steps, one with the fused call on, one off; the
counter shows the fused call ran where it applies (decode-only steps of one to three
rows: the dot-product kernel; four: AMX where the CPU has it) and not
where it does not (a prefill, a prefill beside a decode, a model it does not take):
those run the module path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from gpu.attention.base import AttentionInputs, StepContext
from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.cpu.capabilities import CpuCapabilities
from gpu.cpu.decoder_ops import CpuDecoderOps
from gpu.cpu.kernels.build import cpu_kernels
from gpu.cpu.layer_call import LayerCall
from gpu.cpu.packing import SplitLinear, pack_linears
from gpu.cpu.routing import INT8_MIN_ROWS
from models.config import ModelConfig
from models.decoder import DecoderForCausalLM
from models.gguf_blocks import QuantizedWeight
from tests.test_gguf_types import random_blocks, rewritten

KERNELS = cpu_kernels() if not torch.cuda.is_available() else None
CAPS = CpuCapabilities.of(KERNELS)
pytestmark = pytest.mark.skipif(
    not CAPS.has("decode_layers_bf16") or not CAPS.bf16_arithmetic,
    reason="no fused decode call here (it needs the AVX512-BF16 kernels)")

BLOCK = 16
NUM_BLOCKS = 16
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
PARTS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
         "mlp": ("gate_proj", "up_proj", "down_proj")}


def q4_1(n: int, k: int, g: torch.Generator) -> QuantizedWeight:
    """Random Q4_1 blocks (f16 scales and mins, as in a GGUF)."""
    scales = (torch.randn(n, k // 32, generator=g) * 0.02).half().float()
    mins = (torch.randn(n, k // 32, generator=g) * 0.1).half().float()
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    return QuantizedWeight("q4_1", qweight, scales, mins)


# Q6_K blocks span 256 weights of a row: the mixed model's k dimensions are multiples.
MIXED = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}


def q6_k(n: int, k: int, seed: int) -> QuantizedWeight:
    """Random Q6_K blocks, rewritten as the load rewrites them (Q8_16)."""
    return rewritten("Q6_K", random_blocks("Q6_K", n, k, seed), n)


def tiny_model(positions: int = 256, mixed: bool = False,
               caps: CpuCapabilities = CAPS) -> DecoderForCausalLM:
    """The tiny Llama in bf16, its linears packed with their blocks (the weights are the
    blocks' values) as the runner packs a GGUF model's; RoPE for `positions` positions.
    `mixed`: layers 0 and 2 hold v_proj and down_proj in Q6_K, as llama-quantize's
    Q4_K_M gives some layers. `caps`: the capabilities the linears are packed for."""
    hf = CONFIG | {"max_position_embeddings": positions} | (MIXED if mixed else {})
    cfg = ModelConfig.from_hf_dict(hf)
    g = torch.Generator().manual_seed(0)
    model = DecoderForCausalLM(cfg, max_positions=positions, ops=CpuDecoderOps(CAPS))
    hidden, inter, head = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {"q_proj": (cfg.num_heads * head, hidden), "o_proj": (hidden, cfg.num_heads * head),
              "k_proj": (cfg.num_kv_heads * head, hidden), "gate_proj": (inter, hidden),
              "v_proj": (cfg.num_kv_heads * head, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}
    weights, blocks = {}, {}
    for i in range(cfg.num_layers):
        for module, names in PARTS.items():
            for name in names:
                key = f"model.layers.{i}.{module}.{name}.weight"
                six = mixed and i != 1 and name in ("v_proj", "down_proj")
                blocks[key] = q6_k(*shapes[name], seed=i) if six else q4_1(*shapes[name], g)
                weights[key] = blocks[key].dequantize()
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[f"model.layers.{i}.{norm}.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    weights["model.norm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    weights["model.embed_tokens.weight"] = torch.randn(cfg.vocab_size, hidden, generator=g)
    weights["lm_head.weight"] = 0.1 * torch.randn(cfg.vocab_size, hidden, generator=g)
    model = model.to(torch.bfloat16)
    model.rotary = model.make_rotary(positions)
    model.load_weights(weights.items())
    pack_linears(model, blocks, caps)
    return model.eval()


def own_blocks(seq: int) -> list[int]:
    """Four blocks a sequence, none shared."""
    return [4 * seq + i for i in range(4)]


class Run:
    """One copy of the KV pools (`num_blocks`), each sequence's block table given by
    `table`, stepped by `step`."""

    def __init__(self, model: DecoderForCausalLM, fused: bool,
                 table: Callable[[int], list[int]] = own_blocks, num_blocks: int = NUM_BLOCKS):
        cfg = model.config
        self.model, self.fused, self.table = model, fused, table
        self.backend = TorchAttentionBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                             BLOCK, CAPS)
        shape = self.backend.kv_cache_shape(num_blocks)
        self.k = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(cfg.num_layers)]
        self.lens: dict[int, int] = {}

    def step(self, new: dict[int, list[int]]):
        """Sequence -> its new tokens; returns (hidden, logits of each last token, the
        step's shared prefix or None)."""
        seqs = sorted(new)
        ids, positions, slots, qstart, ctx_lens = [], [], [], [0], []
        width = max(len(self.table(s)) for s in seqs)
        tables = torch.zeros(len(seqs), width, dtype=torch.int32)
        for row, s in enumerate(seqs):
            first = self.lens.get(s, 0)
            self.lens[s] = first + len(new[s])
            blocks = self.table(s)
            tables[row] = torch.tensor(blocks + blocks[-1:] * (width - len(blocks)))
            for j, tok in enumerate(new[s]):
                ids.append(tok)
                positions.append(first + j)
                slots.append(blocks[(first + j) // BLOCK] * BLOCK + (first + j) % BLOCK)
            qstart.append(qstart[-1] + len(new[s]))
            ctx_lens.append(self.lens[s])
        inputs = AttentionInputs(
            torch.tensor(slots), torch.tensor(qstart, dtype=torch.int32),
            torch.tensor(ctx_lens, dtype=torch.int32), tables,
            max(len(new[s]) for s in seqs), max(ctx_lens),
            [len(new[s]) for s in seqs], ctx_lens)
        meta = self.backend.prepare(inputs)
        ctx = StepContext(self.backend, meta, self.k, self.v)
        self.model.ops.fuses_layers = self.fused
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), ctx)
            last = torch.tensor(qstart[1:]) - 1
            logits = self.model.compute_logits(hidden[last])
        return hidden, logits, meta.groups[0].shared


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16
                                              else a, b.view(torch.int16)
                                              if b.dtype == torch.bfloat16 else b)


@pytest.mark.parametrize("mixed", [False, True], ids=["q4_1", "q4_1+q6_k"])
def test_fused_decode_is_the_module_path_bit_for_bit(mixed):
    model = tiny_model(mixed=mixed)
    if mixed:
        assert type(model.layers[0].self_attn.qkv_proj) is SplitLinear
    ops: CpuDecoderOps = model.ops
    on, off = Run(model, fused=True), Run(model, fused=False)

    def both(new: dict[int, list[int]], fused_rows: bool) -> dict[int, int]:
        calls = ops.layer_calls
        (h1, l1, _), (h0, l0, _) = on.step(new), off.step(new)
        assert ops.layer_calls - calls == fused_rows, new
        assert same(h1, h0) and same(l1, l0)
        for a, b in zip(on.k + on.v, off.k + off.v, strict=True):
            assert same(a, b)
        return dict(zip(sorted(new), l1.argmax(-1).tolist(), strict=True))

    nxt = both({0: [5, 17, 300, 42, 7]}, fused_rows=False)  # a prefill: the module path
    for _ in range(6):  # one-row decode steps: the fused call
        nxt = both({0: [nxt[0]]}, fused_rows=True)
    nxt |= both({1: [9, 8, 7]}, fused_rows=False)
    for _ in range(3):  # two decode rows: the dot-product kernel still
        nxt |= both({0: [nxt[0]], 1: [nxt[1]]}, fused_rows=True)
    nxt |= both({0: [nxt[0]], 2: [1, 2, 3, 4]}, fused_rows=False)  # decode beside a prefill
    for _ in range(3):  # one row again
        nxt |= both({2: [nxt[2]]}, fused_rows=True)
    nxt |= both({3: [11, 12]}, fused_rows=False)
    # Four rows: Q4_1 on AMX where the CPU has it, else the widened blocks; Q6_K parts
    # on their exact kernel either way (AMX takes them from five rows).
    for _ in range(4):
        nxt = both({s: [nxt[s]] for s in range(4)}, fused_rows=True)
    assert ops.layer_calls == 16


@pytest.mark.skipif(not CAPS.int8, reason="no int8 kernels here")
@pytest.mark.parametrize("mixed", [False, True], ids=["q4_1", "q4_1+q6_k"])
def test_fused_decode_takes_the_int8_rows_bit_for_bit(mixed):
    """The routes of a CPU without AMX (`int8_batches`): decode steps of four rows or
    more take the int8 kernel, in the fused call as in the module path. Packed for those
    routes on this host (its AMX kernels left unused), not a mock: the same kernels
    such a CPU runs."""
    caps = dataclasses.replace(CAPS, amx=False, int8_batches=True)
    model = tiny_model(mixed=mixed, caps=caps)
    call = LayerCall.of(model, CAPS.op("decode_layers_bf16"))
    assert call.route(INT8_MIN_ROWS) == [3, 3 if mixed else 0]
    assert call.route(INT8_MIN_ROWS - 1) == [0, 0]  # the dot products, Q6_K's too
    ops: CpuDecoderOps = model.ops
    on, off = Run(model, fused=True), Run(model, fused=False)
    nxt = {}
    for s in range(4):  # prefills: the module path
        (_, l1, _), (_, l0, _) = on.step({s: [5 + s, 17, 300]}), off.step({s: [5 + s, 17, 300]})
        assert same(l1, l0)
        nxt[s] = l1.argmax(-1).item()
    for _ in range(4):
        new = {s: [nxt[s]] for s in range(4)}
        (h1, l1, _), (h0, l0, _) = on.step(new), off.step(new)
        assert same(h1, h0) and same(l1, l0)
        for a, b in zip(on.k + on.v, off.k + off.v, strict=True):
            assert same(a, b)
        nxt = dict(enumerate(l1.argmax(-1).tolist()))
    assert ops.layer_calls == 4


def test_each_row_count_takes_the_linears_route():
    """Per format (Q4_1, Q8_16) its route's code, or None where one takes no route the
    fused call has."""
    call = LayerCall.of(tiny_model(), CAPS.op("decode_layers_bf16"))
    # The AVX512-BF16 dot product (no Q8_16 parts: its code is a placeholder).
    assert [call.route(r) for r in (1, 2, 3)] == [[0, 0]] * 3
    assert call.route(4) == [2 if CAPS.amx else 1, 0]  # AMX, else the widened blocks
    # The layers hold their blocks alone: however many rows, the step reads them.
    assert call.route(4096) == [2 if CAPS.amx else 1, 0]
    mixed = LayerCall.of(tiny_model(mixed=True), CAPS.op("decode_layers_bf16"))
    # Q6_K: its dot kernel too, but on AMX's CPUs the exact kernel (routing.py)
    assert [mixed.route(r) for r in (1, 2, 3)] == [[0, 1 if CAPS.amx else 0]] * 3
    assert mixed.route(4) == [2 if CAPS.amx else 1, 1]
    assert mixed.route(8) == ([2, 2] if CAPS.amx else [1, 1])  # AMX from five rows


def test_models_it_does_not_take_run_their_layers():
    model = tiny_model()
    op = CAPS.op("decode_layers_bf16")
    assert LayerCall.of(model, op) is not None
    model.layers[1].self_attn.sliding_window = 64
    assert LayerCall.of(model, op) is None
    model.layers[1].self_attn.sliding_window = None
    model.layers[2].mlp.down_proj = torch.nn.Linear(256, 128, bias=False).bfloat16()
    assert LayerCall.of(model, op) is None
    assert LayerCall.of(tiny_model().float(), op) is None


def test_smollm2_serves_the_same_greedy_ids_with_the_fused_call_on_and_off():
    """The real SmolLM2 (its GGUF's Q4_1 blocks, bf16) through the engine: one request,
    then four at once (AMX or the widened blocks), the same greedy ids either way, and
    the fused call ran only where it was on."""
    from app.engine.sampling_params import SamplingParams
    from app.llm import LLM

    # No prefix cache: the second run's prefills would start after cached blocks, a
    # different row count for the linears, and may round differently.
    llm = LLM(dtype="bfloat16", max_model_len=512, kv_cache_memory="64MiB",
              enable_prefix_caching=False)
    try:
        worker = llm.engine.worker

        def fuse(on: bool) -> int:
            def set_on(runner) -> int:
                runner.model.ops.fuses_layers = on
                return runner.model.ops.layer_calls
            return worker.call(set_on).result()

        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        prompts = ["The capital of France is", "Write a haiku about rain, then explain "
                   "the imagery line by line for a reader new to the form.", "2 + 2 =",
                   "List three rivers of Europe:"]
        ids, calls = {}, {}
        for on in (True, False):
            before = fuse(on)
            ids[on] = [[o.token_ids for o in llm.generate(batch, params)]
                       for batch in (prompts[:1], prompts)]
            calls[on] = fuse(True) - before
        assert ids[True] == ids[False]
        assert calls[True] >= 2 * 15 and calls[False] == 0
    finally:
        llm.shutdown()
