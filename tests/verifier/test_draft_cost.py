"""The verifier's measure of what a draft token adds to a verify step."""

from types import SimpleNamespace

import pytest

from tests.verifier.conftest import make_engine
from verifier_service import draft_cost
from verifier_service.draft_cost import measure_token_cost


def test_the_token_cost_is_the_extra_step_time_per_draft_token_at_each_batch_size(runner, monkeypatch):
    """Verify passes made to take 10 ms plus 5 ms per token fed, as a compute-bound pass does: alone, a
    draft token costs a third of a plain step; among 8 sequences, 0.8 of what plain steps commit. The passes
    advance the clock the measurement reads instead of sleeping, so a loaded host cannot blur the result."""
    engine = make_engine(runner)
    execute = engine.runner.execute
    now = [0.0]

    def slowed(plan):
        if plan.segments and all(segment.num_pending == 1 for segment in plan.segments):  # not a prefill
            now[0] += 0.01 + 0.005 * plan.num_tokens
        return execute(plan)

    monkeypatch.setattr(engine.runner, "execute", slowed)
    monkeypatch.setattr(draft_cost, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    assert measure_token_cost(engine) == pytest.approx(20 / (4 * 15), abs=1e-3)
    assert measure_token_cost(engine, num_sequences=8, repeats=2) == pytest.approx(160 / (4 * 50), abs=1e-3)
    assert engine.num_live == 0 and engine.blocks.used_blocks == 0  # its sequences are gone


def test_the_verifier_takes_the_token_cost_from_the_debug_setting_for_experiments():
    from verifier_service.config import VerifierConfig

    def cost(speculative_config: str, debug: str = ""):
        return VerifierConfig(model="smollm2-135m-instruct", speculative_config=speculative_config,
                              speculation_debug=debug).draft.draft_token_cost

    assert cost('{"method": "eagle3"}') is None  # measured
    assert cost('{"method": "eagle3"}', '{"draft_token_cost": 0}') == 0.0
    # Without a head too: the gateway cuts the drafter's drafts with it.
    assert cost('{"method": "suffix"}', '{"draft_token_cost": 0.25}') == 0.25
    assert cost("") is None
    for wrong in ('"cheap"', "-0.1", "true", "11"):
        with pytest.raises(ValueError, match="draft_token_cost must be"):
            cost('{"method": "mtp"}', f'{{"draft_token_cost": {wrong}}}')
