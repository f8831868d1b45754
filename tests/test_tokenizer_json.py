"""The tokenizer.json path (models/tokenizer_json.py, models/chat_template.py) against
transformers: the same ids, text, specials and rendered conversations, on the embedded
model's tokenizer and on templates that use what chat templates use (tools, namespaces,
loop controls, raise_exception, the generation block); and transformers wherever it would
not use tokenizer.json as it is."""

import json
import shutil
import subprocess
import sys

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.tokenizer import apply_chat_template, load_tokenizer, transformers_tokenizer
from models.tokenizer_json import TokenizerJson, read_config, why_not_as_is

TEXTS = ["", "Hello there", "a <|im_start|>b  \n\n x🦙", "  leading and trailing  ",
         "Héllo 日本語 العربية\t\r\n", "<|im_end|><|im_end|>", "def f(x):\n    return x**2\n",
         "\u200b\ufeff zero widths", "1234567890 3.14159 -0.0"]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo 🦙"}],
    [{"role": "user", "content": "weather in Paris?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c1", "type": "function",
          "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 °C"},
     {"role": "assistant", "content": "Sunny.", "reasoning_content": "It said sunny."}],
]

# A template using what Hub templates use, so that each rule of the environment shows.
FEATURES = """{{ bos_token }}{% set ns = namespace(n=0, last=none) %}
{%- if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}
{%- if documents %}{% for d in documents %}[{{ d.title }}]{% endfor %}{% endif %}
{%- for m in messages %}{% set ns.n = ns.n + 1 %}
{%- if m.role not in ['system', 'user', 'assistant', 'tool'] %}
{{- raise_exception('bad role') }}{% endif %}
<{{ m.role }}>{% if m.content is defined %}{{ m.content }}{% endif %}
{%- if m.tool_calls is defined %}{% for c in m.tool_calls %}{{ c.function | tojson(indent=2) }}
{%- if loop.index > 5 %}{% break %}{% endif %}{% endfor %}{% endif %}
{%- if m.thinking is defined %}(thought: {{ m.thinking }}){% endif %}
{%- if m.role == 'assistant' %}{% generation %}{{ eos_token }}{% endgeneration %}{% endif %}
{%- set ns.last = dict(role=m.role) %}
{% endfor %}{{ ns.n }} {{ ns.last.role }} {{ flavour | default('plain') }}
{%- if add_generation_prompt %}<assistant>{% endif %}"""


@pytest.fixture(scope="module")
def pair(smollm2_dir):
    from transformers import AutoTokenizer

    ours = load_tokenizer(smollm2_dir)
    assert isinstance(ours, TokenizerJson)
    return ours, AutoTokenizer.from_pretrained(str(smollm2_dir))


def test_the_server_start_imports_no_transformers(smollm2_dir):
    """The point of the file: the embedded model's engine comes up without transformers."""
    code = ("import sys; from app.llm import LLM; from app.engine.sampling_params import "
            "SamplingParams; "
            f"llm = LLM(model={str(smollm2_dir)!r}, dtype='float32', max_model_len=256); "
            "llm.chat([[{'role': 'user', 'content': 'Hi'}]], SamplingParams(max_tokens=2)); "
            "print(type(llm.tokenizer).__name__, 'transformers' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-2:] == ["TokenizerJson", "False"]


def test_ids_text_and_specials_equal_transformers(pair):
    ours, hf = pair
    for text in TEXTS:
        for specials in (True, False):
            assert ours.encode(text, add_special_tokens=specials) == \
                hf.encode(text, add_special_tokens=specials)
        ids = hf.encode(text) + [hf.eos_token_id]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == \
                hf.decode(ids, skip_special_tokens=skip)
    assert ours.get_vocab() == hf.get_vocab() and len(ours) == len(hf)
    assert ours.special_tokens_map == hf.special_tokens_map
    for name in ("bos", "eos", "unk", "pad", "sep", "cls", "mask"):
        assert getattr(ours, f"{name}_token") == getattr(hf, f"{name}_token")
        assert getattr(ours, f"{name}_token_id") == getattr(hf, f"{name}_token_id")
    assert set(ours.added_tokens_decoder) == set(hf.added_tokens_decoder)
    assert ours.convert_ids_to_tokens([0, 1, 2, 100]) == hf.convert_ids_to_tokens([0, 1, 2, 100])
    assert ours.chat_template == hf.chat_template
    with pytest.raises(AttributeError):
        ours.no_such_attribute  # noqa: B018
    with pytest.raises(ValueError, match="clean up"):  # never silently skipped
        ours.decode([1], clean_up_tokenization_spaces=True)


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60))
def test_any_text_encodes_and_decodes_as_transformers_does(pair, text):
    ours, hf = pair
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ours.decode(ids) == hf.decode(ids)


@pytest.mark.parametrize("template", ["own", FEATURES])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_conversations_render_as_transformers_renders_them(pair, template, conversation):
    ours, hf = pair
    kwargs = {} if template == "own" else {"chat_template": template}
    for extra in ({}, {"tools": [WEATHER]}, {"documents": [{"title": "T", "text": "x"}]},
                  {"flavour": "spicy"}):
        for gp in (True, False):
            try:
                want = hf.apply_chat_template(conversation, add_generation_prompt=gp,
                                              tokenize=False, **kwargs, **extra)
            except jinja2.exceptions.TemplateError as e:  # SmolLM2's needs a content
                with pytest.raises(type(e)):
                    ours.apply_chat_template(conversation, add_generation_prompt=gp, **kwargs,
                                             **extra)
                continue
            assert ours.apply_chat_template(conversation, add_generation_prompt=gp,
                                            tokenize=False, **kwargs, **extra) == want
            assert apply_chat_template(ours, conversation, gp, **kwargs, **extra) == \
                apply_chat_template(hf, conversation, gp, **kwargs, **extra)


def test_continue_final_message_as_transformers(pair):
    ours, hf = pair
    for last in ("Sure, ", "Sure", "It is  "):
        chat = [{"role": "user", "content": "go on"}, {"role": "assistant", "content": last}]
        for template in (None, FEATURES):
            kw = {"chat_template": template} if template else {}
            assert ours.apply_chat_template(chat, continue_final_message=True, tokenize=False,
                                            **kw) == \
                hf.apply_chat_template(chat, continue_final_message=True, tokenize=False, **kw)
    with pytest.raises(ValueError, match="not compatible"):
        ours.apply_chat_template(chat, continue_final_message=True, add_generation_prompt=True)


def test_what_templates_refuse_is_refused_by_both(pair):
    ours, hf = pair
    bad = [{"role": "narrator", "content": "x"}]
    for tok in pair:
        with pytest.raises(jinja2.exceptions.TemplateError, match="bad role"):
            tok.apply_chat_template(bad, chat_template=FEATURES)
        with pytest.raises(jinja2.exceptions.SecurityError):  # no way out of the sandbox
            tok.apply_chat_template(CONVERSATIONS[0],
                                    chat_template="{{ ''.__class__.__mro__ }}")
        with pytest.raises(jinja2.exceptions.SecurityError, match="underscore"):
            tok.apply_chat_template(CONVERSATIONS[0],
                                    chat_template="{% set ns = namespace(_x=1) %}")
        with pytest.raises(ValueError, match="empty conversation"):
            tok.apply_chat_template([])


def test_named_templates_pick_tool_use_with_tools(smollm2_dir, tmp_path):
    d = tmp_path / "named"
    shutil.copytree(smollm2_dir, d, ignore=shutil.ignore_patterns("*.safetensors", "quantized"))
    (d / "chat_template.jinja").unlink()
    config = read_config(d)
    config["chat_template"] = [{"name": "default", "template": "D{{ messages[0].content }}"},
                               {"name": "tool_use", "template": "T{{ tools | length }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(d)
    assert isinstance(tok, TokenizerJson)
    chat = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(chat, tokenize=False) == "Dx"
    assert tok.apply_chat_template(chat, tools=[WEATHER], tokenize=False) == "T1"
    assert tok.apply_chat_template(chat, chat_template="tool_use", tools=[], tokenize=False) == "T0"


@pytest.mark.parametrize("change", [
    {"tokenizer_class": "LlamaTokenizerFast"}, {"add_bos_token": True},
    {"clean_up_tokenization_spaces": True}, {"extra_special_tokens": ["<x>"]},
    {"eos_token": "<not-in-the-vocabulary>"},
    {"added_tokens_decoder": {"2": {"content": "<|other|>", "special": True}}},
])
def test_transformers_loads_what_it_would_rewrite(smollm2_dir, tmp_path, change):
    """Options with which transformers changes the Rust tokenizer or adds to it: the
    server leaves those to transformers, whose object then serves (and is xgrammar's)."""
    d = tmp_path / "changed"
    shutil.copytree(smollm2_dir, d, ignore=shutil.ignore_patterns("*.safetensors", "quantized"))
    config = read_config(d) | change
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    import tokenizers

    assert why_not_as_is(d, config, tokenizers.Tokenizer.from_file(str(d / "tokenizer.json")))
    tok = load_tokenizer(d)
    assert not isinstance(tok, TokenizerJson)
    assert transformers_tokenizer(tok) is tok


def test_xgrammar_gets_transformers_tokenizer_of_the_same_folder(pair):
    ours, hf = pair
    theirs = transformers_tokenizer(ours)
    assert type(theirs) is type(hf) and theirs.get_vocab() == ours.get_vocab()
    assert transformers_tokenizer(ours) is theirs  # loaded once
