"""A named attention backend through the real drafter, verifier and gateway:
SmolLM2 served with --attention-backend FLEX_ATTENTION (eager on this CPU, the
call CUDA compiles) passes the start-up check against transformers and decodes
greedily with suffix drafts exactly what it decodes alone."""

import pytest

from gateway.client import GenerationClient
from tests.e2e.prompts import code_edit_messages
from tests.e2e.stack import start_stack

pytestmark = pytest.mark.e2e


def test_flex_attention_serves_speculation_losslessly(model_dir, tmp_path):
    # Eager FlexAttention costs milliseconds a call and scores every slot of the cache: a small cache, a set
    # draft-token cost (not one measured at start), one prompt and one draft method keep the test short.
    stack = start_stack(model_dir, tmp_path, speculation_debug='{"draft_token_cost": 0.3}',
                        verifier_options={"attention_backend": "FLEX_ATTENTION", "num_gpu_blocks_override": 96})
    try:
        assert '"attention_backend": "flex-attention"' in stack.logs("verifier")
        messages = code_edit_messages()
        with GenerationClient(stack.gateway.grpc_address) as client:
            plain = client.generate(messages=messages, max_tokens=24, temperature=0.0, speculation={"method": "none"})
            suffix = client.generate(messages=messages, max_tokens=24, temperature=0.0,
                                     speculation={"method": "suffix"})
    finally:
        stack.stop()
    assert suffix.token_ids == plain.token_ids
    assert suffix.usage.draft_tokens > 0
