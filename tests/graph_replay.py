"""One step through the CUDA-graph runner and again eagerly, from the same KV caches: the
comparison the graph tests share (decode graphs, verify graphs)."""

from __future__ import annotations

import pytest
import torch


def replay_and_eager(runner, graphs, batch):
    """(replayed, eager, caches before, caches after the replay): the step replayed
    through `graphs`, then the caches put back and the same step run eagerly."""
    caches = runner.k_caches + runner.v_caches
    before = [c.clone() for c in caches]
    runner.graphs = graphs
    replayed = runner.execute(batch)
    after = [c.clone() for c in caches]
    for cache, old in zip(caches, before):
        cache.copy_(old)
    runner.graphs = None
    return replayed, runner.execute(batch), before, after


def assert_same_step(runner, replayed, eager, before, after, written) -> None:
    """Same tokens and logprobs; the replay stored only into the step's own slots
    (`written`: padding stores nothing) and left the caches as the eager step did."""
    assert replayed.token_ids == eager.token_ids
    for (lp_g, top_g), (lp_e, top_e) in zip(replayed.logprobs, eager.logprobs):
        assert lp_g == pytest.approx(lp_e, abs=1e-4)
        assert [t for t, _ in top_g] == [t for t, _ in top_e]
    for old, new, now in zip(before, after, runner.k_caches + runner.v_caches):
        changed = (old.flatten(0, 1) != new.flatten(0, 1)).flatten(1).any(1)
        assert set(changed.nonzero().flatten().tolist()) <= set(written)
        torch.testing.assert_close(new, now, atol=1e-4, rtol=1e-4)
