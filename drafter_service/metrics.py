"""Prometheus metrics of the drafter (own registry, served on --metrics-port):
drafts and draft tokens per source (misses count under source "none"), the
time a step takes, and, read from the core at each scrape, the sessions, the
cached responses and tokens of the global trees and the memory they hold."""

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from drafter_service.draft import Draft

_STEP_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


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
        self._drafts = Counter("speclane:drafter_drafts", "Drafts answered, by source ('none': no match).",
                               ["source"], registry=self.registry)
        self._tokens = Counter("speclane:drafter_draft_tokens", "Draft tokens proposed, by source.", ["source"],
                               registry=self.registry)
        self._step_time = Histogram("speclane:drafter_step_seconds", "Time to commit a step's tokens and draft.",
                                    buckets=_STEP_BUCKETS, registry=self.registry)
        self.registry.register(_CoreCollector(core))

    def observe_step(self, draft: Draft, seconds: float) -> None:
        source = draft.source if len(draft) else "none"
        self._drafts.labels(source).inc()
        self._tokens.labels(source).inc(len(draft))
        self._step_time.observe(seconds)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serves /metrics from a daemon thread."""
        prometheus_client.start_http_server(port, addr=host, registry=self.registry)
