"""Prometheus metrics of one worker, named after vLLM's (``vllm:`` becomes ``kvbatch:``)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Bucket edges in seconds: vLLM's up to 80 s, then up to a day, because TTFT, queue time and
# end-to-end latency count from submission and batch jobs may wait hours in the queue.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0, 2560.0,
                   5120.0, 10240.0, 21600.0, 43200.0, 86400.0)
# Time between output tokens: milliseconds normally, seconds under preemption or a long prefill
# of other sequences in the same step.
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               10.0, 20.0, 30.0)


class WorkerMetrics:
    """Gauges and counters fed from engine stats, histograms fed per finished job."""

    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model = model
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"kvbatch:{name}", doc, labels, registry=r).labels(model)

        def counter(name: str, doc: str) -> Any:
            return Counter(f"kvbatch:{name}", doc, labels, registry=r).labels(model)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(f"kvbatch:{name}", doc, labels, buckets=buckets,
                             registry=r).labels(model)

        self.running = gauge("num_requests_running", "Requests running in the engine.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting in the engine.")
        self.swapped = gauge(
            "num_requests_swapped",
            "Requests swapped to host memory: always 0, the engine preempts by recomputation.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).")
        self.queue_depth = gauge("queue_depth", "Jobs in the model's stream, not yet delivered.")
        self.in_flight = gauge("jobs_in_flight", "Jobs this worker holds.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the cache.")
        self.preemptions = counter("num_preemptions", "Preemptions.")
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens computed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Submission to first scheduled.", LATENCY_BUCKETS)
        self.ttft = histogram("time_to_first_token_seconds",
                              "Submission to first token.", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between output tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Submission to finish.", LATENCY_BUCKETS)
        self._jobs = Counter("kvbatch:jobs", "Jobs that reached a terminal status.",
                             ["model_name", "status"], registry=r)
        self._last: dict[str, int] = {}

    def job_finished(self, status: str) -> None:
        self._jobs.labels(self.model, status).inc()

    def observe_engine(self, stats: Any) -> None:
        """Update from an ``EngineStats`` snapshot (its counters are cumulative)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        for name, metric in (("prefix_cache_queries", self.prefix_queries),
                             ("prefix_cache_hits", self.prefix_hits),
                             ("num_preemptions", self.preemptions),
                             ("num_prompt_tokens", self.prompt_tokens),
                             ("num_generated_tokens", self.generation_tokens)):
            value = int(getattr(stats, name))
            delta = value - self._last.get(name, 0)
            if delta > 0:
                metric.inc(delta)
            self._last[name] = value
