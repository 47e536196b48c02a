"""Per-pass metrics of the engine: Prometheus (own registry, served on
--metrics-port) and a structured debug log line per forward pass."""

import prometheus_client
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from verifier_service.engine import StepStats

log = structlog.get_logger()

_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


class VerifierMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._labels = {"model_name": model_name}

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(**self._labels)

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=self.registry).labels(**self._labels)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=self.registry).labels(**self._labels)

        self.batch_size = histogram("speclane:verifier_batch_sequences", "Sequences per forward pass.",
                                    _SIZE_BUCKETS)
        self.batch_tokens = histogram("speclane:verifier_batch_tokens", "Tokens per forward pass.", _SIZE_BUCKETS)
        self.forward_time = histogram("speclane:verifier_forward_seconds", "Forward pass time.", _TIME_BUCKETS)
        self.queue_wait = histogram("speclane:verifier_queue_wait_seconds",
                                    "Time a step waited before joining a forward pass.", _TIME_BUCKETS)
        self.passes = counter("speclane:verifier_forward_passes", "Forward passes.")
        self.prefill_tokens = counter("vllm:prompt_tokens_computed", "Prompt tokens run through the model.")
        self.draft_tokens = counter("speclane:verifier_draft_tokens", "Draft tokens run through the model.")
        self.kv_used = gauge("speclane:verifier_kv_used_tokens", "KV tokens held by running sequences.")
        self.kv_cached = gauge("speclane:verifier_kv_cached_tokens", "KV tokens held by the prefix cache.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Share of the KV budget held by running sequences.")
        self.waiting = gauge("vllm:num_requests_waiting", "Sequences waiting for KV space.")
        self.preemptions = counter("vllm:num_preemptions", "Sequences preempted (prefilled again later).")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prompt tokens of admitted sequences, looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        # The engine reports totals; the counters advance by what is new since the last pass.
        self._totals = (0, 0, 0)

    def observe(self, stats: StepStats) -> None:
        self.passes.inc()
        self.batch_size.observe(stats.num_sequences)
        self.batch_tokens.observe(stats.num_tokens)
        self.forward_time.observe(stats.forward_seconds)
        for wait in stats.queue_wait_seconds:
            self.queue_wait.observe(wait)
        self.prefill_tokens.inc(stats.num_prefill_tokens)
        self.draft_tokens.inc(stats.num_draft_tokens)
        self.kv_used.set(stats.kv_used_tokens)
        self.kv_cached.set(stats.kv_cached_tokens)
        self.kv_usage.set(stats.kv_used_tokens / stats.kv_max_tokens)
        self.waiting.set(stats.num_waiting)
        totals = (stats.num_preemptions, stats.prefix_cache_queries, stats.prefix_cache_hits)
        for counter, total, seen in zip((self.preemptions, self.prefix_queries, self.prefix_hits), totals,
                                        self._totals):
            counter.inc(total - seen)
        self._totals = totals
        log.debug("forward_pass", sequences=stats.num_sequences, tokens=stats.num_tokens,
                  prefill_tokens=stats.num_prefill_tokens, draft_tokens=stats.num_draft_tokens,
                  forward_seconds=round(stats.forward_seconds, 5),
                  max_queue_wait_seconds=round(max(stats.queue_wait_seconds, default=0.0), 5),
                  kv_used_tokens=stats.kv_used_tokens, kv_cached_tokens=stats.kv_cached_tokens,
                  kv_max_tokens=stats.kv_max_tokens, waiting=stats.num_waiting,
                  preemptions=stats.num_preemptions)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serves /metrics from a daemon thread."""
        prometheus_client.start_http_server(port, addr=host, registry=self.registry)
