import dataclasses

import pytest

from speclane.models import DEFAULT_MODEL, resolve_model
from speclane.net import free_port
from tests.e2e.qwen_template import qwen25_chat_template
from tests.e2e.stack import Stack, start_stack


@pytest.fixture(scope="session")
def model_dir():
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def stack(model_dir, tmp_path_factory):
    # As shipped: the step planner's policies all on (the verifier's own lookups engage where the
    # measured round trip makes them pay; test_verifier_lookups.py forces them on).
    running = start_stack(model_dir, tmp_path_factory.mktemp("stack-logs"),
                          speculative_config='{"method": "suffix", "num_speculative_tokens": 8}')
    yield running
    running.stop()


@pytest.fixture(scope="module")
def tools_gateway(stack, tmp_path_factory):
    """A second gateway on the same verifier and drafter, rendering chats with Qwen2.5's template
    (SmolLM2 speaks the same ChatML, but its own template has no tools)."""
    gateway = dataclasses.replace(stack.gateway, port=free_port(), grpc_address=f"127.0.0.1:{free_port()}",
                                  chat_template=str(qwen25_chat_template()))
    tools_stack = Stack(stack.drafter, stack.verifier, gateway, tmp_path_factory.mktemp("tools-gateway"))
    tools_stack.start_service("gateway")
    try:
        tools_stack.wait_ready()
        yield tools_stack
    finally:
        tools_stack.stop()
