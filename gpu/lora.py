"""LoRA adapters on the model thread: a host cache, slots, and the per-step delta.

Every adaptable linear (q/k/v, o, gate/up, down: `models/lora.py` says how HF's parts
land in our fused ones) is wrapped in a `LoRALinear` that holds one stacked pair per
linear, `A [max_loras, R, in]` and `Bt [max_loras, R, out]` (R: `--max-lora-rank`
times the parts the linear fuses; a slot's unused ranks are zero and never read). A
step's rows are grouped by the slot of their sequence's adapter, and each linear adds
`(x[rows] @ A_slot^T) @ Bt_slot` to its base output for each group: Punica's segmented
idea with one pair of matmuls per adapter present. A sequence's tokens are contiguous,
so a group of one sequence is a slice; groups of several sequences gather and
scatter-add their rows. A step without LoRA rows, and a linear the batch's adapters
do not adapt, run the base layer alone.

With the C++ kernels built (`gpu/cpu/kernels/lora_delta.cpp`), the rows of the
sequences with few rows in the step (decodes) take the kernel instead: their rows,
sorted by slot into segments once per step (`Segments`), get every adapter's delta in
one call per linear, where torch would make four small calls per adapter. A sequence
of many rows (a prefill chunk) stays a group of torch matmuls, which are the faster
at that size.

The slots hold the adapters of the step in flight (at most `--max-loras`, which the
scheduler guarantees); the host cache holds up to `--max-cpu-loras` parsed adapters
(least recently used out, read again from disk when needed). Adapter ids come from the
event loop, which never reuses one, so a slot or cache entry can never be mistaken for
a later adapter of the same name.

On CUDA the delta is the Triton kernels' instead (`gpu/triton/lora.py`, `RowLoRALinear`):
every row carries its slot in one int32 tensor (-1: the base model), so a step's
delta is two launches per linear whatever its adapters, nothing is grouped on the host,
and a decode CUDA graph captures it over a static row-slot buffer (`gpu/graphs.py`).
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator

import torch
from torch import nn

from gpu.lora_linear import Group, LoRALinear, Segments, StepLoRA, plan_segments
from gpu.lora_rows import RowKernel, RowLoRALinear, output_slices
from gpu.staging import Staging
from models.lora import AdapterError, adaptable, read_adapter

log = logging.getLogger("ridgeline.lora")

ADAPTABLE = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

Pairs = dict[str, tuple[torch.Tensor, torch.Tensor]]
# A sequence with at least this many rows in a step runs its delta as torch matmuls
# over its slice; fewer, through the kernel's segments.
MATMUL_ROWS = 16


class LoRASlots:
    """The model thread's adapters: registered paths, the host cache, the slots."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, dtype: torch.dtype, device: torch.device,
                 kernel: RowKernel | None = None, cpu_kernel=None):
        """`kernel`: the per-row delta (`row_kernel`); None: rows grouped per adapter.
        `cpu_kernel`: the C++ `lora_delta_` op for the grouped path's few-row sequences,
        or None (every group through torch)."""
        self.max_loras, self.max_rank, self.max_cpu = max_loras, max_lora_rank, max_cpu_loras
        self.dtype = dtype
        self.per_row = kernel is not None
        self._staging = Staging(device) if self.per_row else None
        self.targets, fused = adaptable(model, ADAPTABLE)
        self.current = StepLoRA(cpu_kernel)
        self.layers: dict[str, LoRALinear] = {}
        for prefix, parent in list(model.named_modules()):
            for name, child in list(parent.named_children()):
                if name in ADAPTABLE:
                    full = f"{prefix}.{name}" if prefix else name
                    args = (child, self.current, max_loras, max_lora_rank * fused[full],
                            dtype, device)
                    layer = LoRALinear(*args) if kernel is None else RowLoRALinear(
                        *args, output_slices(self.targets, full, child.out_features), kernel)
                    setattr(parent, name, layer)
                    self.layers[full] = layer
        self.shapes = {n: (m.out_features, m.in_features) for n, m in self.layers.items()}
        self.paths: dict[int, str] = {}  # every adapter the engine has registered
        self.cache: OrderedDict[int, Pairs] = OrderedDict()  # least recently used first
        self.slot_of: dict[int, int] = {}
        self.slot_lru: OrderedDict[int, None] = OrderedDict()  # slots, least recent first
        self.nbytes = sum(m.A.nbytes + m.Bt.nbytes for m in self.layers.values())
        log.info("LoRA: %d linears adaptable, %d slots of rank up to %d (x the parts a fused "
                 "linear holds): %.1f MiB; the delta by %s", len(self.layers), max_loras,
                 max_lora_rank, self.nbytes / 2**20,
                 "per-row kernels" if self.per_row else "rows grouped per adapter")

    # -- adapters ------------------------------------------------------------------

    def add(self, lora_id: int, path: str) -> int:
        """Read and check the adapter, keep it in the host cache; returns its largest rank.
        Raises AdapterError for anything that cannot be served."""
        pairs = self._read(path)
        self.paths[lora_id] = path
        self._cache(lora_id, pairs)
        return max(a.shape[0] for a, _ in pairs.values())

    def remove(self, lora_id: int) -> None:
        self.paths.pop(lora_id, None)
        self.cache.pop(lora_id, None)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            for layer in self.layers.values():
                layer.write(slot, None)

    def _read(self, path: str) -> Pairs:
        return read_adapter(path, self.targets, self.shapes, self.max_rank, self.dtype)

    def _cache(self, lora_id: int, pairs: Pairs) -> None:
        self.cache[lora_id] = pairs
        self.cache.move_to_end(lora_id)
        while len(self.cache) > self.max_cpu:
            self.cache.popitem(last=False)

    def _pairs(self, lora_id: int) -> Pairs:
        pairs = self.cache.get(lora_id)
        if pairs is None:  # left the host cache: read again
            if lora_id not in self.paths:
                raise AdapterError(f"LoRA adapter id {lora_id} is not loaded")
            pairs = self._read(self.paths[lora_id])
        self._cache(lora_id, pairs)
        return pairs

    def _slot(self, lora_id: int, keep: set[int]) -> int:
        """The adapter's slot, writing it into one (a free one, else the least recently
        used one whose adapter is not in this step) if it holds none."""
        slot = self.slot_of.get(lora_id)
        if slot is None:
            used = set(self.slot_of.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                owner = {s: i for i, s in self.slot_of.items()}
                slot = next(s for s in self.slot_lru if owner[s] not in keep)
                del self.slot_of[owner[slot]]
            pairs = self._pairs(lora_id)
            for name, layer in self.layers.items():
                layer.write(slot, pairs.get(name))
            self.slot_of[lora_id] = slot
        self.slot_lru[slot] = None
        self.slot_lru.move_to_end(slot)
        return slot

    # -- a step --------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, lora_ids: list[int], query_lens: list[int],
             device: torch.device) -> Iterator[None]:
        """Within it, the adapted linears add each row's adapter delta. `lora_ids`: per
        sequence (0: the base model), or empty for a step without adapters."""
        if self.per_row:
            if not any(lora_ids):  # no adapter in the step: the linears run their base alone
                yield
                return
            slots = self.row_slots(lora_ids)
            per_token = [s for s, n in zip(slots, query_lens) for _ in range(n)]
            with self.rows(self._staging.stage((per_token, torch.int32))[0]):
                yield
            return
        if self.current.groups is not None:
            raise RuntimeError("LoRA steps do not nest")
        groups, segments = self.groups(lora_ids, query_lens, device) if any(lora_ids) \
            else (None, None)
        self.current.groups, self.current.segments = groups, segments
        try:
            yield
        finally:
            self.current.groups = self.current.segments = None

    @contextlib.contextmanager
    def rows(self, row_slots: torch.Tensor) -> Iterator[None]:
        """Within it, the per-row linears add the delta of each row's slot in `row_slots`
        (a CUDA graph's static buffer, or a step's staged tensor)."""
        if self.current.rows is not None:
            raise RuntimeError("LoRA steps do not nest")
        self.current.rows = row_slots
        try:
            yield
        finally:
            self.current.rows = None

    def row_slots(self, lora_ids: list[int]) -> list[int]:
        """Per sequence, its adapter's slot (written there if it holds none); -1 for the
        base model."""
        keep = self._keep(lora_ids)
        return [self._slot(i, keep) if i else -1 for i in lora_ids]

    def _keep(self, lora_ids: list[int]) -> set[int]:
        keep = set(lora_ids) - {0}
        if len(keep) > self.max_loras:
            raise ValueError(f"a step holds {len(keep)} adapters; --max-loras is "
                             f"{self.max_loras}")
        return keep

    def groups(self, lora_ids: list[int], query_lens: list[int],
               device: torch.device) -> tuple[list[Group], Segments | None]:
        """The step's torch groups, and the kernel's segments (None: no row for it)."""
        keep = self._keep(lora_ids)
        rows: dict[int, list[tuple[int, int]]] = {}
        few: dict[int, list[int]] = {}  # the kernel's rows, per slot
        start = 0
        kernel = self.current.kernel is not None
        for lora_id, n in zip(lora_ids, query_lens):
            if lora_id and kernel and n < MATMUL_ROWS:
                few.setdefault(self._slot(lora_id, keep), []).extend(range(start, start + n))
            elif lora_id:
                spans = rows.setdefault(self._slot(lora_id, keep), [])
                if spans and spans[-1][1] == start:
                    spans[-1] = (spans[-1][0], start + n)
                else:
                    spans.append((start, start + n))
            start += n
        out = []
        for slot, spans in rows.items():
            if len(spans) == 1:
                out.append(Group(slot, slice(*spans[0])))
            else:
                index = [i for a, b in spans for i in range(a, b)]
                out.append(Group(slot, torch.tensor(index, dtype=torch.long, device=device)))
        return out, plan_segments(few) if few else None
