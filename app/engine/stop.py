"""Stop strings over a stream of text deltas.

A stop string can arrive split over any number of deltas, so text that might be the
start of one is held back until the next delta settles it. Only the longest suffix
that is a proper prefix of some stop string is held (at most `max(len(stop)) - 1`
characters); everything before it is safe to stream.

When several stop strings match, the one that completes first in the character
stream wins (ties: the longer one, i.e. the one that started first). That is what a
character-by-character scan would find, so the result does not depend on how the
text happened to be split into deltas.
"""


class StopStringMatcher:
    """Holds back possible stop-string prefixes and truncates the output at a match."""

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        if any(s == "" for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {stop!r}")
        self._stops = list(dict.fromkeys(stop))
        self._include_stop = include_stop_str_in_output
        # Every proper prefix of every stop string: the suffixes worth holding back.
        self._prefixes = {s[:i] for s in self._stops for i in range(1, len(s))}
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self.matched_stop: str | None = None

    @property
    def matched(self) -> bool:
        return self.matched_stop is not None

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add a delta; return (text safe to emit now, whether a stop string matched)."""
        if self.matched_stop is not None:
            raise RuntimeError(f"stop string {self.matched_stop!r} already matched")
        if not self._stops:
            return delta, False
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            start, stop = match
            self.matched_stop = stop
            self._held = ""
            end = start + len(stop) if self._include_stop else start
            return text[:end], True
        hold = self._hold_length(text)
        self._held = text[len(text) - hold :]
        return text[: len(text) - hold], False

    def flush(self) -> str:
        """Release held-back text when the request ends for another reason (EOS, length)."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        # Held text never contains a whole stop string (it would have matched), so
        # any match here ends in the new delta; `find` gives each stop's earliest end.
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = text.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key < best:
                best = key
        return None if best is None else (best[1], best[2])

    def _hold_length(self, text: str) -> int:
        for length in range(min(self._max_hold, len(text)), 0, -1):
            if text[-length:] in self._prefixes:
                return length
        return 0
