"""The gateway's /metrics is enough for a vLLM dashboard: after real requests
through the three real processes it carries the verifier's load (GetLoad,
polled) and each request's phases; GetModelInfo reports the live backends."""

import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.client import GenerationClient

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
LABELS = (("model_name", MODEL),)


def scrape(stack) -> dict:
    base = f"http://{stack.gateway.host}:{stack.gateway.port}"
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_a_dashboard_reads_everything_from_the_gateway(stack):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
    # Longer than a KV block (64 tokens): a follow-up turn can reuse it.
    first = [{"role": "user", "content": "Here is a list of fruits: apple, banana, cherry, date, elderberry, fig, "
                                         "grape, honeydew, kiwi, lemon, mango, nectarine, orange, papaya, quince, "
                                         "raspberry, strawberry, tangerine. Which of them are yellow?"}]
    reply = client.chat.completions.create(model=MODEL, messages=first, max_tokens=24, temperature=0)
    follow_up = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "And one about the mountains."}]
    second = client.chat.completions.create(model=MODEL, messages=follow_up, max_tokens=24, temperature=0)
    prompt_tokens = reply.usage.prompt_tokens + second.usage.prompt_tokens
    deadline = time.monotonic() + 10
    while True:  # the gateway polls the verifier's load every second
        metrics = scrape(stack)
        if metrics.get(("vllm:prefix_cache_queries_total", LABELS), 0) >= prompt_tokens:
            break
        assert time.monotonic() < deadline, "the verifier's load never reached the gateway's /metrics"
        time.sleep(0.2)
    assert metrics[("vllm:prefix_cache_hits_total", LABELS)] >= 64  # the follow-up reused the first turn's KV
    assert 0 <= metrics[("vllm:kv_cache_usage_perc", LABELS)] <= 1
    assert metrics[("vllm:num_requests_waiting", LABELS)] == 0
    assert ("vllm:num_preemptions_total", LABELS) in metrics
    for phase in ("queue", "prefill", "decode", "inference"):
        assert metrics[(f"vllm:request_{phase}_time_seconds_count", LABELS)] >= 2, phase
    assert metrics[("vllm:request_prefill_time_seconds_sum", LABELS)] > 0
    assert metrics[("vllm:inter_token_latency_seconds_count", LABELS)] >= 2


def test_model_info_over_grpc(stack):
    with GenerationClient(stack.gateway.grpc_address) as client:
        info = client.model_info()
    assert info.model_name == MODEL and info.vocab_size == 49152
    assert info.default_speculation["method"] == "suffix"
    assert info.default_speculation["num_speculative_tokens"] == 8  # as the stack's --speculative-config names it
    assert (info.num_verifiers, info.num_verifiers_serving) == (1, 1)
    assert info.drafter_configured and info.drafter_reachable
