"""Prometheus metrics of the gateway, under vLLM's names where vLLM has one
(dashboards built for vLLM read them unchanged), in a registry of our own."""

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


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
        self._prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of generations.")
        self._generation_tokens = counter("vllm:generation_tokens", "Generated tokens returned.")
        self._running = Gauge("vllm:num_requests_running", "Generations in flight.", labels,
                              registry=self.registry)
        self._ttft = Histogram("vllm:time_to_first_token_seconds", "Time to the first generated token.",
                               labels, buckets=TTFT_BUCKETS, registry=self.registry)
        self._e2e = Histogram("vllm:e2e_request_latency_seconds", "Generation latency, start to finish.",
                              labels, buckets=E2E_BUCKETS, registry=self.registry)

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

    def render(self) -> bytes:
        """Prometheus text exposition of this registry."""
        return prometheus_client.generate_latest(self.registry)
