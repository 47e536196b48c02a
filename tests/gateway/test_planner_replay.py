"""The step planner's decisions replayed on recorded steps (step_replay.py): on
synthetic code edits, chats, agent loops and novel text, with every method,
several loads and round trips, each request's drafter asks and verifier
messages (drafts, offers, lookups) must be those recorded."""

import json
import pathlib

import pytest

from tests.gateway import step_replay

RECORDED = json.loads((pathlib.Path(__file__).parent / "data" / "planner_steps.json").read_text())
pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("scenario", step_replay.SCENARIOS, ids=lambda scenario: scenario.name)
async def test_the_loop_decides_each_step_as_recorded(scenario, monkeypatch):
    import gateway.orchestrator

    replayed = await step_replay.run_scenario(
        scenario, RECORDED["traces"], lambda clock: monkeypatch.setattr(gateway.orchestrator, "time", clock))
    for number, (got, recorded) in enumerate(zip(replayed, RECORDED["scenarios"][scenario.name], strict=True)):
        for step, (event, expected) in enumerate(zip(got["log"], recorded["log"], strict=True)):
            assert event == expected, f"request {number}, event {step}"
        assert got["usage"] == recorded["usage"]
