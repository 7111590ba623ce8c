"""Prometheus metrics of one worker: vLLM's names and meanings, under the ``kvbatch_`` prefix.

Names have no colons: Prometheus reserves them for recording rules, and the OpenMetrics
exposition that Prometheus 2.x negotiates turned ``kvbatch:x`` into ``kvbatch_x`` on the way,
so dashboards naming ``kvbatch:x`` found nothing. ``docs/deploy.md`` maps every name to vLLM's.
Labelled counters exist at 0 from the start for every label value they can take, so that
``rate()`` and ``increase()`` see the first event too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from jobs.schemas import TERMINAL_STATUSES

if TYPE_CHECKING:
    from engine.outputs import EngineStats

PREFIX = "kvbatch_"

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
            return Gauge(PREFIX + name, doc, labels, registry=r).labels(model)

        def counter(name: str, doc: str) -> Any:
            return Counter(PREFIX + name, doc, labels, registry=r).labels(model)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets,
                             registry=r).labels(model)

        self.running = gauge("num_requests_running", "Requests running in the engine.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting in the engine.")
        self.swapped = gauge(
            "num_requests_swapped",
            "Requests preempted with their KV swapped to the host pool (swap_space_bytes).")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).")
        self.cpu_threads = gauge("engine_cpu_threads", "Threads of the engine's CPU work "
                                 "(its share of the host's cores: worker.cpu_share).")
        self.queue_depth = gauge("queue_depth", "Jobs in the model's stream, not yet delivered.")
        self.queue_backlog = gauge(
            "queue_backlog", "Jobs of the model queued in SQL, not yet fed to its stream.")
        self.in_flight = gauge("jobs_in_flight", "Jobs this worker holds.")
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Submission to first scheduled.", LATENCY_BUCKETS)
        self.ttft = histogram("time_to_first_token_seconds",
                              "Submission to first token.", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between output tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Submission to finish.", LATENCY_BUCKETS)
        self.dead_lettered = counter("jobs_dead_lettered",
                                     "Jobs moved to the dead-letter stream by this worker.")
        # (counter, EngineStats field): the engine's counters are cumulative; each scrape
        # adds what they gained since the last snapshot.
        self._engine_counters = [
            (counter("prompt_tokens", "Prompt tokens of the requests scheduled (whole "
                                      "prompts, cached or computed, as vLLM counts them)."),
             "prefix_cache_queries"),
            (counter("prompt_tokens_cached", "Prompt tokens served from the prefix cache."),
             "prefix_cache_hits"),
            (counter("prompt_tokens_computed", "Prompt tokens run through the model "
                                               "(recomputation after preemption included)."),
             "num_prompt_tokens"),
            (counter("generation_tokens", "Tokens generated."), "num_generated_tokens"),
            (counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
             "prefix_cache_queries"),
            (counter("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
             "prefix_cache_hits"),
            (counter("num_preemptions", "Preemptions."), "num_preemptions"),
            (counter("num_swaps", "Preemptions that swapped the KV to the host pool rather "
                                  "than dropping it."), "num_swaps"),
            (counter("grammar_compiles", "Response formats compiled (once per distinct "
                                         "format and worker; a steady rate means formats "
                                         "that do not repeat)."), "num_grammar_compiles"),
        ]
        self._last = [0] * len(self._engine_counters)
        jobs = Counter(PREFIX + "jobs", "Jobs this worker brought to a terminal status.",
                       ["model_name", "status"], registry=r)
        self._jobs = {s.value: jobs.labels(model, s.value) for s in sorted(TERMINAL_STATUSES)}

    def job_finished(self, status: str) -> None:
        self._jobs[status].inc()

    def observe_engine(self, stats: EngineStats) -> None:
        """Update from an ``EngineStats`` snapshot (its counters are cumulative)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.swapped.set(stats.num_swapped)
        self.kv_usage.set(stats.kv_usage)
        self.cpu_threads.set(stats.cpu_threads)
        for i, (metric, field) in enumerate(self._engine_counters):
            value = int(getattr(stats, field))
            if value > self._last[i]:
                metric.inc(value - self._last[i])
            self._last[i] = value
