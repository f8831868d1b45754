"""The suffix tree and the suffix proposer without a model: counts and drafts against a
brute-force count of the sequences, removal as if never added, the global tree's bound
and FIFO eviction, trees dropped when a request ends, the cost of a step on a long
history, and (where `arctic_inference` is importable) the drafts of Arctic Inference's
own `SuffixTree`, which vLLM's `suffix` method runs."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from app.engine.request import Request
from app.engine.sampling_params import SamplingParams
from app.engine.spec.suffix import SuffixProposer
from app.engine.spec.suffix_tree import SuffixTree

ROOT = Path(__file__).resolve().parent.parent


def children(seqs, s):
    """Brute force: how often each token follows the string `s`, and how often s occurs."""
    n, kids = 0, {}
    for q in seqs:
        for i in range(len(q) - len(s) + 1):
            if q[i:i + len(s)] == s:
                n += 1
                if i + len(s) < len(q):
                    kids[q[i + len(s)]] = kids.get(q[i + len(s)], 0) + 1
    return n, kids


def greedy_score(seqs, ctx, m, tokens, depth, min_prob):
    """The score of `tokens` after ctx[-m:] if each is a most frequent continuation
    whose probability holds; None otherwise."""
    s, prob, score = list(ctx[-m:]), 1.0, 0.0
    for t in tokens:
        n, kids = children(seqs, s)
        if len(s) >= depth or kids.get(t) != max(kids.values(), default=None):
            return None
        prob *= kids[t] / n
        if prob < min_prob - 1e-6:
            return None
        score, s = score + prob, s + [t]
    return score


def repetitive(rng, vocab, length):
    base = [rng.randrange(vocab) for _ in range(rng.randint(2, 20))]
    seq = []
    while len(seq) < length:
        seq += base[:rng.randint(1, len(base))] if rng.random() < 0.6 else [rng.randrange(vocab)]
    return seq[:length]


def random_trees(seed, trials=60):
    """(tree, the sequences it holds, depth) after interleaved appends and removals."""
    rng = random.Random(seed)
    for _ in range(trials):
        depth = rng.choice([3, 5, 8, 24])
        vocab = rng.choice([2, 3, 5, 20])
        full = {k: repetitive(rng, vocab, rng.randint(1, 100)) for k in range(rng.randint(1, 4))}
        tree, pos = SuffixTree(depth), {k: 0 for k in full}
        while any(pos[k] < len(full[k]) for k in full):
            k = rng.choice([k for k in full if pos[k] < len(full[k])])
            chunk = full[k][pos[k]:pos[k] + rng.randint(1, 5)]
            tree.extend(k, chunk)
            pos[k] += len(chunk)
            if rng.random() < 0.05 and len(pos) > 1:
                gone = rng.choice([k for k in pos if pos[k]])
                tree.remove(gone)
                del full[gone], pos[gone]
        yield tree, [full[k][:pos[k]] for k in full], depth, rng


def test_drafts_follow_the_most_frequent_continuation():
    checked = 0
    for tree, seqs, depth, rng in random_trees(0):
        assert tree.root.count == sum(map(len, seqs))
        for _ in range(10):
            q = rng.choice(seqs)
            ctx = q[:rng.randint(1, len(q))][-depth:]
            k, factor, min_prob = rng.randint(1, 8), rng.choice([0.5, 1.0, 2.0]), 0.1
            tokens, score, m = tree.speculate(ctx, k, factor, min_prob)
            assert len(tokens) <= min(k, int(m * factor + 1e-6)) and m + len(tokens) <= depth
            if m:
                assert children(seqs, ctx[-m:])[0] > 0  # the match is real
                assert greedy_score(seqs, ctx, m, tokens, depth, min_prob) == \
                    pytest.approx(score)
                checked += 1
    assert checked > 300


def dump(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    """count(s) for every string the tree holds (tails expanded)."""
    out = {}

    def walk(node, path):
        for tok, child in node.children.items():
            if child.__class__.__name__ == "Tail":
                s = path + (tok,)
                j = child.start + 1
                out[s] = 1
                while len(s) < tree.max_depth and j < len(child.seq):
                    s += (child.seq[j],)
                    out[s] = 1
                    j += 1
            else:
                out[path + (tok,)] = child.count
                walk(child, path + (tok,))
    walk(tree.root, ())
    return out


def test_removal_leaves_the_tree_of_the_others():
    rng = random.Random(1)
    for _ in range(30):
        seqs = {k: repetitive(rng, 4, rng.randint(5, 80)) for k in range(4)}
        tree = SuffixTree(6)
        for k, q in seqs.items():
            tree.extend(k, q)
        tree.remove(1)
        tree.remove(3)
        fresh = SuffixTree(6)
        fresh.extend(0, seqs[0])
        fresh.extend(2, seqs[2])
        assert dump(tree) == dump(fresh)
        assert tree.root.count == fresh.root.count


def request(rid: str, prompt: list[int], outputs=(), salt: str | None = None) -> Request:
    req = Request(request_id=rid, prompt_token_ids=list(prompt),
                  params=SamplingParams(max_tokens=4096, cache_salt=salt))
    req.output_token_ids.extend(outputs)
    return req


def test_global_tree_is_capped_and_evicts_the_oldest_first():
    rng = random.Random(2)
    proposer = SuffixProposer(8, 3, 1.0, 0.1)
    sizes = []
    for i in range(12):
        req = request(f"r{i}", [rng.randrange(50) for _ in range(20)])
        proposer.propose([req], [4])
        req.output_token_ids.extend(rng.randrange(50) for _ in range(40))
        proposer.finish(req)
        kept = [f"r{j}" for j in range(max(0, i - 2), i + 1)]
        assert list(proposer.global_trees[None].seqs) == kept
        assert proposer.requests == {}  # each request's own tree went with it
        sizes.append(proposer.global_trees[None].num_tokens())
    assert max(sizes) == 3 * 40
    fresh = SuffixTree(8)
    for rid, seq in proposer.global_trees[None].seqs.items():
        fresh.extend(rid, seq)
    assert dump(proposer.global_trees[None]) == dump(fresh)  # evicted outputs left nothing behind


def test_a_repeated_answer_is_drafted_from_its_first_token():
    proposer = SuffixProposer(24, 100, 1.0, 0.1)
    answer = list(range(100, 140))
    first = request("a", [1, 2, 3])
    proposer.propose([first], [5])
    first.output_token_ids.extend(answer)
    proposer.finish(first)
    again = request("b", [7, 8, 9], answer[:1])  # its first token only
    # One token matched: a draft of one (max_spec_factor x match); four, four.
    assert proposer.propose([again], [5]) == [answer[1:2]]
    again.output_token_ids.extend(answer[1:4])
    assert proposer.propose([again], [5]) == [answer[4:8]]


def test_one_tenants_answers_never_draft_for_another():
    """Tenants (the cache salt, which the server prefixes with the API key's digest)
    each have a tree of their own: B asking what A asked drafts nothing from A's answer,
    A asking again does; the cap counts every tenant's requests, and a tenant's tree
    goes when its last request is evicted."""
    proposer = SuffixProposer(24, 3, 1.0, 0.1)
    answer = list(range(100, 140))
    first = request("a1", [1, 2, 3], salt="tenant-a")
    proposer.propose([first], [5])
    first.output_token_ids.extend(answer)
    proposer.finish(first)
    other = request("b1", [1, 2, 3], answer[:2], salt="tenant-b")
    assert proposer.propose([other], [5]) == [[]]
    same = request("a2", [1, 2, 3], answer[:2], salt="tenant-a")
    assert proposer.propose([same], [5]) == [answer[2:4]]
    for req in (other, same):
        proposer.finish(req)
    assert set(proposer.global_trees) == {"tenant-a", "tenant-b"}
    for rid in ("c1", "c2"):  # two more past the cap of 3: a1, then b1, evicted
        third = request(rid, [5], salt="tenant-c")
        proposer.propose([third], [5])
        proposer.finish(third)
    assert set(proposer.global_trees) == {"tenant-a", "tenant-c"}  # b's only one went
    assert list(proposer.global_trees["tenant-a"].seqs) == ["a2"]


def test_a_step_on_a_4k_token_history_costs_well_under_a_millisecond():
    from models.resolve import resolve_model
    from models.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(None))
    text = "\n".join(p.read_text() for p in sorted((ROOT / "app/engine").glob("*.py")))
    ids = tok.encode(text)[:4096]
    proposer = SuffixProposer(24, 10000, 1.0, 0.1)
    req = request("r", ids[:2048])
    proposer.propose([req], [5])
    times = []
    for t in ids[2048:]:
        req.output_token_ids.append(t)
        t0 = time.perf_counter()
        proposer.propose([req], [5])
        times.append(time.perf_counter() - t0)
    times.sort()
    assert times[len(times) // 2] < 0.5e-3, f"median {times[len(times) // 2] * 1e6:.0f} us"


def test_drafts_agree_with_arctic_inference():
    arctic = pytest.importorskip("arctic_inference.suffix_decoding._C")
    same = total = 0
    for _tree, seqs, depth, rng in random_trees(3):
        theirs = arctic.SuffixTree(depth)
        for k, q in enumerate(seqs):
            theirs.extend(k, q)
        ours = SuffixTree(depth)
        for k, q in enumerate(seqs):
            ours.extend(k, q)
        for _ in range(10):
            q = rng.choice(seqs)
            ctx = q[:rng.randint(1, len(q))][-depth:]
            k, factor, min_prob = rng.randint(1, 8), rng.choice([1.0, 2.0]), 0.1
            d = theirs.speculate(ctx, k, factor, 0.0, min_prob, False)
            tokens, score, m = ours.speculate(ctx, k, factor, min_prob)
            total += 1
            same += list(d.token_ids) == tokens and d.match_len == m
    # They differ only where equal counts tie (Arctic orders tied siblings by how each
    # reached its count; we keep the most recent): rare on real text, common here.
    assert same >= 0.9 * total
