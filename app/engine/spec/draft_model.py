"""The draft-model proposer (vLLM's `draft_model`): a smaller model sharing the
target's vocabulary guesses each request's next tokens greedily.

The guesses are computed on the model thread (`gpu/draft.py`) between steps: the
proposer posts one job for every drafting request and waits for it, so the event loop
waits as long as the draft model runs (a few small forwards per drafting request; a
request drafts only while fewer than `disable_by_batch_size` run). The draft model
reads the last `draft_window` tokens of each request, and keeps nothing between steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from app.engine.request import Request
from app.engine.spec.config import SpeculativeConfig
from gpu.draft import DraftJob
from models.config import ModelConfig
from models.resolve import resolve_model


class DraftRunner(Protocol):
    def draft(self, job: DraftJob): ...  # a Future of the drafts (gpu/worker.py)


class DraftModelProposer:
    def __init__(self, runner: DraftRunner, window: int):
        self.runner, self.window = runner, window

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]
                ) -> list[list[int]]:
        windows, starts = [], []
        for req in requests:
            n, w = req.num_tokens, self.window
            windows.append(req.tokens_slice(max(0, n - w), n))
            starts.append(max(0, n - w))
        return self.runner.draft(DraftJob(windows, starts, list(num_tokens))).result()

    def finish(self, request: Request) -> None:
        pass  # nothing is kept between steps


def draft_model_dir(spec: SpeculativeConfig | None, target_vocab: int, dtype: str
                    ) -> str | None:
    """The draft model's directory (None: no draft model), refused unless its
    vocabulary is the target's: the ids it proposes are read as the target's ids."""
    if spec is None or spec.method != "draft_model":
        return None
    path = resolve_model(spec.model, dtype)
    vocab = ModelConfig.from_dir(path).vocab_size
    if vocab != target_vocab:
        raise ValueError(f"--speculative-config: the draft model {spec.model} has a "
                         f"vocabulary of {vocab} tokens, the target {target_vocab}: a "
                         f"draft model must share the target's tokenizer")
    return str(path)
