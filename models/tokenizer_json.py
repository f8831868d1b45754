"""A model's tokenizer.json through the `tokenizers` library, without transformers.

`import transformers` is a large share of the server's start-up (it scans its ~560 model
folders for their exports and imports huggingface_hub); the tokenizer it then builds is,
for the generic classes (`TokenizersBackend`, `PreTrainedTokenizerFast`), the
tokenizer.json unchanged: the same Rust object, with the special tokens and the chat
template of tokenizer_config.json beside it. `why_not_as_is` says when it is not:
there (a model's own tokenizer class, a slow tokenizer, options with which transformers
rewrites the Rust tokenizer) `models/tokenizer.py` lets transformers load it.

The class answers what the engine and the server ask a tokenizer (`encode`, `decode`,
`get_vocab`, the special tokens, `apply_chat_template`, `backend_tokenizer`), with
transformers' defaults. `hf()` loads transformers' own object for the same folder, for
the one caller that needs that type (xgrammar, which imports transformers itself).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers

from models.chat_template import render_chat, select_template

GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                 "cls_token", "mask_token")
# tokenizer_config.json keys with which transformers changes the Rust tokenizer (its
# post-processor, its splitting of special tokens, its decoding) or adds tokens to it.
REWRITING_KEYS = ("add_bos_token", "add_eos_token", "split_special_tokens",
                  "clean_up_tokenization_spaces", "additional_special_tokens",
                  "extra_special_tokens", "post_processor", "tokenizer_truncation",
                  "tokenizer_padding", "fix_mistral_regex")
# Above this vocabulary transformers may patch a Mistral pre-tokenizer's regex.
MAX_PLAIN_VOCAB = 100_000


def _text(token: Any) -> str | None:
    """A special token as configs write it: a string or a serialised AddedToken."""
    return token.get("content") if isinstance(token, Mapping) else token


def read_config(model_dir: Path) -> dict[str, Any] | None:
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def why_not_as_is(model_dir: Path, config: dict[str, Any] | None,
         backend: tokenizers.Tokenizer | None = None) -> str | None:
    """Why transformers would not use `model_dir`'s tokenizer.json as it is (None: it
    would). `backend` is the loaded tokenizer.json, for the checks that need it."""
    if config is None:
        return "no tokenizer_config.json"
    if config.get("tokenizer_class") not in GENERIC_CLASSES:
        return f"tokenizer class {config.get('tokenizer_class')!r}"
    if not (model_dir / "tokenizer.json").is_file():
        return "no tokenizer.json"
    if rewriting := [k for k in REWRITING_KEYS if config.get(k)]:
        return f"tokenizer_config.json sets {rewriting}"
    if extra := [name for name in ("special_tokens_map.json", "chat_template.json",
                                   "additional_chat_templates") if (model_dir / name).exists()]:
        return f"older or further files: {extra}"
    if backend is None:
        return None
    if backend.truncation or backend.padding or backend.post_processor is None:
        return "tokenizer.json truncates, pads or has no post-processor"
    if backend.get_vocab_size(with_added_tokens=True) > MAX_PLAIN_VOCAB:
        return f"a vocabulary above {MAX_PLAIN_VOCAB}"
    added = backend.get_added_tokens_decoder()
    for i, token in (config.get("added_tokens_decoder") or {}).items():
        have = added.get(int(i))
        if have is None or have.content != _text(token) or (
                isinstance(token, Mapping) and token.get("special", have.special) != have.special):
            return f"added token {i} differs from tokenizer.json's"
    named = [_text(config.get(name)) for name in SPECIAL_NAMES]
    if any(t is not None and backend.token_to_id(t) is None for t in named):
        return "a special token that tokenizer.json lacks"
    return None


class TokenizerJson:
    """tokenizer.json and tokenizer_config.json, as transformers' generic class has them."""

    def __init__(self, model_dir: Path, config: dict[str, Any], backend: tokenizers.Tokenizer):
        self.model_dir = model_dir
        self.backend_tokenizer = backend
        self.tokenizer_class = config["tokenizer_class"]
        self.init_kwargs = {k: v for k, v in config.items() if k != "added_tokens_decoder"}
        self.special_tokens_map = {name: _text(config[name]) for name in SPECIAL_NAMES
                                   if _text(config.get(name)) is not None}
        self.chat_template: str | dict[str, str] | None = _own_template(model_dir, config)
        self.added_tokens_decoder = {i: t.content for i, t in
                                     backend.get_added_tokens_decoder().items()}

    @classmethod
    def load(cls, model_dir: Path) -> TokenizerJson | None:
        """The tokenizer, or None where transformers would not use tokenizer.json as is."""
        config = read_config(model_dir)
        if why_not_as_is(model_dir, config) is not None:
            return None
        backend = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        if why_not_as_is(model_dir, config, backend) is not None:
            return None
        return cls(model_dir, config, backend)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __getattr__(self, name: str) -> Any:
        """`eos_token`, `bos_token_id`, ...: None where the config names none."""
        base = name.removesuffix("_id")
        if base not in SPECIAL_NAMES:
            raise AttributeError(name)
        token = self.special_tokens_map.get(base)
        if name == base or token is None:
            return token
        return self.backend_tokenizer.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        if clean_up_tokenization_spaces:  # those that clean up are transformers' to load
            raise ValueError("this tokenizer does not clean up tokenization spaces")
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]],
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            documents: Sequence[Mapping[str, Any]] | None = None,
                            chat_template: str | None = None,
                            add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True,
                            **variables: Any) -> list[int] | str:
        """transformers' `apply_chat_template` for one conversation: the token ids of the
        rendered text (no special tokens added around it), or the text."""
        text = render_chat(select_template(self.chat_template, chat_template, tools),
                           conversation, tools=tools, documents=documents,
                           add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message,
                           **{**self.special_tokens_map, **variables})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @cached_property
    def _hf(self):
        import transformers

        return getattr(transformers, self.tokenizer_class).from_pretrained(str(self.model_dir))

    def hf(self):
        """transformers' tokenizer for the same folder (imports transformers: seconds)."""
        self._hf.chat_template = self.chat_template
        return self._hf


def _own_template(model_dir: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """The template transformers reads: chat_template.jinja beside the config, else the
    config's own; a list of named templates becomes a dict, as transformers makes it."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template}
    return template
