"""Greedy output with speculation equals greedy output without, token for token,
through the real drafter, verifier and gateway processes."""

import pytest

from gateway.client import GenerationClient
from tests.e2e.prompts import code_edit_messages, humaneval_messages, sharegpt_messages

pytestmark = pytest.mark.e2e
MAX_TOKENS = 40
PROMPTS = [("humaneval", i) for i in range(10)] + [("sharegpt", i) for i in range(10)]
SPECULATION = {
    "suffix": {"method": "suffix"},
    # The stack names k = 8; suffix decoding's own default is the tree depth.
    "suffix-24": {"method": "suffix", "num_speculative_tokens": 24},
    "ngram": {"method": "ngram"},
    "none": {"method": "none"},
}


@pytest.fixture(scope="module")
def prompts():
    return {"humaneval": humaneval_messages(10), "sharegpt": sharegpt_messages(10)}


@pytest.fixture(scope="module")
def client(stack):
    with GenerationClient(stack.gateway.grpc_address) as client:
        yield client


@pytest.mark.parametrize("source,index", PROMPTS, ids=[f"{s}-{i}" for s, i in PROMPTS])
def test_speculative_greedy_output_equals_plain(client, prompts, source, index):
    messages = prompts[source][index]
    # Speculative runs go first, so the suffix drafter cannot simply replay this prompt's plain answer.
    runs = {name: client.generate(messages=messages, max_tokens=MAX_TOKENS, temperature=0.0, speculation=spec)
            for name, spec in SPECULATION.items()}
    plain = runs["none"]
    assert plain.usage.draft_tokens == 0 and plain.usage.verify_steps > 0
    assert len(plain.token_ids) > 0
    for name in ("suffix", "suffix-24", "ngram"):
        assert runs[name].token_ids == plain.token_ids, f"{name} changed the output"
        assert runs[name].text == plain.text


def test_speculation_accepts_tokens_on_repetitive_code(client):
    result = client.generate(messages=code_edit_messages(), max_tokens=96, temperature=0.0,
                             speculation=SPECULATION["suffix"])
    plain = client.generate(messages=code_edit_messages(), max_tokens=96, temperature=0.0,
                            speculation=SPECULATION["none"])
    assert result.token_ids == plain.token_ids
    assert result.usage.accepted_tokens > 0
    # Accepted drafts mean fewer verify steps than tokens.
    assert result.usage.verify_steps < plain.usage.verify_steps
    # Next-round drafts hit where the draft and the drafter's next token were right; where they missed, the
    # verifier's own lookups (shipped on where the measured round trip makes them pay) may start the step too.
    # Only the step after the prefill always waits.
    assert 0 < result.usage.next_round_steps <= result.usage.verify_steps - 1

