"""Host to device and back without stalling the host more than once per step.

`torch.tensor(values, device="cuda")` copies out of pageable memory, and such a copy
blocks the host until the device has caught up with everything queued before it: a
host-device sync per small tensor, five or more per step. Instead, a step writes all
its small inputs into one pinned host buffer and issues a single asynchronous copy
into a device twin (`Staging.stage`); the tensors it hands out are views of the twin.
The way back is the same idea: every result of a step is copied out asynchronously
and the host waits once, on the last copy (`to_host`). That wait is the step's one
sync; the sampled tokens are what the event loop is waiting for anyway.

Reuse rule: the pinned buffer is rewritten only once the device has read it (each copy
records an event). The device twin may be rewritten by the next `stage` call at once,
because the device runs copies and kernels in stream order: views handed out before
stay valid for every kernel queued before that call, not after it.

Off CUDA there is nothing to stage: `stage` returns ordinary tensors and `to_host`
returns its arguments.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ALIGN = 16  # bytes: every view starts aligned for its dtype (and for vector loads)

Values = Sequence[int] | Sequence[float] | torch.Tensor


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Staging:
    """One pinned host buffer and its device twin, grown when a step needs more."""

    def __init__(self, device: torch.device, capacity: int = 1 << 16):
        self.device = device
        self.cuda = device.type == "cuda"
        self._host: torch.Tensor | None = None
        self._dev: torch.Tensor | None = None
        self._used = 0  # bytes of the buffer the last copy may still be reading
        self._copied: torch.cuda.Event | None = None
        self.copies = 0  # host-to-device copies issued (tests and the sync audit read it)
        if self.cuda:
            self._allocate(capacity)

    def _allocate(self, nbytes: int) -> None:
        # The old buffers stay alive while a queued copy or kernel uses them: the host
        # one through the caching host allocator's events, the device one through the
        # views handed out.
        self._host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self._dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._used = 0

    def stage(self, *fields: tuple[Values, torch.dtype]) -> list[torch.Tensor]:
        """A 1-D device tensor per `(values, dtype)`, all arriving by one asynchronous copy."""
        if not self.cuda:
            return [torch.as_tensor(v, dtype=d, device=self.device) for v, d in fields]
        sizes = [_round_up(len(v) * d.itemsize) for v, d in fields]
        total = sum(sizes)
        start = self._free_offset(total)
        offset = start
        views = []
        for (values, dtype), size in zip(fields, sizes):
            n = len(values)
            host = self._host[offset : offset + n * dtype.itemsize].view(dtype)
            host.copy_(torch.as_tensor(values, dtype=dtype))
            views.append(self._dev[offset : offset + n * dtype.itemsize].view(dtype))
            offset += size
        self._dev[start:offset].copy_(self._host[start:offset], non_blocking=True)
        self._used = offset
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record()
        self.copies += 1
        return views

    def _free_offset(self, total: int) -> int:
        """Where this step's bytes go: after what the last copy may still read, or at 0
        once that copy is done (it always is after a step's closing sync)."""
        assert self._host is not None
        if self._copied is None or self._copied.query():
            start = 0
        elif self._used + total <= self._host.numel():
            return self._used
        else:
            self._copied.synchronize()  # a step with no closing sync, then a big one
            start = 0
        if total > self._host.numel():
            self._allocate(max(total, 2 * self._host.numel()))
        return start


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """CPU copies of a step's results, with one wait for all of them.

    Every copy but the last is asynchronous (into pinned memory); the last is blocking,
    and since the device runs copies in order, when it returns all of them are done.
    """
    if not tensors or tensors[0].device.type != "cuda":
        return list(tensors)
    out = [t.to("cpu", non_blocking=True) for t in tensors[:-1]]
    return [*out, tensors[-1].cpu()]
