"""Prometheus metrics of a `hetero serve` process (GET /metrics), in a registry of its own.

Gauges are read from the engine when scraped (queue depth, running requests, KV blocks used and
free, prefix-cache hit rate, engine restarts); counters and histograms are updated by the
handlers as requests start and finish (tokens, requests by finish reason, time to first token,
inter-token latency, end-to-end latency).
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _EngineGauges:
    def __init__(self, state):
        self.state = state

    def collect(self):
        for name, (doc, value) in self.state.gauges().items():
            yield GaugeMetricFamily(name, doc, value=value)


class Metrics:
    def __init__(self, state):
        self.registry = r = CollectorRegistry()
        r.register(_EngineGauges(state))
        if hasattr(state, "register_metrics"):          # the replicas' ingress counts per replica
            state.register_metrics(r)
        self.prompt_tokens = Counter("hetero_prompt_tokens", "prompt tokens of requests queued", registry=r)
        self.generation_tokens = Counter("hetero_generation_tokens", "tokens generated", registry=r)
        self.requests = Counter("hetero_requests", "requests finished, by reason", ["finish_reason"], registry=r)
        self.ttft = Histogram("hetero_time_to_first_token_seconds", "queued to first token", buckets=LATENCY,
                              registry=r)
        self.itl = Histogram("hetero_inter_token_latency_seconds", "between two tokens of a request",
                             buckets=LATENCY, registry=r)
        self.e2e = Histogram("hetero_request_latency_seconds", "queued to finished", buckets=LATENCY, registry=r)

    def started(self, prompt_tokens: int):
        self.prompt_tokens.inc(prompt_tokens)

    def finished(self, stream, reason: str):
        times = stream.token_times
        self.generation_tokens.inc(len(stream.token_ids))
        self.requests.labels(reason).inc()
        if times:
            self.ttft.observe(times[0] - stream.arrival)
            for a, b in zip(times, times[1:]):
                self.itl.observe(b - a)
            self.e2e.observe(times[-1] - stream.arrival)

    def aborted(self):
        self.requests.labels("abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
