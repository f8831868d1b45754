"""LoRA adapters offline: PEFT's format read into our fused linears, proven against the
adapter merged into the model by PEFT itself (`merge_and_unload`), on tiny models of
the architectures whose layouts differ (Llama's separate q/k/v, Qwen2's biases,
Phi-3's checkpoint fused already); mixed batches, the adapter bound per step, the host
cache, the prefix cache kept apart per adapter; and the adapters that must be refused.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from app import LLM, SamplingParams
from app.engine.errors import AdapterInUse, AdapterNotFound, InvalidParameter
from app.engine.loras import unload
from tests.hf_reference import hf_greedy
from tests.lora_adapters import ATTENTION, MLP, make_adapter

pytest.importorskip("peft")

NUM_TOKENS = 16
MAX_MODEL_LEN = 96
COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
              max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
GREEDY = dict(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


def configs():
    from transformers import LlamaConfig, Phi3Config, Qwen2Config

    return {"llama": LlamaConfig(**COMMON, tie_word_embeddings=False),
            "qwen2": Qwen2Config(**COMMON, tie_word_embeddings=True),
            "phi3": Phi3Config(**COMMON | dict(pad_token_id=None), tie_word_embeddings=False)}


# Per architecture: adapter name -> (target modules, rank, alpha, extra LoraConfig keys).
ADAPTERS = {
    "llama": {"all": (ATTENTION + MLP, 8, 16, {}),
              "qv": (["q_proj", "v_proj"], 4, 8, {}),
              "mlp-rslora": (MLP, 16, 8, {"use_rslora": True})},
    "qwen2": {"all": (ATTENTION + MLP, 8, 16, {}),
              "k-down": (["k_proj", "down_proj"], 2, 4, {})},
    # Phi-3's checkpoint holds qkv_proj and gate_up_proj fused: PEFT adapts them whole.
    "phi3": {"fused": (["qkv_proj", "gate_up_proj", "o_proj", "down_proj"], 8, 16, {})},
}


@pytest.fixture(scope="module")
def built(tmp_path_factory, smollm2_dir):
    """arch -> (base dir, {adapter: dir}, {None or adapter: expected ids per prompt})."""
    from transformers import AutoModelForCausalLM

    from models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("lora")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49000, (n,), generator=g).tolist() for n in (3, 17, 40)]
    out = {}
    for arch, cfg in configs().items():
        base = make_tiny_hf_model(root / arch, smollm2_dir, cfg)
        hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
        expected = {None: [hf_greedy(hf, p, NUM_TOKENS) for p in prompts]}
        dirs = {}
        for i, (name, (targets, r, alpha, extra)) in enumerate(ADAPTERS[arch].items()):
            dirs[name] = root / "adapters" / arch / name
            merged = make_adapter(base, dirs[name], targets, r, alpha, seed=i, **extra)
            expected[name] = [hf_greedy(merged, p, NUM_TOKENS) for p in prompts]
            assert expected[name] != expected[None], f"{arch}/{name} changes nothing"
        out[arch] = (base, dirs, expected, prompts)
    return out


def serve(base, dirs, **settings) -> LLM:
    return LLM(str(base), dtype="float32", max_model_len=MAX_MODEL_LEN, enable_lora=True,
               lora_modules=[f"{n}={p}" for n, p in dirs.items()], **settings)


@pytest.mark.parametrize("arch", list(ADAPTERS))
def test_each_adapter_alone_matches_peft_merged(arch, built):
    base, dirs, expected, prompts = built[arch]
    llm = serve(base, dirs, max_loras=1)
    try:
        for name in [None, *dirs]:
            outs = llm.generate(prompts, SamplingParams(**GREEDY, lora_name=name),
                                use_tqdm=False)
            assert [o.token_ids for o in outs] == expected[name], (arch, name)
        llm.engine.check_invariants()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_a_mixed_batch_gives_each_request_its_own_ids(built, backend):
    """Three adapters and the base in one batch, every prompt under each: the same ids
    as alone, with chunked prefill in a small budget and rows of one adapter apart; with
    the C++ kernels (few-row sequences through `lora_delta_`) and without (all torch)."""
    base, dirs, expected, prompts = built["llama"]
    names = [None, *dirs]
    llm = serve(base, dirs, max_loras=3, max_num_batched_tokens=24, attention_backend=backend)
    try:
        jobs = [(p, n) for i, p in enumerate(prompts) for n in names[i % 4:] + names[:i % 4]]
        outs = llm.generate([p for p, _ in jobs],
                            [SamplingParams(**GREEDY, lora_name=n) for _, n in jobs],
                            use_tqdm=False)
        for (p, n), o in zip(jobs, outs):
            assert o.token_ids == expected[n][prompts.index(p)], n
        llm.engine.check_invariants()
    finally:
        llm.shutdown()


def test_steps_hold_at_most_max_loras_adapters(built, monkeypatch):
    """Three adapters, two slots, one cached in host memory beyond them: every step holds
    at most two adapters, the third waits its turn, and the ids stay exact."""
    base, dirs, expected, prompts = built["llama"]
    llm = serve(base, dirs, max_loras=2, max_cpu_loras=2)
    seen: list[set[int]] = []
    core = llm.engine
    schedule = core.schedule

    def spy():
        step = schedule()
        if step is not None:
            seen.append(set(step.batch.lora_ids) - {0})
        return step

    monkeypatch.setattr(core, "schedule", spy)
    try:
        names = list(dirs)
        outs = llm.generate([prompts[1]] * 6,
                            [SamplingParams(**GREEDY, lora_name=names[i % 3]) for i in range(6)],
                            use_tqdm=False)
        assert [o.token_ids for o in outs] == [expected[names[i % 3]][1] for i in range(6)]
        assert max(map(len, seen)) == 2
        assert set().union(*seen) == {core.loras.get(n).lora_id for n in names}
    finally:
        llm.shutdown()


def _run_alone(core, rid, prompt, name):
    """(token ids, prompt tokens found in the prefix cache) of one request run alone."""
    core.add_request(rid, prompt, SamplingParams(**GREEDY, lora_name=name))
    hits, ids = 0, None
    while core.has_work:
        step = core.step()
        hits += step.stats.prefix_cache_hits
        ids = next((o.token_ids for o in step.outputs if o.finished), ids)
    return ids, hits


def test_the_prefix_cache_is_kept_apart_per_adapter(built):
    """The same prompt under the base, an adapter, the adapter again, another adapter,
    and the base again: each first run under an adapter finds nothing, each later one
    finds its own blocks, and every run has its exact ids."""
    base, dirs, expected, prompts = built["llama"]
    llm = serve(base, dirs, max_loras=1, block_size=4)
    prompt, cached = prompts[2], (len(prompts[2]) - 1) // 4 * 4
    try:
        runs = [(None, 0), ("all", 0), ("all", cached), ("qv", 0), (None, cached)]
        for i, (name, hits) in enumerate(runs):
            ids, got = _run_alone(llm.engine, f"r{i}", prompt, name)
            assert (ids, got) == (expected[name][2], hits), (i, name)
        llm.engine.check_invariants()
    finally:
        llm.shutdown()


def test_unknown_adapter_is_refused(built):
    base, dirs, _, prompts = built["llama"]
    llm = serve(base, {"qv": dirs["qv"]})
    try:
        with pytest.raises(AdapterNotFound, match="does not exist"):
            llm.generate(prompts[:2], [SamplingParams(**GREEDY, lora_name="qv"),
                                       SamplingParams(**GREEDY, lora_name="nope")],
                         use_tqdm=False)
        assert not llm.engine.has_work  # all or nothing: the good one was not queued
    finally:
        llm.shutdown()


def _copy(src, dst, **config_changes):
    shutil.copytree(src, dst)
    if config_changes:
        cfg = json.loads((dst / "adapter_config.json").read_text()) | config_changes
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_bad_adapters_are_refused_at_load_and_the_engine_goes_on(built, tmp_path):
    """Each a 400 naming why; the good adapter and the base keep their exact ids."""
    base, dirs, expected, prompts = built["llama"]
    good = dirs["all"]
    corrupt = _copy(good, tmp_path / "corrupt")
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    other_base = _copy(good, tmp_path / "other-base")  # a q_proj of another width
    tensors = load_file(other_base / "adapter_model.safetensors")
    key = next(k for k in tensors if "layers.0.self_attn.q_proj.lora_A" in k)
    tensors[key] = torch.randn(8, 48)
    save_file(tensors, other_base / "adapter_model.safetensors")
    lm_head = _copy(good, tmp_path / "lm-head")
    tensors = load_file(lm_head / "adapter_model.safetensors")
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.randn(8, 64)
    tensors["base_model.model.lm_head.lora_B.weight"] = torch.randn(49152, 8)
    save_file(tensors, lm_head / "adapter_model.safetensors")
    wide = tmp_path / "wide"
    make_adapter(base, wide, ["q_proj"], r=32, alpha=32)
    cases = {
        "dora": (_copy(good, tmp_path / "dora", use_dora=True), "DoRA"),
        "modules_to_save": (_copy(good, tmp_path / "mts", modules_to_save=["lm_head"]),
                            "modules_to_save"),
        "bias": (_copy(good, tmp_path / "bias", bias="all"), "bias"),
        "rank": (wide, "above --max-lora-rank 16"),
        "corrupt": (corrupt, "truncated or corrupt"),
        "other-base": (other_base, "another base model"),
        "lm-head": (lm_head, "no adaptable linear"),
        "missing": (tmp_path / "nothing-here", "not a directory"),
        "outside": (base.parent.parent, "outside the directories"),
    }
    llm = serve(base, {"all": good}, lora_allowed_dirs=[str(tmp_path)])
    loras, worker = llm.engine.loras, llm.engine.worker
    try:
        for case, (path, why) in cases.items():
            with pytest.raises(InvalidParameter, match=why) as e:
                adapter = loras.begin(case, str(path))
                read = worker.call(lambda r, a=adapter: r.loras.add(a.lora_id, a.path))
                read.exception()
                loras.finish(adapter, read)
            assert e.value.param == "lora_path", case
            assert case not in loras.adapters
        outs = llm.generate(prompts, [SamplingParams(**GREEDY, lora_name=n)
                                      for n in ("all", None, "all")], use_tqdm=False)
        assert [o.token_ids for o in outs] == [expected["all"][0], expected[None][1],
                                               expected["all"][2]]
    finally:
        llm.shutdown()


def test_an_adapter_in_use_is_not_unloaded_until_its_requests_finish(built):
    """Unloading an adapter its requests run on is refused (AdapterInUse, a 409): they
    finish on the weights they started with; once they have, it unloads."""
    base, dirs, expected, prompts = built["llama"]
    llm = serve(base, dirs, max_loras=2)
    core = llm.engine
    try:
        core.add_request("a", prompts[1], SamplingParams(**GREEDY, lora_name="qv"))
        core.add_request("b", prompts[1], SamplingParams(**GREEDY))
        core.step()
        with pytest.raises(AdapterInUse, match="serves 1 request"):
            unload(core, "qv")
        assert "qv" in core.loras.adapters
        done = {}
        while core.has_work:
            done |= {o.request_id: o for o in core.step().outputs if o.finished}
        assert done["a"].token_ids == expected["qv"][1] and not done["a"].error
        assert done["b"].token_ids == expected[None][1]
        unload(core, "qv")
        assert "qv" not in core.loras.adapters
        core.check_invariants()
        assert core.blocks.num_used_blocks == 0
        with pytest.raises(AdapterNotFound):
            unload(core, "qv")
    finally:
        llm.shutdown()
