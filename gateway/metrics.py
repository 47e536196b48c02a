"""Prometheus metrics of the gateway, under vLLM's names where vLLM has one
(dashboards built for vLLM read them unchanged), in a registry of our own.

The gateway's /metrics is the one a dashboard needs: besides what the gateway
sees itself, it carries the verifiers' scheduler and cache figures (their
GetLoad answers, summed) and each request's phases as its verifier timed them."""

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from protos.verifier.v1 import verifier_pb2

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
# vLLM's buckets for inter-token latency and for a request's phases.
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)
# A verify step's parts: the drafter answers in about a millisecond, a CPU forward takes tens.
STEP_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
# Each verifier's last GetLoad answer, and whether its last poll was answered.
LoadSource = Callable[[], list[tuple[verifier_pb2.EngineLoad, bool]]]


@dataclass(frozen=True)
class StepTimes:
    """One propose/verify step, as the gateway saw it (seconds)."""

    drafter_wait: float  # asking the drafter for the draft
    verifier_wait: float  # sending the Verify until its answer is read (the last tokens stream meanwhile)
    verifier: float  # the verifier's own share: arrival to answer (it reports it)
    forward: float  # the forward pass that verified the step (shared with its batch)
    head_draft: float = 0.0  # the verifier head's drafting for the step, part of `verifier`

    @property
    def network(self) -> float:
        """The wait the verifier does not account for: both directions of the link, and gRPC."""
        return max(0.0, self.verifier_wait - self.verifier)

    def milliseconds(self) -> dict[str, float]:
        parts = {"drafter_wait": self.drafter_wait, "verifier_wait": self.verifier_wait, "verifier": self.verifier,
                 "forward": self.forward, "head_draft": self.head_draft, "network": self.network}
        return {f"{name}_ms": round(seconds * 1e3, 3) for name, seconds in parts.items()}


class GatewayMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def counter(name, doc, extra_labels=()):
            return Counter(name, doc, [*labels, *extra_labels], registry=self.registry)

        # Steps that had a draft to verify (vLLM counts only these).
        self._drafts = counter("vllm:spec_decode_num_drafts", "Verify steps with a non-empty draft.")
        self._draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self._accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted, by position in the draft.", ["position"])
        # All steps, also those without a draft: the denominator of tokens per step.
        self._verify_steps = counter("speclane:verify_steps", "Verify steps, including steps with no draft.")
        self._finished = counter("vllm:request_success", "Finished generations by finish reason.",
                                 ["finished_reason"])
        self._errors = counter("speclane:request_errors", "Requests that failed, by error type.", ["error_type"])
        # taken / (taken + missed) is the next-round hit rate: the steps that skipped the gateway's round trip;
        # looked_up: steps no offer foresaw that the verifier started with its own prompt lookup.
        self._next_round = counter("speclane:next_round_offers", "Steps offered next-round drafts, by whether the "
                                   "verifier went on with one of them (taken), with a draft it looked up itself "
                                   "(looked_up), or waited for a Verify (missed).", ["outcome"])
        for outcome in ("taken", "looked_up", "missed"):  # at 0 from the start, so a rate is defined
            self._next_round.labels(model_name, outcome)
        self._prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of generations.")
        self._generation_tokens = counter("vllm:generation_tokens", "Generated tokens returned.")
        self._running = Gauge("vllm:num_requests_running", "Generations in flight.", labels,
                              registry=self.registry)
        self._ttft = Histogram("vllm:time_to_first_token_seconds", "Time to the first generated token.",
                               labels, buckets=TTFT_BUCKETS, registry=self.registry)
        self._e2e = Histogram("vllm:e2e_request_latency_seconds", "Generation latency, start to finish.",
                              labels, buckets=E2E_BUCKETS, registry=self.registry)

        def histogram(name, doc, buckets=PHASE_BUCKETS):
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self._itl = histogram("vllm:inter_token_latency_seconds",
                              "Time between two verify answers that commit tokens (one per step).", ITL_BUCKETS)
        # vLLM's older name of the same observations, still read by many dashboards.
        self._tpot = histogram("vllm:time_per_output_token_seconds",
                               "Time between two verify answers that commit tokens (one per step).", ITL_BUCKETS)
        self._request_tpot = histogram("vllm:request_time_per_output_token_seconds",
                                       "A request's decode time over its tokens after the first.", ITL_BUCKETS)
        self._queue = histogram("vllm:request_queue_time_seconds", "Time a request waited for KV space.")
        self._prefill = histogram("vllm:request_prefill_time_seconds",
                                  "Time from a request's first forward pass to its first token.")
        self._decode = histogram("vllm:request_decode_time_seconds",
                                 "Time from a request's first token to its last.")
        self._inference = histogram("vllm:request_inference_time_seconds", "A request's prefill plus decode time.")
        self._step_parts = {
            "drafter_wait": histogram("speclane:step_drafter_wait_seconds",
                                      "Time a verify step waited for the drafter's draft.", STEP_BUCKETS),
            "verifier_wait": histogram("speclane:step_verifier_wait_seconds",
                                       "Time from sending a Verify to reading its answer.", STEP_BUCKETS),
            "verifier": histogram("speclane:step_verifier_seconds", "The verifier's own time for a step, as it "
                                  "reports it: arrival to answer, batching and the head's draft included.",
                                  STEP_BUCKETS),
            "forward": histogram("speclane:step_forward_seconds",
                                 "The forward pass that verified a step (shared with its batch).", STEP_BUCKETS),
            "head_draft": histogram("speclane:step_head_draft_seconds",
                                    "The verifier head's drafting for a step (head methods and hybrid).", STEP_BUCKETS),
            "network": histogram("speclane:step_network_seconds", "A step's wait for the verifier beyond the "
                                 "verifier's own time: the link both ways and gRPC.", STEP_BUCKETS),
        }

    def record_verify_step(self, num_draft_tokens: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= num_draft_tokens:
            raise ValueError(f"accepted {num_accepted} of {num_draft_tokens} draft tokens")
        model = self.model_name
        self._verify_steps.labels(model).inc()
        if num_draft_tokens == 0:
            return
        self._drafts.labels(model).inc()
        self._draft_tokens.labels(model).inc(num_draft_tokens)
        self._accepted_tokens.labels(model).inc(num_accepted)
        for position in range(num_accepted):
            self._accepted_per_pos.labels(model, str(position)).inc()

    def record_next_round(self, outcome: str) -> None:
        self._next_round.labels(self.model_name, outcome).inc()

    def record_step_times(self, times: StepTimes) -> None:
        for name, part in self._step_parts.items():
            part.observe(getattr(times, name))

    def in_flight(self):
        """Context manager counting a generation as running while inside it."""
        return self._running.labels(self.model_name).track_inprogress()

    def record_first_token(self, seconds: float) -> None:
        self._ttft.labels(self.model_name).observe(seconds)

    def record_request(self, finish_reason: str, prompt_tokens: int, generation_tokens: int,
                       e2e_seconds: float) -> None:
        model = self.model_name
        self._finished.labels(model, finish_reason).inc()
        self._prompt_tokens.labels(model).inc(prompt_tokens)
        self._generation_tokens.labels(model).inc(generation_tokens)
        self._e2e.labels(model).observe(e2e_seconds)

    def record_error(self, error_type: str) -> None:
        self._errors.labels(self.model_name, error_type).inc()

    def record_inter_token_latency(self, seconds: float) -> None:
        self._itl.observe(seconds)
        self._tpot.observe(seconds)

    def record_phases(self, queue_seconds: float | None, prefill_seconds: float | None, decode_seconds: float,
                      num_generated: int) -> None:
        """A request's phases once it ends; queue and prefill times are None when
        its verifier did not report them."""
        self._decode.observe(decode_seconds)
        if num_generated > 1:
            self._request_tpot.observe(decode_seconds / (num_generated - 1))
        if queue_seconds is not None:
            self._queue.observe(queue_seconds)
        if prefill_seconds is not None:
            self._prefill.observe(prefill_seconds)
            self._inference.observe(prefill_seconds + decode_seconds)

    def add_verifiers_serving(self, count: Callable[[], int]) -> None:
        """Exports how many verifiers get new sequences, read from `count` at each scrape."""
        gauge = Gauge("speclane:verifiers_serving", "Verifiers this gateway sends new sequences to (SERVING at "
                      "the last health check, and no session found them gone since).", ["model_name"],
                      registry=self.registry)
        gauge.labels(self.model_name).set_function(count)

    def add_verifier_loads(self, loads: LoadSource) -> None:
        """Exports the verifiers' load, read from `loads` at each scrape."""
        self.registry.register(_VerifierLoadCollector(self.model_name, loads))

    def render(self) -> bytes:
        """Prometheus text exposition of this registry."""
        return prometheus_client.generate_latest(self.registry)


class SequenceTimer:
    """One sequence's timeline, from its verifier's answers as they reach the
    gateway, in vLLM's terms: queue and prefill times come with the prefill
    answer; decode time runs from the first token to the last; each later
    answer that commits tokens is one inter-token latency, however many tokens
    it commits (vLLM counts a step the same way)."""

    def __init__(self, metrics: GatewayMetrics, clock: Callable[[], float] = time.monotonic):
        self._metrics = metrics
        self._clock = clock
        self._first: float | None = None  # None until the first token, and again once recorded
        self._last = 0.0
        self._generated = 0
        self._phases: tuple[float | None, float | None] = (None, None)

    def prefilled(self, num_tokens: int, queue_seconds: float | None, prefill_seconds: float | None) -> None:
        self._first = self._last = self._clock()
        self._generated = num_tokens
        self._phases = (queue_seconds, prefill_seconds)

    def stepped(self, num_tokens: int) -> None:
        if not num_tokens:
            return
        now = self._clock()
        self._metrics.record_inter_token_latency(now - self._last)
        self._last = now
        self._generated += num_tokens

    def close(self) -> None:
        """Records the request's phases, however it ended (finished, stopped by the
        gateway, aborted), once it had its first token."""
        if self._first is not None:
            self._metrics.record_phases(*self._phases, self._last - self._first, self._generated)
            self._first = None


class _VerifierLoadCollector:
    """vLLM's scheduler and cache metrics summed over the verifiers. Gauges come
    from the verifiers that answered the last poll; counters also keep the last
    totals of those that did not, so an outage does not look like a counter reset."""

    def __init__(self, model_name: str, loads: LoadSource):
        self._model_name = model_name
        self._loads = loads

    def collect(self) -> Iterator:
        loads = self._loads()
        fresh = [load for load, answered in loads if answered]
        labels = ["model_name"]
        value = [self._model_name]
        gauges = {
            "vllm:num_requests_waiting": ("Sequences waiting for KV space on the verifiers.", "num_waiting"),
            "speclane:verifier_requests_running": ("Sequences holding KV space on the verifiers (the gateway's "
                                                   "vllm:num_requests_running also counts those waiting).",
                                                   "num_running"),
        }
        for name, (doc, field) in gauges.items():
            family = GaugeMetricFamily(name, doc, labels=labels)
            if fresh:
                family.add_metric(value, sum(getattr(load, field) for load in fresh))
            yield family
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "Share of the verifiers' KV budget held by running "
                                  "sequences (0 to 1).", labels=labels)
        budget = sum(load.kv_max_tokens for load in fresh)
        if budget:
            usage.add_metric(value, sum(load.kv_used_tokens for load in fresh) / budget)
        yield usage
        counters = {
            "vllm:num_preemptions": ("Sequences preempted on the verifiers.", "num_preemptions"),
            "vllm:prefix_cache_queries": ("Prompt tokens looked up in the verifiers' prefix caches.",
                                          "prefix_cache_queries"),
            "vllm:prefix_cache_hits": ("Prompt tokens found in the verifiers' prefix caches.", "prefix_cache_hits"),
        }
        for name, (doc, field) in counters.items():
            family = CounterMetricFamily(name, doc, labels=labels)
            if loads:
                family.add_metric(value, sum(getattr(load, field) for load, _ in loads))
            yield family
