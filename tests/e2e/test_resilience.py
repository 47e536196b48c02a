"""Failure of the drafter costs speed, never a request or a token."""

import openai
import pytest
from grpc_health.v1 import health_pb2

from tests.e2e.stack import grpc_health, start_stack

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "Write a Python function that checks whether a number is prime, "
                                        "with a docstring and three examples."}]


def test_every_service_reports_serving(stack):
    for address in (stack.drafter.address, stack.verifier.address, stack.gateway.grpc_address):
        assert grpc_health(address) == health_pb2.HealthCheckResponse.SERVING


def test_killing_the_drafter_mid_generation_keeps_the_output(model_dir, tmp_path):
    # No verifier lookups: with the drafter gone they would still draft, and this test counts the drafts.
    own = start_stack(model_dir, tmp_path,
                      speculative_config='{"method": "ngram", "num_speculative_tokens": 4}',
                      speculation_debug='{"lookup": "off"}')
    try:
        client = openai.OpenAI(base_url=own.base_url, api_key="unused", max_retries=0, timeout=300)
        request = {"model": MODEL, "messages": MESSAGES, "max_tokens": 48, "temperature": 0}
        plain = client.chat.completions.create(**request, extra_body={"speculation": {"method": "none"}})
        pieces = []
        stream = client.chat.completions.create(**request, stream=True)
        for chunk in stream:
            pieces.append(chunk.choices[0].delta.content or "")
            if len(pieces) == 8:
                own.kill("drafter")
        assert own.processes["drafter"].returncode is not None
        assert "".join(pieces) == plain.choices[0].message.content
        # Later requests still succeed, without a drafter at all.
        again = client.chat.completions.create(**request)
        assert again.choices[0].message.content == plain.choices[0].message.content
        assert again.usage.model_extra["speculation"]["draft_tokens"] == 0
    finally:
        own.stop()
