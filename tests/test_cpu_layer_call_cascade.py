"""The fused decode call on steps whose decode rows share a prefix of blocks (cascade
attention: `gpu/attention/shared_prefix.py`, `cascade_decode_amx_`) against the module
path, which takes `TorchAttentionBackend._cascade` there.

As a chat under prefix caching: one request's prompt fills the shared blocks, four more
start after them (their tables begin with the same blocks), two others share nothing.
Two copies of the pools run the same steps, the fused call on and off; every step's
hidden states, logits and pools must be equal bit for bit, the fused call must have run
on each decode step, and the step must have had the shared prefix (with and without
other rows) that makes the module path take cascade attention.
"""

from __future__ import annotations

import pytest
import torch

from gpu.attention.shared_prefix import MIN_SAVED, MIN_TOKENS
from gpu.cpu.decoder_ops import CpuDecoderOps
from tests.test_cpu_layer_call import BLOCK, CAPS, Run, same, tiny_model

pytestmark = pytest.mark.skipif(
    not (CAPS.has("decode_layers_bf16") and CAPS.bf16_arithmetic and CAPS.amx
         and CAPS.has("cascade_decode_amx_")),
    reason="needs the fused decode call and cascade attention (AMX-BF16, the tile state)")

PREFIX_BLOCKS = MIN_TOKENS // BLOCK  # the shortest prefix that takes cascade attention
SHARING = 1 + MIN_SAVED // MIN_TOKENS  # the fewest rows whose saved reads are enough
OWN = 3  # blocks of each sequence's own
OTHERS = (2, SHARING)  # sequences sharing nothing, among those that do
SHARERS = [s for s in range(SHARING + len(OTHERS)) if s not in OTHERS]
NUM_BLOCKS = PREFIX_BLOCKS + OWN * (SHARING + len(OTHERS))


def table(seq: int) -> list[int]:
    """A sequence's blocks: the shared prefix's then its own, or only its own."""
    own = [PREFIX_BLOCKS + OWN * seq + i for i in range(OWN)]
    return own if seq in OTHERS else list(range(PREFIX_BLOCKS)) + own


def test_cascade_steps_take_the_fused_call_bit_for_bit():
    model = tiny_model(positions=512)
    ops: CpuDecoderOps = model.ops
    on, off = (Run(model, fused, table, NUM_BLOCKS) for fused in (True, False))
    g = torch.Generator().manual_seed(1)
    system = torch.randint(0, 512, (PREFIX_BLOCKS * BLOCK,), generator=g).tolist()

    def both(new: dict[int, list[int]], fused: bool, others: int | None = None):
        """Runs a step on both copies; `others`: the rows not sharing the step's prefix
        (None: no cascade this step)."""
        calls = ops.layer_calls
        (h1, l1, s1), (h0, l0, s0) = on.step(new), off.step(new)
        assert ops.layer_calls - calls == fused, new
        assert same(h1, h0) and same(l1, l0)
        for a, b in zip(on.k + on.v, off.k + off.v, strict=True):
            assert same(a, b)
        if others is None:
            assert s1 is None and s0 is None
        elif fused:
            assert s1 is not None and s1.tokens == PREFIX_BLOCKS * BLOCK
            assert (0 if s1.others is None else len(s1.others)) == others
        return dict(zip(sorted(new), l1.argmax(-1).tolist(), strict=True))

    nxt = both({0: system + [5, 17, 300]}, fused=False)  # fills the shared blocks
    later = SHARERS[1:]
    on.lens |= {s: len(system) for s in later}  # as a prefix cache hit
    off.lens |= {s: len(system) for s in later}
    nxt |= both({s: [9, s, 7] for s in later}, fused=False)
    nxt |= both({s: [3, s, 4, 8, 2] for s in OTHERS}, fused=False)
    for _ in range(3):  # every row shares the prefix
        nxt |= both({s: [nxt[s]] for s in SHARERS}, fused=True, others=0)
    for _ in range(3):  # two rows among them do not: gathered and scattered back
        nxt |= both({s: [nxt[s]] for s in [*SHARERS, *OTHERS]}, fused=True, others=2)
    for _ in range(2):  # one does not
        nxt |= both({s: [nxt[s]] for s in [*SHARERS, OTHERS[0]]}, fused=True, others=1)
    # One row too few to share: the per-row kernel, in the fused call still.
    nxt |= both({s: [nxt[s]] for s in [*later, *OTHERS]}, fused=True)
    assert ops.layer_calls == 9
