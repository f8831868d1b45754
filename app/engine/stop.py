"""Stop strings over a stream of text deltas, in time and memory linear in their length.

A stop string can arrive split over any number of deltas, so text that might be the
start of one is held back until the next delta settles it. Only the longest suffix
that is a proper prefix of some stop string is held (at most `max(len(stop)) - 1`
characters); everything before it is safe to stream.

Each stop string gets a Knuth–Morris–Pratt automaton: its state is the length of
the longest prefix of the stop string that the text seen so far ends with. Every
character moves every automaton in amortised O(1), so a delta of d characters
costs O(d × stops), and the tables cost O(total stop length) — not the quadratic
set of all prefixes a naive matcher builds (a 32 KB stop string would be 500 MB).

When several stop strings match, the one that completes first in the character
stream wins (ties: the longer one, i.e. the one that started first). That is what a
character-by-character scan finds, so the result does not depend on how the text
happened to be split into deltas.
"""

from __future__ import annotations


class _Automaton:
    """KMP over one stop string; `state` characters of it are matched so far."""

    __slots__ = ("stop", "fail", "state")

    def __init__(self, stop: str):
        self.stop = stop
        # fail[i]: the longest proper border of stop[:i + 1] (the classic prefix function).
        fail = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            fail[i] = k
        self.fail = fail
        self.state = 0

    def step(self, ch: str) -> bool:
        """Advance by one character; True when the whole stop string just matched."""
        stop, k = self.stop, self.state
        while k and ch != stop[k]:
            k = self.fail[k - 1]
        if ch == stop[k]:
            k += 1
        if k == len(stop):
            self.state = self.fail[k - 1]
            return True
        self.state = k
        return False


class StopStringMatcher:
    """Holds back possible stop-string prefixes and truncates the output at a match."""

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        if any(s == "" for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {stop!r}")
        self._automata = [_Automaton(s) for s in dict.fromkeys(stop)]
        self._include_stop = include_stop_str_in_output
        self._held = ""
        self.matched_stop: str | None = None

    @property
    def matched(self) -> bool:
        return self.matched_stop is not None

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add a delta; return (text safe to emit now, whether a stop string matched)."""
        if self.matched_stop is not None:
            raise RuntimeError(f"stop string {self.matched_stop!r} already matched")
        if not self._automata:
            return delta, False
        text = self._held + delta
        offset = len(self._held)  # the automata have already seen the held text
        for i, ch in enumerate(delta):
            done = [a.stop for a in self._automata if a.step(ch)]
            if done:
                stop = max(done, key=len)  # same end: the longer one started first
                self.matched_stop = stop
                self._held = ""
                end = offset + i + 1
                return text[: end if self._include_stop else end - len(stop)], True
        hold = max(a.state for a in self._automata)
        self._held = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        """Release held-back text when the request ends for another reason (EOS, length)."""
        held, self._held = self._held, ""
        for a in self._automata:
            a.state = 0
        return held
