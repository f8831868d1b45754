"""Loading models as users bring them: hub configs of each architecture, what is refused
and why, generation_config.json, chat templates, and GGUF files of Qwen2 (cached in the
dtype served)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from app import LLM, SamplingParams
from app.cli import build_parser, engine_config_from_args
from models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from models.decoder import DecoderForCausalLM
from models.generation_config import load_generation_defaults, parse_generation_config
from models.tokenizer import apply_chat_template, load_tokenizer

# config.json of real checkpoints, as the hub serves them (transformers 4 keys), trimmed.
QWEN25_05B = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896,
              "intermediate_size": 4864, "max_position_embeddings": 32768,
              "max_window_layers": 21, "num_attention_heads": 14, "num_hidden_layers": 24,
              "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
              "sliding_window": 32768, "tie_word_embeddings": True, "use_sliding_window": False,
              "vocab_size": 151936, "eos_token_id": 151645, "hidden_act": "silu"}
QWEN3_06B = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "head_dim": 128,
             "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
             "max_window_layers": 28, "num_attention_heads": 16, "num_hidden_layers": 28,
             "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
             "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
             "use_sliding_window": False, "vocab_size": 151936}
MISTRAL_7B_V01 = {"architectures": ["MistralForCausalLM"], "hidden_size": 4096,
                  "intermediate_size": 14336, "max_position_embeddings": 32768,
                  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                  "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
                  "tie_word_embeddings": False, "vocab_size": 32000}
PHI3_MINI_4K = {"architectures": ["Phi3ForCausalLM"], "hidden_size": 3072,
                "intermediate_size": 8192, "max_position_embeddings": 4096,
                "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
                "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
                "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047,
                "tie_word_embeddings": False, "vocab_size": 32064, "eos_token_id": 32000}
PHI3_MINI_128K = PHI3_MINI_4K | {
    "max_position_embeddings": 131072, "sliding_window": 262144,
    "rope_scaling": {"type": "su", "long_factor": [1.5] * 48, "short_factor": [1.0] * 48}}
PHI4_MINI = PHI3_MINI_128K | {"hidden_size": 3072, "num_attention_heads": 24,
                              "num_key_value_heads": 8, "partial_rotary_factor": 0.75,
                              "tie_word_embeddings": True, "sliding_window": 262144,
                              "rope_scaling": {"type": "longrope", "long_factor": [1.5] * 48,
                                               "short_factor": [1.0] * 48}}


def test_hub_configs_of_each_architecture():
    qwen25 = ModelConfig.from_hf_dict(QWEN25_05B)
    assert qwen25.attention_bias and not qwen25.o_proj_bias and qwen25.tie_word_embeddings
    assert set(qwen25.sliding_windows) == {None}  # use_sliding_window is false
    assert qwen25.max_context_len == 32768

    qwen3 = ModelConfig.from_hf_dict(QWEN3_06B)
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.head_dim == 128
    assert qwen3.head_dim * qwen3.num_heads != qwen3.hidden_size

    mistral = ModelConfig.from_hf_dict(MISTRAL_7B_V01)
    assert mistral.uniform_window == 4096 and mistral.head_dim == 128

    phi3 = ModelConfig.from_hf_dict(PHI3_MINI_4K)
    assert phi3.uniform_window == 2047 and phi3.max_context_len == 4096

    phi3_long = ModelConfig.from_hf_dict(PHI3_MINI_128K)
    scaling = phi3_long.rope_scaling_dict
    assert scaling["rope_type"] == "longrope"  # "su" is its old name
    assert scaling["original_max_position_embeddings"] == 4096
    assert phi3_long.max_context_len == 4096 and "long factors" in phi3_long.context_note

    phi4 = ModelConfig.from_hf_dict(PHI4_MINI)
    assert phi4.rotary_dim == 96 and phi4.tie_word_embeddings


def test_qwen_sliding_layers_follow_max_window_layers_or_layer_types():
    cfg = QWEN25_05B | {"num_hidden_layers": 4, "use_sliding_window": True,
                        "sliding_window": 512, "max_window_layers": 2}
    assert ModelConfig.from_hf_dict(cfg).sliding_windows == (None, None, 512, 512)
    types = ["sliding_attention", "full_attention"] * 2
    cfg |= {"layer_types": types}
    assert ModelConfig.from_hf_dict(cfg).sliding_windows == (512, None, 512, None)


def test_a_window_as_long_as_the_context_is_dropped():
    cfg = ModelConfig.from_hf_dict(PHI3_MINI_128K | dict(
        hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
        num_hidden_layers=1, vocab_size=16, rope_scaling={
            "type": "su", "long_factor": [1.5] * 8, "short_factor": [1.0] * 8}))
    with torch.device("meta"):
        model = DecoderForCausalLM(cfg, max_positions=4096)
    assert model.layers[0].self_attn.sliding_window is None  # 262144 > 4096: no mask work


@pytest.mark.parametrize(("change", "match"), [
    ({"architectures": ["GemmaForCausalLM"]}, "Qwen2ForCausalLM, Qwen3ForCausalLM"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic' changes"),
    ({"hidden_act": "gelu"}, "SwiGLU"),
])
def test_what_is_refused_says_why(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(QWEN25_05B | change)
    assert len(SUPPORTED_ARCHITECTURES) == 5


def test_unknown_architecture_fails_at_start_naming_the_supported_ones(tiny_dir, tmp_path):
    model = shutil.copytree(tiny_dir, tmp_path / "gemma")
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | {"architectures": ["GemmaForCausalLM"]}))
    with pytest.raises(ValueError, match="GemmaForCausalLM.*LlamaForCausalLM, Mistral"):
        LLM(str(model), dtype="float32")


def test_longrope_past_its_original_length_is_refused(tiny_dir, tmp_path):
    model = shutil.copytree(tiny_dir, tmp_path / "phi3")
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | {
        "architectures": ["Phi3ForCausalLM"], "max_position_embeddings": 1024,
        "original_max_position_embeddings": 256,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8,
                         "long_factor": [2.0] * 8}}))
    with pytest.raises(ValueError, match="original_max_position_embeddings=256"):
        LLM(str(model), dtype="float32", max_model_len=512)


# -- generation_config.json ------------------------------------------------------------

QWEN_GENERATION = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                   "pad_token_id": 151643, "repetition_penalty": 1.05, "temperature": 0.7,
                   "top_k": 20, "top_p": 0.8}


def test_generation_config_defaults_and_a_requests_own_values_win():
    defaults = parse_generation_config(QWEN_GENERATION)
    assert dict(defaults.sampling) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                       "repetition_penalty": 1.05}
    assert defaults.eos_token_ids == (151645, 151643)
    applied = defaults.apply({"temperature": 0.0, "max_tokens": 5, "top_p": None})
    assert applied == {"temperature": 0.0, "top_p": 0.8, "top_k": 20,
                       "repetition_penalty": 1.05, "max_tokens": 5}
    SamplingParams(**applied)  # every key is a SamplingParams field
    assert parse_generation_config({"max_new_tokens": 64, "top_k": 0}).sampling == {
        "max_tokens": 64}


def test_generation_config_eos_ids_stop_generation(tiny_dir, tmp_path):
    model = shutil.copytree(tiny_dir, tmp_path / "gen")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_generation_defaults(model).eos_token_ids == (2, 7)
    llm = LLM(str(model), dtype="float32", max_model_len=64)
    try:
        assert 7 in llm.engine.eos_token_ids and 2 in llm.engine.eos_token_ids
    finally:
        llm.shutdown()


# -- chat templates ---------------------------------------------------------------------

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def test_chat_template_override_inline_or_from_a_file(smollm2_dir, tmp_path):
    chat = [{"role": "user", "content": "hi"}]
    own = load_tokenizer(smollm2_dir)
    inline = load_tokenizer(smollm2_dir, TEMPLATE)
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    from_file = load_tokenizer(smollm2_dir, str(tmp_path / "t.jinja"))
    expected = inline.encode("<user>hi", add_special_tokens=False)
    assert apply_chat_template(inline, chat) == expected
    assert apply_chat_template(from_file, chat) == expected
    assert apply_chat_template(own, chat) != expected
    with pytest.raises(FileNotFoundError, match="neither a file"):
        load_tokenizer(smollm2_dir, str(tmp_path / "missing.jinja"))
    own.chat_template = None
    with pytest.raises(ValueError, match="--chat-template"):
        apply_chat_template(own, chat)


def test_tokenizer_by_its_named_class_equals_autotokenizer(smollm2_dir, tmp_path):
    """Where transformers loads the tokenizer, the server loads the class
    tokenizer_config.json names (AutoTokenizer would first import the modeling stack):
    the same tokenizer, ids, specials and template; without a tokenizer.json (a slow
    tokenizer), or naming an unknown class, AutoTokenizer."""
    from transformers import AutoTokenizer

    from models.tokenizer import _named_class

    ours = _named_class(smollm2_dir).from_pretrained(str(smollm2_dir))
    auto = AutoTokenizer.from_pretrained(str(smollm2_dir))
    chat = [{"role": "user", "content": "Héllo <|im_end|> 日本 🦙"}]
    assert type(ours) is type(auto) and len(ours) == len(auto)
    assert apply_chat_template(ours, chat) == apply_chat_template(auto, chat)
    assert ours("a <|im_start|>b").input_ids == auto("a <|im_start|>b").input_ids
    assert (ours.eos_token_id, ours.bos_token_id) == (auto.eos_token_id, auto.bos_token_id)
    for name, config in (("slow", {"tokenizer_class": "LlamaTokenizer"}),
                         ("unknown", {"tokenizer_class": "NoSuchTokenizer"})):
        d = tmp_path / name
        d.mkdir()
        (d / "tokenizer_config.json").write_text(json.dumps(config))
        if name == "unknown":
            shutil.copy(smollm2_dir / "tokenizer.json", d / "tokenizer.json")
        assert _named_class(d) is None


def test_chat_template_flag_reaches_the_engine_config():
    a = build_parser().parse_args(["serve", "--chat-template", "t.jinja"])
    assert engine_config_from_args(a).chat_template == "t.jinja"


# -- GGUF: Qwen2 and Qwen3, dtype-aware cache, refusals --------------------------------


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory):
    """One conversion cache for the module: each GGUF is converted once per dtype."""
    from models.resolve import CACHE_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("gguf-cache")))
        yield


def test_qwen2_gguf_converts_exactly_and_caches_in_the_served_dtype(tiny_ggufs, gguf_cache):
    from models.resolve import resolve_model

    gguf, original = tiny_ggufs["qwen2"]
    fp32, bf16 = resolve_model(gguf), resolve_model(gguf, dtype="bfloat16")
    assert fp32 != bf16 and resolve_model(gguf) == fp32
    assert_same_tensors(fp32, original, torch.float32)
    assert_same_tensors(bf16, original, torch.bfloat16)
    cfg = ModelConfig.from_dir(fp32)
    assert cfg.architecture == "Qwen2ForCausalLM" and cfg.attention_bias
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.tie_word_embeddings) == (1e6, 1e-6, True)


def test_qwen3_gguf_converts_exactly(tiny_ggufs, gguf_cache):
    from models.resolve import resolve_model

    gguf, original = tiny_ggufs["qwen3"]
    converted = resolve_model(gguf)
    assert_same_tensors(converted, original, torch.float32)
    cfg = ModelConfig.from_dir(converted)
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm and cfg.head_dim == 32


def assert_same_tensors(converted: Path, original: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import load_file

    got = load_file(str(converted / "model.safetensors"))
    expected = load_file(str(original / "model.safetensors"))
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k].to(dtype)) for k in got)
    config = json.loads((converted / "config.json").read_text())
    assert config["torch_dtype"] == str(dtype).removeprefix("torch.")


def test_qwen2_gguf_serves_what_transformers_computes(tiny_ggufs, gguf_cache):
    """transformers' own GGUF loader is the independent reader of the same file."""
    from tests.hf_reference import gguf_greedy_both

    gguf, _ = tiny_ggufs["qwen2"]
    ours, theirs = gguf_greedy_both(gguf, [[5, 600, 7000, 42, 9], [17] * 3], 12, 64)
    assert ours == theirs


def test_gguf_of_an_unconvertible_architecture_is_refused(tmp_path):
    from gguf import GGUFWriter

    from models.gguf_convert import convert_gguf_to_hf_dir

    path = tmp_path / "phi3.gguf"
    writer = GGUFWriter(str(path), "phi3")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'phi3' cannot be converted; supported: llama, qwen2"):
        convert_gguf_to_hf_dir(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# llama.cpp's names for HF's per-layer modules (gguf-py's tensor map).
GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, _, i, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{GGUF_LAYER_NAMES[module]}.{kind}"


def write_gguf(path: Path, arch: str, cfg, tensors: dict[str, torch.Tensor]) -> Path:
    """Write `tensors` (float32) as llama.cpp writes a Qwen: no Q/K permutation (NeoX
    rotation is HF's rotate-half), with the SmolLM2 GGUF's tokenizer metadata."""
    from gguf import GGUFReader, GGUFWriter

    from models.resolve import default_gguf_path

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    for key, field in GGUFReader(default_gguf_path()).fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub)
    for name, tensor in tensors.items():
        writer.add_tensor(gguf_name(name), tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory, smollm2_dir) -> dict[str, tuple[Path, Path]]:
    """arch -> (GGUF file, the HF directory it was written from)."""
    from safetensors.torch import load_file
    from transformers import Qwen2Config, Qwen3Config

    from models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("ggufs")
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  initializer_range=0.2, max_position_embeddings=256, rms_norm_eps=1e-6,
                  rope_theta=1e6, bos_token_id=1, eos_token_id=2)
    configs = {"qwen2": Qwen2Config(**common, head_dim=16, tie_word_embeddings=True),
               "qwen3": Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)}
    out = {}
    for arch, cfg in configs.items():
        original = make_tiny_hf_model(root / arch, smollm2_dir, cfg)
        tensors = load_file(str(original / "model.safetensors"))
        out[arch] = (write_gguf(root / f"tiny-{arch}.gguf", arch, cfg, tensors), original)
    return out
