"""The model's tokenizer and chat template, as transformers loads them from an HF directory.

Where transformers would use the folder's tokenizer.json unchanged (its generic class,
as our GGUF export writes it), `models/tokenizer_json.py` loads it without importing
transformers (1.3-1.8 s of start-up); anywhere else transformers loads it. The
template is the tokenizer's own (`chat_template` in tokenizer_config.json or a
`chat_template.jinja` file beside it) unless `--chat-template` names a file or gives
the template inline, as vLLM's flag does. The server needs plain token ids;
transformers 5 returns a BatchEncoding from `apply_chat_template(tokenize=True)`
where 4.x returned a list, so this file is the one place that difference is absorbed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models.chat_template import select_template
from models.tokenizer_json import TokenizerJson

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    Tokenizer = PreTrainedTokenizerBase | TokenizerJson


def load_tokenizer(model_dir: str | os.PathLike[str],
                   chat_template: str | None = None) -> Tokenizer:
    """The fast (Rust) tokenizer saved in `model_dir`, with `chat_template` (a file's path
    or the Jinja text itself) replacing the tokenizer's own when given."""
    tokenizer = TokenizerJson.load(Path(model_dir))
    if tokenizer is None:
        cls = _named_class(Path(model_dir))
        if cls is None:  # imported only here: ~0.5 s of every start otherwise
            from transformers import AutoTokenizer as cls
        tokenizer = cls.from_pretrained(str(model_dir))
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


class NoTokenizer:
    """The stand-in for vLLM's `--skip-tokenizer-init`: a model directory served without
    a tokenizer. It turns no text into ids and no ids into text (`decode` is "", so
    outputs carry their token ids with empty text); the input processor refuses the
    routes that need text with a 400 naming the flag."""

    eos_token_id = bos_token_id = pad_token_id = chat_template = None

    def get_vocab(self) -> dict[str, int]:
        return {}

    def decode(self, token_ids: Sequence[int], **kwargs: Any) -> str:
        return ""

    def convert_ids_to_tokens(self, ids: Any) -> Any:
        return "" if isinstance(ids, int) else ["" for _ in ids]


def transformers_tokenizer(tokenizer: Tokenizer) -> PreTrainedTokenizerBase:
    """transformers' own object, for libraries that take nothing else (xgrammar)."""
    return tokenizer.hf() if isinstance(tokenizer, TokenizerJson) else tokenizer


def _named_class(model_dir: Path) -> type[PreTrainedTokenizerBase] | None:
    """The tokenizer class that tokenizer_config.json names, when transformers has it.

    AutoTokenizer would load the same class, but it first resolves the model's config,
    and in transformers 5 that imports the modeling stack (torch.distributed among it):
    1.5-3.5 s of a server's start, against 0.2 s for the class itself."""
    import transformers
    from transformers import PreTrainedTokenizerBase

    try:
        name = json.loads((model_dir / "tokenizer_config.json").read_text())["tokenizer_class"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (model_dir / "tokenizer.json").is_file() or not isinstance(name, str):
        return None  # a slow (sentencepiece) tokenizer: let AutoTokenizer convert it
    for candidate in (name if name.endswith("Fast") else name + "Fast", name):
        try:
            cls = getattr(transformers, candidate)
        except (AttributeError, ImportError):
            continue
        if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase):
            return cls
    return None


def read_chat_template(value: str) -> str:
    """A template given by path (`.jinja` or any file) or inline, as vLLM accepts it."""
    if "{" not in value:  # Jinja always has braces; a path has none
        path = Path(value).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--chat-template {value!r} is neither a file nor a "
                                    "Jinja template")
        return path.read_text()
    return value


def apply_chat_template(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> list[int]:
    """Render `messages` with the model's chat template and return the token ids, in
    this thread (the offline `LLM`; the server renders in `app/engine/renderer.py`'s
    processes from `chat_render_job`, then calls `encode_rendered`).

    Extra keyword arguments (tools, documents, ...) go to the template unchanged.
    """
    if not tokenizer.chat_template and "chat_template" not in template_kwargs:
        raise ValueError("this model's tokenizer has no chat template; start the server "
                         "with --chat-template FILE")
    out = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=add_generation_prompt, tokenize=True,
        **template_kwargs,
    )
    if isinstance(out, Mapping):  # BatchEncoding (transformers >= 5) or a plain dict
        out = out["input_ids"]
    if hasattr(out, "tolist"):  # a tensor or array, if return_tensors was passed
        out = out.tolist()
    if out and isinstance(out[0], list):  # a batch of one
        out = out[0]
    return [int(i) for i in out]


def chat_render_job(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    *,
    chat_template: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    continue_final_message: bool = False,
    **variables: Any,
) -> dict[str, Any]:
    """What `models/chat_template.py`'s `render_chat` needs to render this conversation
    as `apply_chat_template` would, as plain JSON for a worker process: the template
    chosen as transformers chooses it, and the special tokens beside the variables
    (a variable of the same name wins, as in transformers)."""
    template = select_template(tokenizer.chat_template, chat_template, tools)
    return {"template": template, "messages": list(messages), "tools": tools,
            "documents": documents, "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "variables": {**_special_tokens(tokenizer), **variables}}


def encode_rendered(tokenizer: Tokenizer, text: str) -> list[int]:
    """The ids of a rendered conversation: its text holds its special tokens already."""
    rust = getattr(tokenizer, "backend_tokenizer", None)
    if rust is None:
        return tokenizer.encode(text, add_special_tokens=False)
    (encoding,) = rust.encode_batch([text], add_special_tokens=False)
    return encoding.ids


def _special_tokens(tokenizer: Tokenizer) -> dict[str, Any]:
    """The special tokens as templates read them (`bos_token`, ...): plain text."""
    out = {}
    for name, token in getattr(tokenizer, "special_tokens_map", {}).items():
        if isinstance(token, list):
            out[name] = [str(t) for t in token]
        elif token is not None:
            out[name] = str(token)
    return out


class FastDecoder:
    """`decode` straight on the Rust tokenizer, for the per-token streaming path.

    transformers' `decode` wraps the same call in ~12 µs of Python argument
    normalisation, twice the cost of the decode itself; with hundreds of streams
    that is most of the event loop's per-token work. Clean-up of spaces is never
    applied (streaming must not rewrite text already sent), so the result equals
    `tokenizer.decode(ids, clean_up_tokenization_spaces=False)`.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._slow = tokenizer
        self._rust = getattr(tokenizer, "backend_tokenizer", None)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True,
               clean_up_tokenization_spaces: bool | None = False) -> str:
        if self._rust is None or clean_up_tokenization_spaces:
            return self._slow.decode(token_ids, skip_special_tokens=skip_special_tokens,
                                     clean_up_tokenization_spaces=clean_up_tokenization_spaces)
        return self._rust.decode(token_ids, skip_special_tokens=skip_special_tokens)
