"""Admission by deadline and by SLO: refuse early what cannot be served in time.

vLLM and SGLang admit by memory alone: under sustained overload their queues grow
until every request taken from them has already outlived its client, and the server
prefills for nobody. What matters is *goodput*, requests that meet their targets.
So each request may carry two targets (`RequestSLO`):

- `ttft_deadline`: when its first token (its first byte, for a stream) must be out.
  The server sets it from the client's own timeout (`X-Request-Timeout`, or the
  openai SDK's `x-stainless-read-timeout`), `--max-queue-time`, and a TTFT target
  (`--slo-ttft-ms`, or `X-SLO-TTFT-Ms` per request) — the earliest of those given.
- `tpot_target`: the time per output token it needs (`--slo-tpot-ms`, `X-SLO-TPOT-Ms`).
- `deadline`: when the whole answer must be out: the client's timeout, for a request
  answered in one piece (not streamed) whose `max_tokens` the client chose. No flag is
  needed: a client that says how long it waits has made a promise the server can check.

and the engine acts on them in three places:

1. **At arrival** (`check_arrival`): if the request would queue and the predicted
   wait plus prefill already passes the TTFT deadline, refuse now with 503 and a
   Retry-After of the predicted wait. One that starts at once is never refused for
   its TTFT: an idle server loses nothing by serving it, and a prediction alone,
   taken just after the load changed shape, once put an 832-token prefill past a
   600 s deadline. With a whole-answer `deadline`, the wait, the prefill and its
   `max_tokens` at the predicted time between tokens (`token_seconds`) must fit, or it is
   refused (503, Retry-After: by how much it would be late) — but only on a server
   with work (an idle one serves it: refusing would help nobody) and with a warm
   model (nothing is refused on a guess).
2. **In the queue** (`expired`): a waiting request that can no longer make either
   deadline is shed (503) before it costs a prefill.
3. **Into the batch** (`can_join`, `prefill_budget`): a request joins the running
   batch only if the predicted decode step stays within the tightest TPOT target of
   the batch, and a step's prefill chunk is capped so decoders keep their TPOT.

Predictions come from what the engine measured, nothing configured: a step-time
model fitted online (`StepTimeModel`) and the rate at which the queue drains.
Requests without targets are never shed, and never held back by `can_join`.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence

from app.engine.eigen_clip import clip_eigenvalues
from app.engine.errors import QueueFull
from app.engine.request import Request, RequestSLO

# Exponential forgetting per observation: the model follows the last ~100 steps (1/(1-F)).
FORGET = 0.99
# The prior's variance, and the most any direction of the estimate's covariance may reach.
P_MAX = 1e3
# Once trained, a step counts as at most this many times its prediction (plus 5 ms) off.
OUTLIER = 1.0
# Prefill tokens a step may always take, so waiting requests progress under any TPOT target.
MIN_PREFILL_CHUNK = 16
# Recent steps whose median time is the interval a running request sees between its tokens.
RECENT_STEPS = 32
# Recent steps from which the cost of one more sequence in a step is fitted.
SEQ_COST_STEPS = 128


class StepTimeModel:
    """Step seconds ≈ a + b·tokens + c·seqs, by recursive least squares with forgetting.

    Three numbers are enough: a fixed cost per step (launches, Python), a cost per
    token (weights are read once per step, but activations and attention grow with
    tokens), and a cost per sequence (sampling, attention setup).

    The fit runs on tokens and sequences as fractions of the step's budgets
    (`max_num_batched_tokens`, `max_num_seqs`), so all three coefficients are seconds
    (a step's fixed cost, a full step of tokens, a full batch) and one prior variance
    (P_MAX) means the same for each. In raw counts it did not: the prior on a cost per
    token was as wide, in seconds², as the one on the fixed cost, while a step's token
    count is up to 2048 times a fixed cost's 1. Replaying step traces recorded in
    `run_peers.sh` (conc32, Poisson, chat, and 1292 admission steps, in all 24 orders)
    put ~2900 of ~69000 predictions off by more than 3x, one 832-token prefill at 60 s
    (it takes ~1 s); with the fractions, at most one per order, for any P_MAX from 1e3
    to 1e4 and budgets from 512 x 32 to 8192 x 256. (FORGET = 0.98 still broke with
    some P_MAX and budgets; 0.99 did not. `tests/test_admission.py` replays a synthetic
    version.)

    Forgetting divides the covariance `p` by FORGET every step, also along directions
    the steps do not vary in: a long run of one-sequence decodes (tokens = seqs = 1)
    never tells a fixed cost from a per-sequence one, so that direction grew by
    1/FORGET a step — at 0.98, to ~1e21 over 3000 steps, where rounding left `p` no longer
    positive definite and the fit went wild on the next load. (In `run_peers.sh`,
    after conc1, the chat load had 32 of 64 requests shed as unable to start within
    600 s.) So no direction of `p` may exceed the prior's variance: the model is never
    less sure than before it saw a step (eigenvalues clipped at P_MAX).

    A step the host paused (a 0.5 s decode of two sequences, where 20 ms was due) is
    not evidence of a slower engine, but least squares would lean on it: along such a
    little-excited direction, one of them made a 848-token prefill predict 9 s instead
    of 0.8. Once trained, a step's error counts as at most OUTLIER times its prediction
    (a Huber-like clip): a pause moves the fit a little, while a real change (the
    engine twice as slow from now on) is inside the clip and is learnt at full speed.
    """

    def __init__(self, token_budget: int, seq_budget: int) -> None:
        self.budgets = (float(token_budget), float(seq_budget))
        self.theta = [0.0, 0.0, 0.0]
        self.p = [[P_MAX if i == j else 0.0 for j in range(3)] for i in range(3)]
        self.samples = 0

    def observe(self, tokens: int, seqs: int, seconds: float) -> None:
        x = self._features(tokens, seqs)
        px = [sum(self.p[i][j] * x[j] for j in range(3)) for i in range(3)]
        gain_den = FORGET + sum(x[i] * px[i] for i in range(3))
        k = [v / gain_den for v in px]
        predicted = sum(t * v for t, v in zip(self.theta, x))
        err = seconds - predicted
        if self.ready:
            bound = OUTLIER * max(0.0, predicted) + 0.005
            err = min(max(err, -bound), bound)
        self.theta = [t + ki * err for t, ki in zip(self.theta, k)]
        self.p = [[(self.p[i][j] - k[i] * px[j]) / FORGET for j in range(3)] for i in range(3)]
        if sum(self.p[i][i] for i in range(3)) > P_MAX:  # some direction may be past it
            self.p = clip_eigenvalues(self.p, P_MAX)
        self.samples += 1

    @property
    def ready(self) -> bool:
        return self.samples >= 8

    def _features(self, tokens: float, seqs: float) -> tuple[float, float, float]:
        return (1.0, tokens / self.budgets[0], seqs / self.budgets[1])

    def costs(self) -> tuple[float, float, float]:
        """Seconds per step, per token and per sequence (none negative)."""
        a, b, c = (max(0.0, t) for t in self.theta)
        return a, b / self.budgets[0], c / self.budgets[1]

    def predict(self, tokens: int, seqs: int) -> float:
        a, b, c = self.costs()
        return a + b * tokens + c * seqs


class SequenceCost:
    """What one more sequence adds to a step, fitted on the recent steps alone.

    Step seconds ≈ a + c·seqs + p·(prefill tokens), by least squares over the last
    SEQ_COST_STEPS steps; `c` is the answer. `StepTimeModel` fits one cost per token
    to prefill and decode tokens alike, which suits prefill but not this: on CPU a
    prefill token costs several decode tokens, so its per-sequence cost can fit near 0
    while a many-sequence decode step takes several times a one-sequence one."""

    def __init__(self) -> None:
        self._rows: deque[tuple[float, float, float]] = deque()
        # Sums over the rows of x·xᵀ and x·y, x = (1, seqs, prefill tokens): kept up to
        # date as rows come and go, and summed afresh once per window so no rounding
        # drift builds up. O(1) a step, and no numpy: this runs on the event loop every
        # step, where a LAPACK call wakes BLAS threads that spin beside the model's.
        self._xtx = [[0.0] * 3 for _ in range(3)]
        self._xty = [0.0] * 3
        self._since_resum = 0
        self.per_seq: float | None = None  # None: the steps do not tell it yet

    def observe(self, tokens: int, seqs: int, seconds: float) -> None:
        row = (float(seqs), float(max(0, tokens - seqs)), seconds)
        self._rows.append(row)
        self._add(row, 1.0)
        if len(self._rows) > SEQ_COST_STEPS:
            self._add(self._rows.popleft(), -1.0)
        self._since_resum += 1
        if self._since_resum >= SEQ_COST_STEPS:
            self._resum()
        n, s, ss = self._xtx[0][0], self._xtx[0][1], self._xtx[1][1]
        if n < 16 or ss * n - s * s <= 1e-9 * max(1.0, ss * n):
            return  # too few steps, or every recent step had the same batch: no slope
        fit = _solve(self._xtx, self._xty, 3) or _solve(self._xtx, self._xty, 2)
        if fit is not None:
            self.per_seq = max(0.0, fit[1])

    def _add(self, row: tuple[float, float, float], sign: float) -> None:
        x = (1.0, row[0], row[1])
        for i in range(3):
            self._xty[i] += sign * x[i] * row[2]
            for j in range(3):
                self._xtx[i][j] += sign * x[i] * x[j]

    def _resum(self) -> None:
        self._xtx = [[0.0] * 3 for _ in range(3)]
        self._xty = [0.0] * 3
        for row in self._rows:
            self._add(row, 1.0)
        self._since_resum = 0


def _solve(xtx: list[list[float]], xty: list[float], k: int) -> list[float] | None:
    """The least-squares coefficients from the normal equations' first `k` terms
    (k = 2 leaves the prefill term out), or None when they are singular (no prefill
    in the window, for k = 3). Gauss-Jordan elimination with partial pivoting."""
    m = [xtx[i][:k] + [xty[i]] for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-9 * max(1.0, abs(xtx[col][col])):
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(k):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [a - f * b for a, b in zip(m[r], m[col])]
    return [m[i][k] / m[i][i] for i in range(k)]


class AdmissionController:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.steps = StepTimeModel(max_num_batched_tokens, max_num_seqs)
        # Requests started per second while some waited: how fast the queue drains.
        self._starts = 0.0
        self._busy = 0.0
        # Times of the last steps: their median is robust to one long prefill step.
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self.seq_cost = SequenceCost()

    # -- measurements -----------------------------------------------------------------

    def observe_step(self, tokens: int, seqs: int, seconds: float, started: int,
                     waiting: int) -> None:
        self.steps.observe(tokens, seqs, seconds)
        self._recent.append(seconds)
        self.seq_cost.observe(tokens, seqs, seconds)
        if waiting or started:
            self._starts = self._starts * FORGET + started
            self._busy = self._busy * FORGET + seconds

    @property
    def drain_rate(self) -> float | None:
        """Requests started per second while the queue was not empty (None: not known)."""
        if self._busy <= 0 or self._starts <= 0 or not self.steps.ready:
            return None
        return self._starts / self._busy

    # -- predictions ----------------------------------------------------------------------

    def prefill_seconds(self, req: Request, running: int) -> float:
        """Time to prefill what the request has left, chunk by chunk, beside `running`."""
        if not self.steps.ready:
            return 0.0
        left = max(1, req.num_tokens - req.num_computed_tokens)
        chunk = max(1, self.max_num_batched_tokens - running)
        steps = math.ceil(left / chunk)
        return steps * self.steps.predict(min(left, chunk) + running, running + 1)

    def token_seconds(self, running: int, batch: int) -> float:
        """Seconds between a running request's tokens once the batch grows from `running`
        to `batch` sequences: the median of the recent steps (what running requests see
        now, other requests' prefill chunks included), plus what the extra sequences
        add (`SequenceCost`). The step-time model alone is no measure of a decode step:
        on CPU it can predict a many-sequence decode step several times too long, and
        then refuses requests a server at capacity could serve
        (`benchmarks/overload_soak.py` at load 1 shows it)."""
        now, then = (max(1, min(n, self.max_num_seqs)) for n in (running, batch))
        if not self._recent:
            return self.steps.predict(then, then)
        per_seq = self.seq_cost.per_seq
        if per_seq is None:
            a, b, c = self.steps.costs()
            per_seq = b + c
        return statistics.median(self._recent) + per_seq * max(0, then - now)

    def finish_seconds(self, req: Request, running: int, batch: int) -> float:
        """Time from its start to its last token: its prefill beside `running` sequences,
        then what is left of its max_tokens, one token per step of `batch` sequences."""
        left = max(0, req.params.max_tokens - req.num_output_tokens)
        return self.prefill_seconds(req, running) + left * self.token_seconds(running, batch)

    def wait_seconds(self, ahead: int, running: int) -> float | None:
        """Predicted wait before a request with `ahead` waiting requests before it starts."""
        beyond = ahead - max(0, self.max_num_seqs - running)
        if beyond < 0:
            return 0.0
        rate = self.drain_rate
        return None if rate is None else (beyond + 1) / rate

    # -- the three decisions ------------------------------------------------------------------

    def check_arrival(self, req: Request, slo: RequestSLO, ahead: int, running: int,
                      now: float, others: Sequence[Request] = ()) -> None:
        """Raise QueueFull (503, Retry-After) if the request cannot make its deadlines, or
        (with a whole-answer deadline) if one more sequence would make one of `others`,
        the running requests, miss a deadline it was predicted to make."""
        if slo.ttft_deadline is None and slo.deadline is None:
            return
        wait = self.wait_seconds(ahead, running)
        if wait is None:
            return  # nothing measured yet: let it in
        if (slo.ttft_deadline is not None and wait > 0.0
                and now + wait + self.prefill_seconds(req, running) > slo.ttft_deadline):
            raise QueueFull(f"cannot start within the request's deadline (predicted wait "
                            f"{wait:.1f} s)", reason="deadline", retry_after=wait)
        if slo.deadline is None or not (running or ahead) or not self.steps.ready:
            return  # an idle server serves it, and nothing is refused on a guess
        batch = running + ahead + 1
        done = now + wait + self.finish_seconds(req, running, batch)
        if done > slo.deadline:
            late = done - slo.deadline
            raise QueueFull(f"cannot finish within the request's deadline (predicted "
                            f"{late:.1f} s late with {running} running and {ahead} waiting)",
                            reason="deadline", retry_after=max(wait, late))
        # Each arrival checked only itself, the batch would grow until the requests
        # admitted first missed their deadlines (a third of them, at twice capacity).
        before, after = self.token_seconds(running, batch - 1), self.token_seconds(running, batch)
        for other in others:
            due, left = other.slo.deadline, other.params.max_tokens - other.num_output_tokens
            if due is not None and now + left * before <= due < now + left * after:
                raise QueueFull("one more sequence would make a running request miss its "
                                "deadline", reason="deadline", retry_after=left * before)

    def expired(self, req: Request, running: int, now: float) -> bool:
        """A waiting request that can no longer deliver its first token, or its whole
        answer, in time (the latter only beside running work, as at arrival)."""
        ttft, whole = req.slo.ttft_deadline, req.slo.deadline
        if ttft is not None and now + self.prefill_seconds(req, running) > ttft:
            return True
        return (whole is not None and running > 0 and self.steps.ready
                and now + self.finish_seconds(req, running, running + 1) > whole)

    def can_join(self, req: Request, running: list[Request]) -> bool:
        """Whether one more sequence keeps the decode step within every TPOT target."""
        targets = [r.slo.tpot_target for r in running if r.slo.tpot_target is not None]
        if req.slo.tpot_target is not None:
            targets.append(req.slo.tpot_target)
        if not targets or not running or not self.steps.ready:
            return True
        n = len(running) + 1
        return self.steps.predict(n, n) <= min(targets)

    def prefill_budget(self, running: list[Request], decodes: int) -> int | None:
        """Prefill tokens this step may take so decoders keep their TPOT (None: no cap)."""
        targets = [r.slo.tpot_target for r in running if r.slo.tpot_target is not None
                   and r.num_output_tokens > 0]
        if not targets or not self.steps.ready:
            return None
        a, b, c = self.steps.costs()
        if b <= 0:
            return None
        room = (min(targets) - a - c * (decodes + 1)) / b - decodes
        return max(MIN_PREFILL_CHUNK, int(room))
