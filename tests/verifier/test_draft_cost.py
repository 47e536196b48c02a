"""The verifier's measure of what a draft token adds to a verify step."""

import time

import pytest

from tests.verifier.conftest import make_engine
from verifier_service.draft_cost import measure_token_cost


def test_the_token_cost_is_the_extra_step_time_per_draft_token(runner, monkeypatch):
    """A verify step made to take 20 ms plus 10 ms per draft token: each token costs about half a plain step."""
    engine = make_engine(runner)
    forward = engine.verify

    def slowed(seq, draft):
        time.sleep(0.02 + 0.01 * len(draft.token_ids))
        return forward(seq, draft)

    monkeypatch.setattr(engine, "verify", slowed)
    assert measure_token_cost(engine) == pytest.approx(0.5, abs=0.1)
    assert engine.num_live == 0 and engine.pool.used_blocks == 0  # its sequence is gone


def test_the_verifier_reads_the_token_cost_of_a_speculative_config():
    from verifier_service.config import draft_settings

    assert draft_settings('{"method": "eagle3", "model": "/h"}').draft_token_cost is None  # measured
    assert draft_settings('{"method": "eagle3", "model": "/h", "draft_token_cost": 0}').draft_token_cost == 0.0
    for wrong in ('"cheap"', "-0.1", "true", "11"):
        with pytest.raises(ValueError, match="draft_token_cost must be"):
            draft_settings(f'{{"method": "mtp", "draft_token_cost": {wrong}}}')
