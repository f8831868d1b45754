"""Prometheus metrics with vLLM's meanings under a `ridgeline:` prefix.

Dashboards built for vLLM port by swapping the prefix. Each engine owns its
registry (tests run several servers in one process).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from app.engine.outputs import RequestOutput, StepStats

P = "ridgeline:"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.num_requests_running = Gauge(P + "num_requests_running",
                                          "Requests in the running batch", labels, registry=r)
        self.num_requests_waiting = Gauge(P + "num_requests_waiting",
                                          "Requests waiting to be scheduled", labels, registry=r)
        self.kv_cache_usage_perc = Gauge(P + "kv_cache_usage_perc",
                                         "KV-cache usage, 1 means 100 percent", labels,
                                         registry=r)
        self.num_preemptions = Counter(P + "num_preemptions", "Cumulative preemptions", labels,
                                       registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prefill tokens processed", labels,
                                     registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens", labels,
                                         registry=r)
        self.request_success = Counter(P + "request_success", "Finished requests",
                                       labels + ["finished_reason"], registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Inter-token latency", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "End-to-end request latency",
                             labels, buckets=_REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram(P + "request_queue_time_seconds", "Time waiting to start",
                                    labels, buckets=_REQUEST_BUCKETS, registry=r)
        self.prefill_time = Histogram(P + "request_prefill_time_seconds",
                                      "First scheduled to first token", labels,
                                      buckets=_REQUEST_BUCKETS, registry=r)
        self.decode_time = Histogram(P + "request_decode_time_seconds",
                                     "First token to finish", labels, buckets=_REQUEST_BUCKETS,
                                     registry=r)
        self.prefix_cache_queries = Counter(P + "prefix_cache_queries",
                                            "Prefix cache lookups, in tokens", labels,
                                            registry=r)
        self.prefix_cache_hits = Counter(P + "prefix_cache_hits",
                                         "Prefix cache hits, in tokens", labels, registry=r)
        # vLLM's name; reasons: queue_full, deadline (refused at arrival: it could not
        # start in time), shed (taken out of the queue unstarted when its deadline passed).
        self.admission_rejections = Counter(P + "admission_rejections",
                                            "Requests refused before they started",
                                            labels + ["reason"], registry=r)
        # Ridgeline's own: prefill spent on requests that ended with no answer (the client
        # left, or the request failed) — what admission by deadline exists to avoid.
        self.wasted_prefill_tokens = Counter(P + "wasted_prefill_tokens",
                                             "Prefill tokens of requests aborted or failed",
                                             labels, registry=r)
        # Ridgeline's own: the block pool's O(1) invariant, read at every scrape. A leak
        # shows as kv_blocks_consistent 0 long before the pool runs dry.
        self.kv_blocks = Gauge(P + "kv_blocks", "KV blocks by state (free, cached, used)",
                               labels + ["state"], registry=r)
        self.kv_blocks_consistent = Gauge(P + "kv_blocks_consistent",
                                          "1 while free + cached + used == total and every "
                                          "block table has an owner", labels, registry=r)
        self.block_report: Callable[[], dict] | None = None
        # Ridgeline's own: how well the event loop keeps up (server overhead).
        self.event_loop_lag = Histogram(P + "event_loop_lag_seconds",
                                        "Lateness of a 10 ms timer on the event loop", labels,
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self.step_overhead = Counter(P + "step_overhead_seconds",
                                     "Engine-step time outside the model forward", labels,
                                     registry=r)
        self.model = model_name
        # Label children resolved once: `.labels()` per token would cost a dict lookup and a lock.
        m = model_name
        self._running = self.num_requests_running.labels(m)
        self._waiting = self.num_requests_waiting.labels(m)
        self._kv = self.kv_cache_usage_perc.labels(m)
        self._preempt = self.num_preemptions.labels(m)
        self._prompt = self.prompt_tokens.labels(m)
        self._gen = self.generation_tokens.labels(m)
        self._ttft = self.ttft.labels(m)
        self._itl = self.itl.labels(m)
        self._e2e = self.e2e.labels(m)
        self._phases = (self.queue_time.labels(m), self.prefill_time.labels(m),
                        self.decode_time.labels(m))
        self.lag = self.event_loop_lag.labels(m)
        self._wasted = self.wasted_prefill_tokens.labels(m)
        self._prefix_queries = self.prefix_cache_queries.labels(m)
        self._prefix_hits = self.prefix_cache_hits.labels(m)
        self.overhead = self.step_overhead.labels(m)

    def render(self) -> bytes:
        if self.block_report is not None:
            report = self.block_report()
            for kv_state in ("free", "cached", "used"):
                self.kv_blocks.labels(self.model, kv_state).set(report[kv_state])
            self.kv_blocks_consistent.labels(self.model).set(int(report["consistent"]))
        return generate_latest(self.registry)

    def record_step(self, stats: StepStats) -> None:
        self._running.set(stats.num_running)
        self._waiting.set(stats.num_waiting)
        self._kv.set(stats.kv_cache_usage)
        if stats.prompt_tokens:
            self._prompt.inc(stats.prompt_tokens)
        if stats.generation_tokens:
            self._gen.inc(stats.generation_tokens)
        if stats.preemptions:
            self._preempt.inc(stats.preemptions)
        if stats.prefix_cache_queries:
            self._prefix_queries.inc(stats.prefix_cache_queries)
            self._prefix_hits.inc(stats.prefix_cache_hits)

    def admission_rejected(self, reason: str) -> None:
        self.admission_rejections.labels(self.model, reason).inc()

    def observe_wasted(self, out: RequestOutput) -> None:
        if out.metrics is not None and out.metrics.prefill_tokens:
            self._wasted.inc(out.metrics.prefill_tokens)

    def observe_first_token(self, ttft: float) -> None:
        self._ttft.observe(ttft)

    def observe_itl(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def observe_finished(self, reason: str, e2e: float, queue: float | None,
                         prefill: float | None, decode: float | None) -> None:
        self.request_success.labels(self.model, reason).inc()
        self._e2e.observe(e2e)
        for hist, value in zip(self._phases, (queue, prefill, decode)):
            if value is not None:
                hist.observe(value)
