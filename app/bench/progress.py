"""A request counter on stderr for `ridgeline bench serve`.

The light install (the SDK and `bench serve`, no `engine` extra) has no tqdm, so the
bar is this: one line rewritten in place on a terminal, nothing when stderr is a file
or a pipe (logs of CI runs stay clean), and `--disable-tqdm` (vLLM's name) silences it.
"""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, desc: str, disable: bool = False):
        self.total, self.desc, self.done = total, desc, 0
        self.enabled = not disable and sys.stderr.isatty()
        self._start, self._last_draw = time.monotonic(), 0.0
        self._draw()

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last_draw >= 0.1 or self.done == self.total:  # at most 10 draws/s
            self._draw()

    def _draw(self) -> None:
        if not self.enabled:
            return
        self._last_draw = time.monotonic()
        elapsed = self._last_draw - self._start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        sys.stderr.write(f"\r{self.desc}: {self.done}/{self.total} "
                         f"[{elapsed:.0f} s, {rate:.2f}/s]")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw()
            sys.stderr.write("\n")
            sys.stderr.flush()
