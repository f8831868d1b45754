"""What `ridgeline bench serve` sends: prompts, their lengths, and when they arrive.

Random prompts are common English words sized by one calibration of tokens per word
against the server's own /tokenize (or a local tokenizer, or words × 1.3 where
neither is at hand). With `--random-prefix-len` every prompt starts with the same
shared prefix, as a chat system prompt does — the load that prefix caching is for.
ShareGPT prompts follow vLLM's filters. Arrivals are a gamma process.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from app.client import AsyncClient, ClientError

WORDS = ("the of and to in is was for on that with as by at from his it an were are which "
         "this be or has had first one their its new after who they have her she two been "
         "other when there all time during into school year more city some world people "
         "state most house game under water music river light story road family market "
         "number season night paper group order early power point small young").split()
TOKENS_PER_WORD = 1.3  # English text, when nothing can count tokens


@dataclass(frozen=True)
class RequestSpec:
    prompt: str
    prompt_len: int
    output_len: int
    model: str | None = None  # None: the run's --model (else a LoRA adapter's name)


class TokenCounter:
    """Token counts from a local tokenizer (`--tokenizer`), else the server's /tokenize,
    else words × 1.3."""

    def __init__(self, client: AsyncClient, model: str | None, tokenizer=None):
        self.client, self.model, self.exact = client, model, True
        self.tokenizer = tokenizer

    async def __call__(self, text: str) -> int:
        if self.tokenizer is not None:
            return len(self.tokenizer.encode(text, add_special_tokens=False))
        if self.exact:
            try:
                return len(await self.client.tokenize(text, model=self.model))
            except ClientError as e:
                self.exact = False
                print(f"no /tokenize ({e}); approximating tokens as words x {TOKENS_PER_WORD}")
        return max(1, round(len(text.split()) * TOKENS_PER_WORD))


def load_tokenizer(name: str | None, trust_remote_code: bool = False):
    """vLLM's `--tokenizer`: count tokens locally (needs transformers, the engine extra)."""
    if name is None:
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise SystemExit("--tokenizer needs transformers: pip install 'ridgeline[engine]'"
                         ) from e
    return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)


def _lengths(n: int, mean: int, ratio: float, rng: random.Random) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


async def random_requests(n: int, input_len: int, output_len: int, ratio: float, seed: int,
                          count: TokenCounter, prefix_len: int = 0) -> list[RequestSpec]:
    """Prompts of random common words, sized by one calibration of tokens per word.

    `prefix_len` tokens of one shared prefix come first (as vLLM's `--random-prefix-len`),
    then `input_len` tokens (± `ratio`) that differ per request."""
    rng = random.Random(seed)
    sample = " ".join(rng.choice(WORDS) for _ in range(256))
    per_word = await count(sample) / 256
    prefix = " ".join(rng.choice(WORDS) for _ in range(round(prefix_len / per_word))) + " " \
        if prefix_len else ""
    n_prefix = await count(prefix) if prefix else 0
    specs = []
    for i, (n_in, n_out) in enumerate(zip(_lengths(n, input_len, ratio, rng),
                                          _lengths(n, output_len, ratio, rng))):
        words = max(1, round(n_in / per_word) - 1)
        prompt = prefix + f"{i} " + " ".join(rng.choice(WORDS) for _ in range(words))
        specs.append(RequestSpec(prompt, n_prefix + n_in, n_out))
    return specs


async def prefix_repetition_requests(n: int, prefix_len: int, suffix_len: int,
                                     num_prefixes: int, output_len: int, seed: int,
                                     count: TokenCounter) -> list[RequestSpec]:
    """vLLM's `prefix_repetition` dataset: `num_prefixes` distinct prefixes (tenants'
    system prompts), each shared by an equal share of the prompts, a random suffix each,
    in shuffled order — the load that routing by cache is for."""
    rng = random.Random(seed)
    sample = " ".join(rng.choice(WORDS) for _ in range(256))
    per_word = await count(sample) / 256

    def words(tokens: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(max(1, round(tokens / per_word))))

    prefixes = [f"tenant {k}: " + words(prefix_len) for k in range(num_prefixes)]
    n_prefix = [await count(p) for p in prefixes]
    specs = [RequestSpec(prefixes[i % num_prefixes] + f" {i} " + words(suffix_len),
                         n_prefix[i % num_prefixes] + suffix_len, output_len)
             for i in range(n)]
    rng.shuffle(specs)
    return specs


async def sharegpt_requests(path: str, n: int, seed: int, count: TokenCounter,
                            output_len: int | None) -> list[RequestSpec]:
    """First human turn → prompt; the reply's length → output length (vLLM's filters)."""
    data = [d["conversations"] for d in json.loads(Path(path).read_text())
            if len(d.get("conversations") or []) >= 2]
    random.Random(seed).shuffle(data)
    specs: list[RequestSpec] = []
    for conv in data:
        if len(specs) == n:
            break
        prompt, reply = conv[0]["value"], conv[1]["value"]
        n_in = await count(prompt)
        n_out = output_len or await count(reply)
        if n_in < 4 or n_out < 4 or n_in > 1024 or n_in + n_out > 2048:
            continue
        specs.append(RequestSpec(prompt, n_in, n_out))
    if len(specs) < n:
        print(f"warning: {path} gave {len(specs)} usable conversations, not {n}")
    return specs


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int,
                 ramp: tuple[str, float, float] | None = None) -> list[float]:
    """Seconds between arrivals: gamma with mean 1/rate (Poisson at burstiness 1).

    `ramp` is vLLM's `--ramp-up-strategy` with its start and end rates: request i of n
    arrives at the rate reached at progress i / (n - 1), linearly or geometrically."""
    rng = random.Random(seed)
    gaps = []
    for i in range(n):
        r = rate
        if ramp is not None:
            strategy, start, end = ramp
            progress = i / max(n - 1, 1)
            r = (start + (end - start) * progress if strategy == "linear"
                 else start * (end / start) ** progress)
        gaps.append(0.0 if r == float("inf")
                    else rng.gammavariate(burstiness, 1.0 / (r * burstiness)))
    return gaps


def check_ramp(strategy: str | None, start: int | None, end: int | None,
               rate: float) -> tuple[str, float, float] | None:
    """vLLM's rules for the ramp-up flags; a ValueError names the flag that breaks one."""
    if strategy is None:
        if start is not None or end is not None:
            raise ValueError("--ramp-up-start-rps/--ramp-up-end-rps need --ramp-up-strategy")
        return None
    if rate != float("inf"):
        raise ValueError("--ramp-up-strategy sets the rate: drop --request-rate")
    if start is None or end is None:
        raise ValueError("--ramp-up-strategy needs --ramp-up-start-rps and --ramp-up-end-rps")
    if not 0 < start <= end:
        raise ValueError(f"--ramp-up-start-rps {start} must be positive and at most "
                         f"--ramp-up-end-rps {end}")
    return strategy, float(start), float(end)
