"""A deterministic simulation of the propose/verify loop's surroundings, for
replaying recorded steps: the real drafter core drafts, a fake verifier
verifies greedily against a recorded reply (and offers, looks up and drafts
with a scripted head as the real one would), and a fake clock times the steps.
What the loop asks of the drafter and sends the verifier at each step is its
decision log; tests/gateway/data/planner_steps.json holds the logs the loop
produced when they were recorded, and test_planner_replay.py checks that the
loop still decides the same.

A change of a decision is measured first, each scenario's simulated time per token
before and after, then recorded again:
    .venv/bin/python -m tests.gateway.step_replay measure
    .venv/bin/python -m tests.gateway.step_replay record tests/gateway/data/planner_steps.json
"""

import asyncio
import json
import random
import sys
from dataclasses import dataclass

from drafter_service.engine import step_budget
from drafter_service.service import draft_to_proto
from gateway.metrics import GatewayMetrics
from gateway.orchestrator import Orchestrator
from gateway.planner import PlannerPolicy
from gateway.types import GenerationRequest
from protos.common.v1 import common_pb2
from protos.verifier.v1 import verifier_pb2
from speclane.speculation import MAX_BATCH_SIZE, DrafterLimits, SpeculationSettings
from speclane.tokens import common_prefix
from verifier_service.prompt_lookup import lookup_draft

# The verifier's measured cost of a draft token by batch size, as its ModelInfo reports it.
TOKEN_COSTS = ((1, 0.17), (16, 0.45), (64, 1.1))
FORWARD_SECONDS, FORWARD_PER_DRAFT_TOKEN, HEAD_SECONDS, DRAFTER_SECONDS = 0.040, 0.003, 0.005, 0.0001


@dataclass(frozen=True)
class Scenario:
    name: str
    dataset: str
    method: str
    policy: dict  # the loop's server-wide choices
    running: tuple[int, ...] = (1,)  # sequences on the verifier, by step (cycled)
    network_seconds: float = 0.0002  # the round trip's wait beyond the verifier's own time
    k: int | None = None
    prediction: bool = False  # the reply itself, with edits, as the predicted output


SHIPPED = {}  # the policy as it ships
BUSY = (1, 4, 12, 24, 40, 64, 33, 16, 2)
SCENARIOS = tuple(
    [Scenario(f"{method}-{dataset}", dataset, method, SHIPPED)
     for method in ("suffix", "ngram", "hybrid", "eagle3") for dataset in ("code-edit", "chat", "agent", "novel")]
    + [Scenario(f"{method}-{dataset}-busy", dataset, method, SHIPPED, BUSY)
       for method in ("suffix", "hybrid") for dataset in ("code-edit", "chat", "novel")]
    + [Scenario(f"suffix-{dataset}-remote-{ms}ms", dataset, "suffix", SHIPPED, network_seconds=ms / 1000)
       for dataset in ("code-edit", "chat", "agent") for ms in (2, 12)]
    + [Scenario("suffix-code-edit-prediction", "code-edit", "suffix", SHIPPED, prediction=True),
       Scenario("ngram-chat-k4", "chat", "ngram", SHIPPED, k=4),
       Scenario("suffix-chat-disable-by-load", "chat", "suffix",
                {"draft_tokens_by_load": ((33, MAX_BATCH_SIZE, 0),)}, BUSY),
       Scenario("suffix-code-edit-by-load", "code-edit", "suffix",
                {"draft_tokens_by_load": ((12, 39, 4), (40, MAX_BATCH_SIZE, 0))}, BUSY),
       Scenario("suffix-code-edit-lookup-on", "code-edit", "suffix", {"lookup": "on"}),
       Scenario("suffix-agent-plain", "agent", "suffix", {"next_round": False, "lookup": "off", "break_even": False}),
       Scenario("eagle-code-edit-busy", "code-edit", "eagle", SHIPPED, BUSY)]
)


def synthetic_traces(seed: int = 0) -> dict[str, list[tuple[list[int], list[int]]]]:
    """(prompt, reply) pairs, three per data set: a file re-emitted with edits, a chat whose
    phrases recur, an agent loop re-emitting one tool call with small changes, and novel text."""
    rng = random.Random(seed)

    def words(n: int) -> list[int]:
        return [rng.randrange(100, 1000) for _ in range(n)]

    traces: dict[str, list[tuple[list[int], list[int]]]] = {name: [] for name in ("code-edit", "chat", "agent",
                                                                                   "novel")}
    for _ in range(3):
        lines = [words(6) for _ in range(8)]
        file = sum(((lines[i % 6] if i % 4 == 3 else lines[i]) for i in range(8)), []) + words(2)
        edited = list(file)
        for _ in range(3):
            at = rng.randrange(len(edited) - 3)
            edited[at:at + 2] = words(rng.randrange(1, 4))
        traces["code-edit"].append((words(8) + file + words(4), words(3) + edited[:70]))
        phrases = [words(rng.randrange(3, 6)) for _ in range(5)]
        reply = []
        while len(reply) < 60:
            reply += rng.choice(phrases) if rng.random() < 0.5 else words(rng.randrange(1, 5))
        traces["chat"].append((words(30) + phrases[0] + words(10), reply[:60]))
        traces["novel"].append((words(40), words(50)))
    template = [7, 8, 9] + words(40) + [10, 11]
    for turn in range(3):
        call = list(template)
        call[5 + 11 * turn: 8 + 11 * turn] = words(3)
        traces["agent"].append((words(20) + template + words(5), call))
    return traces


START_SECONDS = 1000.0


class Clock:
    def __init__(self):
        self.now = START_SECONDS

    def perf_counter(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


def _answer(tokens: list[int], accepted: int, committed_len: int, finished: bool, drafted: int, running: int,
            head: bool) -> verifier_pb2.SessionResponse:
    forward = FORWARD_SECONDS + FORWARD_PER_DRAFT_TOKEN * drafted
    head_seconds = HEAD_SECONDS if head else 0.0
    return verifier_pb2.SessionResponse(
        token_ids=tokens, num_accepted_draft_tokens=accepted, committed_len=committed_len,
        finish_reason=common_pb2.FINISH_REASON_LENGTH if finished else common_pb2.FINISH_REASON_UNSPECIFIED,
        num_draft_tokens=drafted, forward_seconds=forward, step_seconds=forward + head_seconds + 0.0002,
        head_draft_seconds=head_seconds, num_running=running)


class FakeVerifierSession:
    """Verifies greedily against the recorded reply; takes offers and looks up as the verifier does."""

    def __init__(self, prompt: list[int], reply: list[int], scenario: Scenario, k: int, clock: Clock, log: list):
        self._prompt, self._reply, self._scenario, self._k = prompt, reply, scenario, k
        self._clock, self._log = clock, log
        self._position = 0  # reply tokens committed
        self._answers = 0
        self._pending: verifier_pb2.SessionResponse | None = None
        self._head_steps = scenario.method != "none" and scenario.method not in ("suffix", "ngram")

    def _running(self) -> int:
        return self._scenario.running[self._answers % len(self._scenario.running)]

    async def prefill(self, request) -> verifier_pb2.SessionResponse:
        self._position = 1
        self._answers = 1
        self._clock.now += 0.1
        return _answer(self._reply[:1], 0, len(self._prompt) + 1, len(self._reply) == 1, 0, self._running(),
                       False)

    def _head_draft(self) -> list[int]:
        """A head that is right up to a position that moves with the sequence."""
        draft = list(self._reply[self._position:self._position + self._k])
        wrong = (self._position * 7) % (self._k + 2)
        if wrong < len(draft):
            draft[wrong] = 1
        return draft

    def _step(self, draft_tokens: list[int], head: bool) -> verifier_pb2.SessionResponse:
        left = len(self._reply) - self._position
        draft_tokens = draft_tokens[:left - 1]
        accepted = common_prefix(draft_tokens, self._reply[self._position:])
        tokens = list(self._reply[self._position:self._position + accepted + 1])
        self._position += len(tokens)
        self._answers += 1
        return _answer(tokens, accepted, len(self._prompt) + self._position, self._position == len(self._reply),
                       len(draft_tokens), self._running(), head)

    def _run(self, draft_tokens: list[int], head: bool, next_round) -> None:
        answer = self._step(draft_tokens, head)
        if next_round is not None and not answer.finish_reason:
            hit = next((c.draft for c in next_round.continuations if c.draft.committed_len == answer.committed_len
                        and c.bonus_token_id == answer.token_ids[-1]), None)
            if hit is not None:
                answer.next_round_hit = True
                self._ahead = (list(hit.token_ids), False)
            elif next_round.lookup_tokens:
                looked_up = lookup_draft(self._prompt + self._reply[:self._position], next_round.lookup_tokens)
                answer.next_round_hit = True
                answer.lookup_draft.CopyFrom(common_pb2.Draft(token_ids=looked_up,
                                                              committed_len=answer.committed_len))
                self._ahead = (looked_up, False)
            elif next_round.run_ahead:
                answer.next_round_hit = True
                self._ahead = ([], False)
        self._pending = answer

    async def send_verify(self, draft, use_head_draft: bool = False, next_round=None) -> None:
        tokens = self._head_draft() if use_head_draft else list(draft.token_ids)
        self._log.append(["verify", "head" if use_head_draft else tokens, _offers(next_round)])
        self._run(tokens, use_head_draft, next_round)

    async def send_offer(self, next_round) -> None:
        self._log.append(["offer", _offers(next_round)])
        tokens, head = self._ahead
        self._run(tokens, head, next_round)

    async def answer(self) -> verifier_pb2.SessionResponse:
        answer, self._pending = self._pending, None
        self._clock.now += answer.step_seconds + self._scenario.network_seconds
        return answer

    def close(self) -> None:
        pass


def _offers(next_round) -> list:
    if next_round is None:
        return []
    return [next_round.lookup_tokens, [[c.bonus_token_id, c.draft.committed_len - next_round.step_committed_len,
                                        list(c.draft.token_ids)] for c in next_round.continuations],
            *(["run_ahead"] if next_round.run_ahead else [])]


class FakeVerifiers:
    def __init__(self, session: FakeVerifierSession):
        self._session = session
        self.addresses = ("fake",)

    def open(self, request_id: str, prompt_token_ids: list[int]):
        return 0, self._session

    def release(self, index: int) -> None:
        pass

    def mark_down(self, index: int) -> None:
        pass


class FakeDrafterSession:
    def __init__(self, core, seq_id: int, clock: Clock, log: list):
        self._core, self._seq_id, self._clock, self._log = core, seq_id, clock, log
        self.alive = True

    async def propose(self, committed: list[int], committed_len: int, max_spec_factor: float | None = None,
                      min_token_prob: float | None = None) -> common_pb2.Draft:
        self._log.append(["propose", len(committed)])
        self._clock.now += DRAFTER_SECONDS
        result = self._core.step([self._seq_id], [list(committed)], [step_budget(max_spec_factor, min_token_prob)])[0]
        return draft_to_proto(result, committed_len)

    async def finish(self, committed: list[int], committed_len: int) -> None:
        if committed:
            self._core.step([self._seq_id], [list(committed)])
        self._core.stop_request(self._seq_id)

    def close(self) -> None:
        pass


class FakeDrafter:
    """The real drafter core, one tenant, requests in order (its global tree learns across them)."""

    def __init__(self, clock: Clock):
        from drafter_service.engine import DraftEngine

        limits = DrafterLimits()
        self._engine = DraftEngine(limits.max_tree_depth, limits.max_cached_requests)
        self._clock = clock
        self.log: list = []

    async def open(self, request: GenerationRequest, lookahead: bool = False):
        k = request.speculation.num_speculative_tokens
        settings = SpeculationSettings(method=request.speculation.drafter_method,
                                       num_speculative_tokens=k)
        seq_id = self._engine.start(request.prompt_token_ids, settings, "", min(k + 1, 64) if lookahead else 0)
        return FakeDrafterSession(self._engine.core, seq_id, self._clock, self.log)


def predicted(reply: list[int]) -> tuple[int, ...]:
    """The reply with two edits, as a client's predicted output."""
    edited = list(reply)
    edited[10:12] = [2, 3, 4]
    edited[40:41] = []
    return tuple(edited)


async def run_scenario(scenario: Scenario, traces: dict, monkeypatch_time) -> list:
    """Each request's decision log: what the loop asked the drafter and sent the verifier, step by step."""
    clock = Clock()
    monkeypatch_time(clock)
    drafter = FakeDrafter(clock)
    logs = []
    for number, (prompt, reply) in enumerate(traces[scenario.dataset]):
        log: list = []
        drafter.log = log
        session = FakeVerifierSession(prompt, reply, scenario, 0, clock, log)
        orchestrator = Orchestrator(FakeVerifiers(session), drafter, GatewayMetrics("replay"),
                                    PlannerPolicy(draft_token_costs=TOKEN_COSTS, **scenario.policy))
        speculation = SpeculationSettings(method=scenario.method, num_speculative_tokens=scenario.k)
        speculation = speculation.with_draft_length(None)
        session._k = speculation.num_speculative_tokens
        request = GenerationRequest(f"{scenario.name}-{number}", list(prompt), len(reply), speculation,
                                    prediction_token_ids=predicted(reply) if scenario.prediction else ())
        output = []
        async for delta in orchestrator.generate(request):
            output += delta.token_ids
            usage = delta.speculation
        assert output == reply, scenario.name
        for _ in range(3):  # the drafter session's finish, in the background
            await asyncio.sleep(0)
        logs.append({"log": log, "usage": list(usage.__dict__.values())})
    return logs


def patch_time(clock: Clock) -> None:
    import gateway.orchestrator

    gateway.orchestrator.time = clock


async def record(path: str) -> None:
    traces = synthetic_traces()
    recorded = {"traces": traces, "scenarios": {}}
    for scenario in SCENARIOS:
        recorded["scenarios"][scenario.name] = await run_scenario(scenario, traces, patch_time)
    with open(path, "w") as out:
        json.dump(recorded, out, separators=(",", ":"))


async def measure() -> None:
    """Each scenario's simulated milliseconds per token, on the fake clock."""
    traces, clocks = synthetic_traces(), []
    for scenario in SCENARIOS:
        await run_scenario(scenario, traces, lambda clock: (patch_time(clock), clocks.append(clock)))
        tokens = sum(len(reply) for _, reply in traces[scenario.dataset])
        print(f"{scenario.name}\t{(clocks[-1].now - START_SECONDS) / tokens * 1e3:.3f}")


if __name__ == "__main__":
    from speclane.log import configure_logging

    configure_logging("step-replay", "warning")  # not a line per step
    asyncio.run(record(sys.argv[2]) if sys.argv[1] == "record" else measure())
