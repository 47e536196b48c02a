"""Prometheus metrics of the drafter (own registry, served on --metrics-port):
drafts and draft tokens per source (misses count under source "none"), the
time a message's steps take, and, read from the core at each scrape, the
sessions, the cached responses and tokens of the global trees and the memory
they hold."""

from collections import Counter as Tally
from collections.abc import Sequence

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from drafter_service.engine import CORE_SOURCES, CoreDraft

_BATCH_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)
_MISS = "none"


class _CoreCollector:
    """The core's sizes, read when Prometheus scrapes (nothing to keep in step)."""

    def __init__(self, core):
        self._core = core

    def collect(self):
        yield GaugeMetricFamily("speclane:drafter_sessions", "Open drafting sessions.",
                                value=len(self._core.active_requests()))
        yield GaugeMetricFamily("speclane:drafter_cached_requests", "Responses in the global suffix trees.",
                                value=len(self._core.cached_requests()))
        yield GaugeMetricFamily("speclane:drafter_cached_tokens", "Response tokens in the global suffix trees.",
                                value=self._core.cached_tokens())
        yield GaugeMetricFamily("speclane:drafter_memory_bytes", "Memory of all suffix trees and n-gram indexes.",
                                value=self._core.memory_bytes())


class DrafterMetrics:
    def __init__(self, core):
        self.registry = CollectorRegistry()
        drafts = Counter("speclane:drafter_drafts", "Drafts answered, by source ('none': no match).",
                         ["source"], registry=self.registry)
        tokens = Counter("speclane:drafter_draft_tokens", "Draft tokens proposed, by source.", ["source"],
                         registry=self.registry)
        # Each source's children looked up once: a message of 32 steps would otherwise look them up 64 times.
        self._drafts = {source: drafts.labels(source) for source in (*CORE_SOURCES.values(), _MISS)}
        self._tokens = {source: tokens.labels(source) for source in (*CORE_SOURCES.values(), _MISS)}
        self._batch_time = Histogram("speclane:drafter_batch_seconds",
                                     "Time to commit and draft the steps of one message (one step per "
                                     "Session message; a gateway's pass on a Sessions stream).",
                                     buckets=_BATCH_BUCKETS, registry=self.registry)
        self.registry.register(_CoreCollector(core))

    def observe_batch(self, drafts: Sequence[CoreDraft], seconds: float) -> None:
        counts, tokens = Tally(), Tally()
        for draft in drafts:
            source = CORE_SOURCES.get(draft[5], _MISS) if draft[0] else _MISS
            counts[source] += 1
            tokens[source] += len(draft[0])
        for source, count in counts.items():
            self._drafts[source].inc(count)
            self._tokens[source].inc(tokens[source])
        self._batch_time.observe(seconds)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serves /metrics from a daemon thread."""
        prometheus_client.start_http_server(port, addr=host, registry=self.registry)
