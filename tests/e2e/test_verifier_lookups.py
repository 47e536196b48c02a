"""The verifier's own lookups (NextRound.lookup_tokens) through the real stack: steps it drafts
itself leave greedy output unchanged."""

import re
import urllib.request

import pytest

from gateway.client import GenerationClient
from tests.e2e.prompts import code_edit_messages, humaneval_messages
from tests.e2e.stack import start_stack

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    """Lookups always on (as shipped, "auto" looks up where it measures that it pays)."""
    running = start_stack(model_dir, tmp_path_factory.mktemp("lookups"),
                          speculative_config='{"method": "suffix", "num_speculative_tokens": 8}',
                          speculation_debug='{"lookup": "on"}')
    yield running
    running.stop()


def test_steps_the_verifier_drafts_itself_leave_greedy_output_unchanged(stack):
    requests = [code_edit_messages(), *humaneval_messages(1)]
    with GenerationClient(stack.gateway.grpc_address) as client:
        for messages in requests:
            result = client.generate(messages=messages, max_tokens=64, temperature=0.0,
                                     speculation={"method": "suffix"})
            plain = client.generate(messages=messages, max_tokens=64, temperature=0.0,
                                    speculation={"method": "none"})
            assert result.token_ids == plain.token_ids
    metrics = urllib.request.urlopen(stack.base_url.removesuffix("/v1") + "/metrics", timeout=10).read().decode()
    looked_up = re.search(r'speclane:next_round_offers_total\{model_name="[^"]+",outcome="looked_up"\} (\S+)', metrics)
    assert float(looked_up.group(1)) > 0
