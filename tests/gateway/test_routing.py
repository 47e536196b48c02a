"""Prefix affinity: a follow-up turn goes to the verifier that took its
conversation's earlier prompt, unless that one is much busier."""

import pytest

from gateway.routing import BLOCK_TOKENS, PrefixAffinity, block_prefixes
from gateway.verifier_pool import AFFINITY_SLACK, VerifierPool
from speclane.net import free_port

CONVERSATION = list(range(1000, 1000 + 3 * BLOCK_TOKENS + 10))
OTHER = list(range(5000, 5000 + 2 * BLOCK_TOKENS))


def test_prompts_sharing_whole_blocks_share_those_prefix_hashes():
    first, follow_up = block_prefixes(CONVERSATION[:130]), block_prefixes(CONVERSATION)
    assert len(first) == 2 and len(follow_up) == 3  # whole blocks only
    assert follow_up[:2] == first
    assert block_prefixes(OTHER)[0] != first[0]
    assert block_prefixes(CONVERSATION[: BLOCK_TOKENS - 1]) == []


def test_the_longest_remembered_prefix_wins_and_the_oldest_are_forgotten_first():
    affinity = PrefixAffinity(max_prefixes=4)
    affinity.remember(block_prefixes(CONVERSATION[: 2 * BLOCK_TOKENS]), 0)
    affinity.remember(block_prefixes(CONVERSATION), 1)  # the same first two blocks, now on 1, and a third
    assert affinity.lookup(block_prefixes(CONVERSATION + [7] * BLOCK_TOKENS)) == (1, 3)
    affinity.remember(block_prefixes(OTHER), 0)  # 5 prefixes: the conversation's first block is dropped
    assert affinity.lookup(block_prefixes(CONVERSATION[:BLOCK_TOKENS])) == (None, 0)
    assert affinity.lookup(block_prefixes(OTHER)) == (0, 2)
    affinity.forget(0)
    assert affinity.lookup(block_prefixes(OTHER)) == (None, 0)
    assert affinity.lookup(block_prefixes(CONVERSATION)) == (1, 3)


@pytest.mark.anyio
async def test_a_follow_up_turn_goes_where_its_prefix_went_unless_that_verifier_is_much_busier():
    pool = VerifierPool((f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"))  # sessions never used
    try:
        busy, _ = pool.open("a", OTHER)
        assert busy == 0
        first_turn, _ = pool.open("b", CONVERSATION[:150])
        assert first_turn == 1  # the least busy
        pool.release(busy)
        pool.release(first_turn)
        # Both idle: least busy alone would pick 0.
        held = [pool.open(f"c{i}", CONVERSATION)[0] for i in range(AFFINITY_SLACK + 1)]
        assert held == [1] * (AFFINITY_SLACK + 1)
        assert pool.open("d", CONVERSATION)[0] == 0  # 1 is now busier by more than the slack
        pool.mark_down(1)
        assert pool.open("e", CONVERSATION)[0] == 0
    finally:
        await pool.close()
