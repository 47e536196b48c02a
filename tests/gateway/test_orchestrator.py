"""The propose/verify loop, the drafter and verifier clients and the Generate
API, over fake drafter and verifier servers in this process (fake_services.py)."""

import asyncio
import dataclasses

import grpc
import pytest

from gateway.errors import InvalidRequest, Overloaded, Unavailable
from gateway.estimates import RoundTrip, lookup_loss
from gateway.planner import EXPLORE_EVERY, PlannerPolicy
from gateway.types import SpeculationUsage
from protos.common.v1 import common_pb2
from protos.gateway.v1 import gateway_pb2
from speclane.speculation import MAX_BATCH_SIZE, SpeculationSettings
from tests.gateway.fake_services import (
    OFFER_STEP_SECONDS,
    PROMPT,
    FakeDrafter,
    FakeVerifier,
    collect,
    eventually,
    gateway,
    generation,
    generation_api,
    target_tokens,
    tokens_of,
)
from tests.gateway.fakes import MODEL_NAME

pytestmark = pytest.mark.anyio
Code = grpc.StatusCode
TARGET = target_tokens(0, 10)  # what a 10-token generation commits, drafts or not
# A stream the client cancels between steps may end either way on the server (a race inside gRPC).
CLOSED = {"ended", "cancelled"}


def in_flight(pool) -> list[int]:
    """This gateway's sequences on each verifier, in the order the pool was given them."""
    return [verifier.in_flight for verifier in pool._verifiers.values()]


def serving(pool) -> list[bool]:
    return [verifier.serving for verifier in pool._verifiers.values()]


# Draft handling

async def test_verifier_gets_drafts_untrimmed_and_usage_counts_the_verified_draft_tokens():
    verifier = FakeVerifier(accept=4)
    async with gateway([verifier], FakeDrafter(draft_len=6)) as gw:
        deltas = await collect(gw, generation(max_tokens=10))
    assert tokens_of(deltas) == TARGET
    # Step 1 verifies all 6 drafted tokens (4 accepted); step 2 has 4 tokens left, so the
    # verifier cuts its 6-token draft to 3 (all accepted): 9 verified, not the 12 drafted.
    assert verifier.drafts == [target_tokens(1, 6), target_tokens(6, 6)]
    assert deltas[-1].finish_reason == "length"
    assert deltas[-1].speculation == SpeculationUsage(draft_tokens=9, accepted_tokens=7, verify_steps=2,
                                                      drafter_steps=2)
    text = gw.metrics.render().decode()
    for name, value in [("vllm:spec_decode_num_draft_tokens_total", 9), ("speclane:verify_steps_total", 2),
                        ("vllm:spec_decode_num_accepted_tokens_total", 7), ("vllm:spec_decode_num_drafts_total", 2)]:
        assert f'{name}{{model_name="{MODEL_NAME}"}} {value}.0' in text


# The drafter's outages cost speculation, never a request

async def test_a_slow_drafter_is_rested_and_requests_complete_without_drafts():
    verifier, drafter = FakeVerifier(), FakeDrafter()
    drafter.delay = 10.0
    async with gateway([verifier], drafter, timeout=0.25, retry_seconds=0.75) as gw:
        assert tokens_of(await collect(gw)) == TARGET
        assert verifier.drafts and not any(verifier.drafts)
        assert tokens_of(await collect(gw)) == TARGET  # within the rest: the drafter is not asked
        assert (drafter.sessions, drafter.info_calls) == (1, 1)
        drafter.delay = 0.0
        await asyncio.sleep(0.75)
        verifier.drafts.clear()
        assert tokens_of(await collect(gw)) == TARGET  # rested enough: asked again
        assert (drafter.sessions, drafter.info_calls) == (2, 2)
        assert any(verifier.drafts)


async def test_a_drafter_dying_mid_generation_costs_only_the_drafts():
    async with gateway([FakeVerifier()]) as plain:
        expected = tokens_of(await collect(plain, generation(max_tokens=20)))
    verifier, drafter = FakeVerifier(accept=1), FakeDrafter()
    drafter.fail = (Code.UNAVAILABLE, 3)
    async with gateway([verifier], drafter) as gw:
        deltas = await collect(gw, generation(max_tokens=20))
    assert tokens_of(deltas) == expected and deltas[-1].finish_reason == "length"
    assert all(verifier.drafts[:2]) and verifier.drafts[2:] and not any(verifier.drafts[2:])
    assert drafter.outcomes == ["UNAVAILABLE"]


# Status codes

@pytest.mark.parametrize("code, step, error", [
    (Code.INVALID_ARGUMENT, 0, InvalidRequest),
    (Code.INVALID_ARGUMENT, 2, InvalidRequest),
    (Code.RESOURCE_EXHAUSTED, 0, Overloaded),
    (Code.UNAVAILABLE, 1, Unavailable),
    (Code.FAILED_PRECONDITION, 1, grpc.aio.AioRpcError),  # not meant for the client: the status as it came
])
async def test_verifier_status_codes_become_client_errors(code, step, error):
    verifier = FakeVerifier()
    verifier.fail = (code, step)
    async with gateway([verifier], FakeDrafter()) as gw:
        with pytest.raises(error) as raised:
            await collect(gw)
    if error is grpc.aio.AioRpcError:
        assert raised.value.code() == code


async def test_a_verifier_ending_the_session_without_an_answer_is_an_error():
    verifier = FakeVerifier()
    verifier.quit_at = 1
    async with gateway([verifier]) as gw:
        with pytest.raises(RuntimeError, match="ended the session without answering"):
            await collect(gw)


@pytest.mark.parametrize("step", [
    # At start, the refusal reaches us before our first step is written (the prefill takes longer).
    pytest.param(0, id="at_start"),
    pytest.param(1, id="at_first_step"),
])
async def test_a_drafter_refusing_the_settings_is_a_bad_request_not_an_outage(step):
    verifier, drafter = FakeVerifier(prefill_seconds=0.2), FakeDrafter()
    drafter.fail = (Code.INVALID_ARGUMENT, step)
    async with gateway([verifier], drafter) as gw:
        deltas = []
        with pytest.raises(InvalidRequest, match="refused the speculation settings"):
            await collect(gw, into=deltas)
        assert deltas == []  # drafted before the first tokens go out
        drafter.fail = None
        assert tokens_of(await collect(gw)) == TARGET
        assert drafter.sessions == 2 and any(verifier.drafts)  # not rested


# The verifier pool's accounting on every way out

async def _complete(gw):
    await collect(gw)


async def _verifier_error(gw):
    gw.verifiers[0].fail = (Code.RESOURCE_EXHAUSTED, 2)
    with pytest.raises(Overloaded):
        await collect(gw)


async def _closed_early(gw):
    deltas = gw.orchestrator.generate(generation())
    await anext(deltas)
    await deltas.aclose()


async def _cancelled(gw):
    gw.verifiers[0].hang_at = 2
    task = asyncio.ensure_future(collect(gw))
    await gw.verifiers[0].hanging.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("exit_path, verifier_outcomes", [
    (_complete, CLOSED), (_verifier_error, {"RESOURCE_EXHAUSTED"}), (_closed_early, CLOSED),
    (_cancelled, {"cancelled"}),
], ids=["completed", "verifier_error", "closed_early", "cancelled"])
async def test_every_way_out_releases_the_verifier_and_ends_the_sessions(exit_path, verifier_outcomes):
    verifier, drafter = FakeVerifier(), FakeDrafter()
    async with gateway([verifier], drafter) as gw:
        await exit_path(gw)
        assert in_flight(gw.pool) == [0]
        await eventually(lambda: len(verifier.outcomes) == 1 and len(drafter.outcomes) == 1)
        assert verifier.outcomes[0] in verifier_outcomes


async def test_concurrent_requests_go_to_the_least_busy_verifier():
    verifiers = [FakeVerifier(), FakeVerifier()]
    for verifier in verifiers:
        verifier.hang_at = 1
    async with gateway(verifiers) as gw:
        tasks = [asyncio.ensure_future(collect(gw)) for _ in verifiers]
        await asyncio.wait_for(asyncio.gather(*(v.hanging.wait() for v in verifiers)), 2)
        assert in_flight(gw.pool) == [1, 1]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert in_flight(gw.pool) == [0, 0]
        await eventually(lambda: [v.outcomes for v in verifiers] == [["cancelled"], ["cancelled"]])


async def test_the_least_busy_verifier_counts_other_gateways_sequences():
    """Sequences another gateway runs on a verifier, as its GetLoad counts them, weigh in the choice."""
    verifiers = [FakeVerifier(), FakeVerifier()]
    verifiers[0].num_running = 5  # none of them this gateway's
    verifiers[1].hang_at = 1
    async with gateway(verifiers) as gw:
        await gw.pool.refresh_loads()
        assert [gw.pool.busy(0), gw.pool.busy(1)] == [5, 0]
        task = asyncio.ensure_future(collect(gw))
        await asyncio.wait_for(verifiers[1].hanging.wait(), 2)
        assert in_flight(gw.pool) == [0, 1]
        assert [gw.pool.busy(0), gw.pool.busy(1)] == [5, 1]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_head_methods_output_feeds_the_drafters_trees_and_none_stays_away():
    verifier, drafter = FakeVerifier(), FakeDrafter()
    async with gateway([verifier], drafter) as gw:
        head_request, none_request = (dataclasses.replace(generation(), speculation=dataclasses.replace(
            generation().speculation, method=method)) for method in ("eagle3", "none"))
        head = await collect(gw, head_request)
        await collect(gw, none_request)
    assert drafter.committed == [tokens_of(head)]  # the whole output, handed over once at the end
    assert all(draft == [] for draft in verifier.drafts)  # nothing the drafter proposed was verified


async def test_no_drafts_while_the_verifier_runs_more_sequences_than_the_limit():
    verifier, policy = FakeVerifier(), PlannerPolicy(draft_tokens_by_load=((2, MAX_BATCH_SIZE, 0),))
    async with gateway([verifier], FakeDrafter(draft_len=3), policy=policy) as gw:
        alone = await collect(gw)
        assert [] not in verifier.drafts  # one sequence: within the limit
        verifier.drafts.clear()
        verifier.num_running = 2
        busy = await collect(gw)
    assert tokens_of(alone) == tokens_of(busy) == TARGET[:10]
    assert verifier.drafts and all(draft == [] for draft in verifier.drafts)


async def test_a_verifier_gone_at_prefill_fails_over_to_the_next_and_is_left_out():
    gone, alive = FakeVerifier(), FakeVerifier()
    gone.fail = (Code.UNAVAILABLE, 0)
    async with gateway([gone, alive], FakeDrafter()) as gw:
        deltas = await collect(gw)
        assert tokens_of(deltas) == TARGET[:10]
        assert serving(gw.pool) == [False, True] and in_flight(gw.pool) == [0, 0]
        assert f'speclane:verifiers_serving{{model_name="{MODEL_NAME}"}} 1.0' in gw.metrics.render().decode()
        await collect(gw)
    assert gone.outcomes == ["UNAVAILABLE"] and len(alive.outcomes) == 2


async def test_with_every_verifier_gone_at_prefill_the_request_is_unavailable():
    verifiers = [FakeVerifier(), FakeVerifier()]
    for verifier in verifiers:
        verifier.fail = (Code.UNAVAILABLE, 0)
    async with gateway(verifiers) as gw:
        with pytest.raises(Unavailable):
            await collect(gw)
        assert in_flight(gw.pool) == [0, 0]


# The public Generate API

def generate_request(**fields) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=PROMPT), **{"max_tokens": 10, **fields})


async def test_generate_api_streams_the_committed_tokens(tiny_tokenizer):
    speculation = gateway_pb2.SpeculationConfig(suffix_decoding_max_tree_depth=24)  # the drafter's own value
    async with gateway([FakeVerifier(accept=4)], FakeDrafter(max_tree_depth=24)) as gw:
        await gw.client.refresh_limits()
        async with generation_api(tiny_tokenizer, gw) as (stub, _):
            responses = [r async for r in stub.Generate(generate_request(speculation=speculation))]
    assert [token for r in responses for token in r.token_ids] == TARGET
    assert "".join(r.text for r in responses) == tiny_tokenizer.decode(TARGET)
    last = responses[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(PROMPT), 10)
    assert (last.usage.speculation.draft_tokens, last.usage.speculation.accepted_tokens,
            last.usage.speculation.verify_steps) == (9, 7, 2)


@pytest.mark.parametrize("fields, verifier_fail, code", [
    ({"max_tokens": 0}, None, Code.INVALID_ARGUMENT),
    ({"model": "gpt-4"}, None, Code.NOT_FOUND),
    ({}, (Code.RESOURCE_EXHAUSTED, 0), Code.RESOURCE_EXHAUSTED),
    ({}, (Code.INVALID_ARGUMENT, 1), Code.INVALID_ARGUMENT),
    ({}, (Code.UNAVAILABLE, 1), Code.UNAVAILABLE),
    # Beyond what the drafter's GetInfo allows:
    ({"speculation": gateway_pb2.SpeculationConfig(suffix_decoding_max_tree_depth=32)}, None, Code.INVALID_ARGUMENT),
    ({"speculation": gateway_pb2.SpeculationConfig(num_speculative_tokens=16)}, None, Code.INVALID_ARGUMENT),
], ids=["max_tokens", "model", "verifier_overloaded", "verifier_refused", "verifier_unavailable", "tree_depth",
        "speculative_tokens"])
async def test_generate_api_refusals_carry_their_status(tiny_tokenizer, fields, verifier_fail, code):
    verifier = FakeVerifier()
    verifier.fail = verifier_fail
    async with gateway([verifier], FakeDrafter(max_tree_depth=24, max_speculative_tokens=8)) as gw:
        assert await gw.client.refresh_limits() is not None
        async with generation_api(tiny_tokenizer, gw) as (stub, ctx):
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                [r async for r in stub.Generate(generate_request(**fields))]
            assert raised.value.code() == code
            assert in_flight(gw.pool) == [0] and ctx.limiter.in_flight == 0


async def test_cancelling_a_generate_call_cancels_the_sessions(tiny_tokenizer):
    verifier, drafter = FakeVerifier(), FakeDrafter()
    verifier.hang_at = 2
    async with gateway([verifier], drafter) as gw, generation_api(tiny_tokenizer, gw) as (stub, ctx):
        call = stub.Generate(generate_request())
        assert list((await call.read()).token_ids) == TARGET[:1]
        await verifier.hanging.wait()
        call.cancel()
        await eventually(lambda: len(verifier.outcomes) == 1 and len(drafter.outcomes) == 1)
        assert verifier.outcomes == ["cancelled"] and drafter.outcomes[0] in CLOSED
        assert in_flight(gw.pool) == [0] and ctx.limiter.in_flight == 0


# Next-round drafts

def lookahead(max_tokens: int = 30, k: int = 3):
    return dataclasses.replace(generation(max_tokens), speculation=SpeculationSettings(num_speculative_tokens=k))


async def test_next_round_drafts_let_the_verifier_go_on_without_a_verify():
    # The drafter drafts k + 1 + k = 7 target tokens: k to verify, the bonus, the next k.
    verifier, drafter = FakeVerifier(accept=8, step_seconds=OFFER_STEP_SECONDS), FakeDrafter(draft_len=7)
    async with gateway([verifier], drafter, policy=PlannerPolicy()) as gw:
        deltas = await collect(gw, lookahead())
    assert tokens_of(deltas) == target_tokens(0, 30)
    assert (drafter.params[0].num_speculative_tokens, drafter.lookaheads[0]) == (3, 4)
    usage = deltas[-1].speculation
    # Every step after the first ran on the offer made with the step before it: all drafts are
    # accepted and the drafter guesses each bonus token.
    assert usage.next_round_steps == usage.verify_steps - 1 > 0
    generated = 1  # the prefill's token
    for draft in verifier.drafts:  # each step's draft: the k target tokens after what was committed
        assert draft == target_tokens(generated, len(draft)) and len(draft) <= 3
        generated += len(draft) + 1
    offer = verifier.offers[0]
    assert offer.step_committed_len == len(PROMPT) + 1
    [continuation] = offer.continuations
    assert continuation.bonus_token_id == target_tokens(4, 1)[0]
    assert list(continuation.draft.token_ids) == target_tokens(5, 3)
    assert continuation.draft.committed_len == len(PROMPT) + 5


async def test_a_step_cut_short_by_the_drafters_budget_still_offers_the_path_beyond_it():
    """Suffix decoding's budget ends a step's draft where its match is short; the
    draft goes on past it (step_len), and the step after runs on that offer."""
    verifier, drafter = FakeVerifier(accept=8, step_seconds=OFFER_STEP_SECONDS), FakeDrafter(draft_len=7)
    drafter.step_len = 2
    async with gateway([verifier], drafter, policy=PlannerPolicy()) as gw:
        deltas = await collect(gw, lookahead())
    assert tokens_of(deltas) == target_tokens(0, 30)
    assert deltas[-1].speculation.next_round_steps == deltas[-1].speculation.verify_steps - 1 > 0
    assert all(len(draft) == 2 for draft in verifier.drafts[:1])  # the step's own part, not k
    [continuation] = verifier.offers[0].continuations
    assert continuation.bonus_token_id == target_tokens(3, 1)[0]
    assert list(continuation.draft.token_ids) == target_tokens(4, 3)


async def test_with_the_break_even_cut_a_step_cut_short_by_the_budget_still_offers_k_tokens():
    """The step verifies the drafter's 2 tokens; the offer after it is the next
    step's draft, held to the cut's limit (k while drafts land), not to 2."""
    verifier, drafter = FakeVerifier(accept=8, step_seconds=OFFER_STEP_SECONDS), FakeDrafter(draft_len=7)
    drafter.step_len = 2
    policy = PlannerPolicy(draft_token_costs=((1, 0.2),))
    async with gateway([verifier], drafter, policy=policy) as gw:
        deltas = await collect(gw, lookahead())
    assert tokens_of(deltas) == target_tokens(0, 30)
    assert len(verifier.drafts[0]) == 2
    [continuation] = verifier.offers[0].continuations
    assert list(continuation.draft.token_ids) == target_tokens(4, 3)


@pytest.mark.parametrize("miss", ["draft rejected", "bonus guessed wrong"])
async def test_a_next_round_miss_falls_back_to_a_verify_and_loses_nothing(miss):
    verifier = FakeVerifier(accept=2 if miss == "draft rejected" else 8, step_seconds=OFFER_STEP_SECONDS)
    drafter = FakeDrafter(draft_len=7)
    drafter.wrong_bonus = miss == "bonus guessed wrong"
    async with gateway([verifier], drafter, policy=PlannerPolicy()) as gw:
        deltas = await collect(gw, lookahead())
    assert tokens_of(deltas) == target_tokens(0, 30)
    assert deltas[-1].speculation.next_round_steps == 0
    assert len(verifier.offers) >= deltas[-1].speculation.verify_steps - 1  # offered at (nearly) every step


@pytest.mark.parametrize("right", [True, False])
async def test_a_detour_lets_the_verifier_go_on_after_a_rejected_draft_token(right):
    """The drafter's second draft token is wrong and its detour there offers the
    target's token: each step is rejected there, and the one after runs on the
    detour's draft. A detour for another token never runs, and loses nothing."""
    verifier, drafter = FakeVerifier(accept=1, step_seconds=OFFER_STEP_SECONDS), FakeDrafter(draft_len=3)
    drafter.detour_at, drafter.detour_token = 1, None if right else 998
    async with gateway([verifier], drafter, policy=PlannerPolicy()) as gw:
        deltas = await collect(gw, lookahead())
    assert tokens_of(deltas) == target_tokens(0, 30)
    usage = deltas[-1].speculation
    if right:
        # A fresh step rejects its draft at the detour; the detour's step (all target tokens) is accepted in full.
        assert usage.next_round_steps > 0 and any(draft == target_tokens(3, 3) for draft in verifier.drafts)
        detour = next(c for c in verifier.offers[0].continuations if c.draft.committed_len == len(PROMPT) + 3)
        assert (detour.bonus_token_id, list(detour.draft.token_ids)) == (target_tokens(2, 1)[0], target_tokens(3, 3))
    else:
        assert usage.next_round_steps == 0 and verifier.offers
    text = gw.metrics.render().decode()
    taken = usage.next_round_steps
    assert f'speclane:next_round_offers_total{{model_name="{MODEL_NAME}",outcome="taken"}} {taken}.0' in text
    missed = len(verifier.offers) - taken
    assert f'speclane:next_round_offers_total{{model_name="{MODEL_NAME}",outcome="missed"}} {missed}.0' in text


@pytest.mark.parametrize("mode", ["on", "off"])
async def test_with_next_round_lookup_the_verifier_starts_a_step_no_offer_foresaw(mode):
    """Every offer misses (each draft is rejected after 2 tokens); with lookups on,
    the verifier starts each such step with a draft it looked up itself, and the
    loop then offers continuations after that draft rather than sending a Verify."""
    verifier, drafter = FakeVerifier(accept=2, step_seconds=OFFER_STEP_SECONDS), FakeDrafter(draft_len=7)
    async with gateway([verifier], drafter, policy=PlannerPolicy(lookup=mode)) as gw:
        deltas = await collect(gw, lookahead())
    assert tokens_of(deltas) == target_tokens(0, 30)
    usage = deltas[-1].speculation
    text = gw.metrics.render().decode()
    looked_up = f'speclane:next_round_offers_total{{model_name="{MODEL_NAME}",outcome="looked_up"}}'
    if mode == "off":
        assert usage.next_round_steps == 0 and all(offer.lookup_tokens == 0 for offer in verifier.offers)
        assert f"{looked_up} 0.0" in text
        return
    # Only the first step after the prefill waits for a Verify.
    assert usage.next_round_steps == usage.verify_steps - 1 > 0
    assert f"{looked_up} {usage.next_round_steps}.0" in text
    assert verifier.offers[0].lookup_tokens == 3  # up to k
    # The step after a looked-up draft is offered the drafter's continuations after it: the fake's
    # lookup drafts the target's tokens, as the drafter does, so "all accepted" follows that draft.
    after_lookup = verifier.offers[1]
    assert after_lookup.step_committed_len == len(PROMPT) + 4
    assert [list(c.draft.token_ids) for c in after_lookup.continuations] == [target_tokens(8, 3)]


def test_auto_looks_drafts_up_where_the_wait_they_save_outweighs_the_tokens_they_lose():
    local, link = RoundTrip(), RoundTrip()
    for _ in range(40):
        local.observe_wait(0.001, 0.070)  # 1.4%: one host
        link.observe_wait(0.008, 0.070)  # 11%: a 5 ms link
        link.observe_step(4, None)
    assert not local.lookup_pays(EXPLORE_EVERY) and link.lookup_pays(EXPLORE_EVERY)
    assert not RoundTrip().lookup_pays(EXPLORE_EVERY)  # nothing measured yet
    # Lookups that lose a token a step against the drafter's drafts (a quarter of the step's 4)
    # cost more than the 11% they save; one step in EXPLORE_EVERY still looks up, to measure again.
    for _ in range(100):
        link.observe_step(3, 1)
    assert not link.lookup_pays(EXPLORE_EVERY)
    for _ in range(EXPLORE_EVERY):
        link.observe_step(3, None)
    assert link.lookup_pays(EXPLORE_EVERY)
    # Losing a tenth of a token a step, the same wait pays.
    for _ in range(100):
        link.observe_step(4, 0.1)
    assert link.lookup_pays(EXPLORE_EVERY)


def test_a_lookups_loss_is_what_the_drafters_draft_foresaw_of_the_committed_tokens_beyond_it():
    committed = [5, 6, 7, 8]  # the lookup's 3 tokens accepted, then the target's
    assert lookup_loss([5, 6, 7, 8, 9], 3, committed) == 1  # foresaw all 4: at least 1 more
    assert lookup_loss([5, 6], 3, committed) == -1
    assert lookup_loss([], 3, committed) == -3 and lookup_loss([5, 6, 7], 3, committed) == 0


async def test_without_next_round_drafts_none_is_offered_and_the_drafter_drafts_k():
    verifier, drafter = FakeVerifier(accept=8), FakeDrafter(draft_len=7)
    async with gateway([verifier], drafter, policy=PlannerPolicy(next_round=False, lookup="off")) as gw:
        deltas = await collect(gw, lookahead())
    assert tokens_of(deltas) == target_tokens(0, 30)
    assert (drafter.params[0].num_speculative_tokens, drafter.lookaheads[0]) == (3, 0) and not verifier.offers
    assert deltas[-1].speculation.next_round_steps == 0


# Drafts cut where they stop paying at the load (gateway/planner.py's break-even cut)

async def _draft_lengths_with_every_draft_rejected(drafter: FakeDrafter) -> list[int]:
    """Twelve tokens with the break-even cut on, every draft rejected at its first
    token; the length of each draft verified. The output must stay the target's."""
    verifier = FakeVerifier(accept=0)
    policy = PlannerPolicy(draft_token_costs=((1, 0.2),))
    async with gateway([verifier], drafter, policy=policy) as gw:
        deltas = await collect(gw, generation(max_tokens=12))
    assert tokens_of(deltas) == target_tokens(0, 12)
    return [len(draft) for draft in verifier.drafts]


async def test_drafts_that_keep_failing_stop_being_sent_and_the_output_stays():
    drafter = FakeDrafter(draft_len=4)
    lengths = await _draft_lengths_with_every_draft_rejected(drafter)
    # Whole drafts until the misses add up; then none, but a token now and then to keep learning.
    assert lengths[0] == 4 and max(lengths[3:]) == 1 and lengths.count(0) >= 6
    # A step without a drafter draft asks for none; the drafter still learns every token, in order.
    assert drafter.proposals == len(lengths) - lengths.count(0) + 1  # and the last tokens, handed over
    assert drafter.committed == [target_tokens(0, 12)]


async def test_drafts_that_land_are_kept_whole_under_load():
    verifier = FakeVerifier(accept=8)
    policy = PlannerPolicy(draft_token_costs=((1, 0.2), (4, 0.6)))
    async with gateway([verifier], FakeDrafter(draft_len=3), policy=policy) as gw:
        together = await asyncio.gather(*(collect(gw, generation(max_tokens=16)) for _ in range(4)))
    assert all(tokens_of(deltas) == target_tokens(0, 16) for deltas in together)
    assert all(len(draft) == 3 for draft in verifier.drafts[:12])


# Predicted outputs

async def test_a_prediction_drafts_instead_of_the_drafter_and_its_tokens_are_counted():
    verifier = FakeVerifier(accept=8)  # accepts what it is sent, up to 8: the fake's target is fixed
    # The prediction matches the output but for one edited token at position 4.
    prediction = (*target_tokens(0, 4), 999, *target_tokens(5, 20))
    request = dataclasses.replace(generation(max_tokens=12), prediction_token_ids=prediction)
    async with gateway([verifier], FakeDrafter(draft_len=2)) as gw:
        deltas = await collect(gw, request)
    # Step 1 drafts the prediction after the prefill token: 1..4 and the edit (accepted by this
    # fake; a real verifier would cut it). Later steps follow from where the output is.
    assert verifier.drafts[0] == [*target_tokens(1, 3), 999, *target_tokens(5, 4)]
    usage = deltas[-1].speculation
    assert usage.prediction_draft_tokens == usage.draft_tokens > 0
    assert usage.prediction_accepted_tokens == usage.accepted_tokens


async def test_a_prediction_the_output_leaves_falls_back_to_the_drafter():
    verifier = FakeVerifier(accept=8)
    request = dataclasses.replace(generation(max_tokens=10), prediction_token_ids=(900, 901, 902))
    async with gateway([verifier], FakeDrafter(draft_len=3)) as gw:
        deltas = await collect(gw, request)
    assert tokens_of(deltas) == TARGET
    assert verifier.drafts[0] == target_tokens(1, 3)  # the drafter's
    assert deltas[-1].speculation.prediction_draft_tokens == 0


def test_each_step_verifies_the_draft_its_method_picks():
    from gateway.planner import DRAFTER, HEAD, NONE, PREDICTION, Measurements, pick_draft

    def draft(tokens, score=0.0):
        return common_pb2.Draft(token_ids=tokens, score=score)

    def measured(head_worth):
        return Measurements(1, 0.1, 0.1, None, 0, head_worth, False)

    suffix, nothing = draft([1, 2, 3], score=2.5), draft([])
    hybrid, alone = measured(1.0), measured(None)
    assert pick_draft("hybrid", None, suffix, hybrid) == (DRAFTER, suffix)
    assert pick_draft("hybrid", None, nothing, hybrid) == (HEAD, None)
    assert pick_draft("eagle3", None, suffix, alone) == (HEAD, None)
    assert pick_draft("suffix", None, suffix, alone) == (DRAFTER, suffix)
    assert pick_draft("suffix", None, nothing, alone)[0] == NONE
    predicted = draft([9, 9])
    assert pick_draft("hybrid", predicted, suffix, hybrid) == (PREDICTION, predicted)


def test_the_gateway_reads_vllms_load_cut_offs_from_the_speculative_config():
    from gateway.config import GatewayConfig

    config = GatewayConfig(speculative_config='{"method": "suffix", "disable_by_batch_size": 24, '
                                              '"num_speculative_tokens_per_batch_size": [[8, 15, 4], [16, 24, 2]]}')
    assert config.speculation_draft_tokens_by_load == ((8, 15, 4), (16, 24, 2), (25, MAX_BATCH_SIZE, 0))
    assert config.unused_speculation_keys == ()
    assert GatewayConfig().speculation_draft_tokens_by_load == ()
    for wrong in ("0", "2.5", "true"):
        with pytest.raises(ValueError, match="disable_by_batch_size must be a positive integer"):
            GatewayConfig(speculative_config=f'{{"disable_by_batch_size": {wrong}}}')
    for wrong in ('{"8": 4}', '[[0, 4, 2]]', '[[8, 4, 2]]', '[[1, 8, -1]]', '[[1, 8, 65]]', '[[1, 8, true]]',
                  '[[1, 8]]', '[[1, 8, 4], [8, 16, 2]]'):
        with pytest.raises(ValueError, match="num_speculative_tokens_per_batch_size"):
            GatewayConfig(speculative_config=f'{{"num_speculative_tokens_per_batch_size": {wrong}}}')


def test_the_strictest_limit_a_load_reaches_bounds_the_draft():
    from gateway.planner import Measurements, StepState, draft_budget

    def limit(policy, running, k=8):
        state = StepState("suffix", k, False, False, None, 10, 1, ())
        return draft_budget(policy, state, Measurements(running, 0.0, 0.0, None, 0, None, False)).limit

    policy = PlannerPolicy(draft_tokens_by_load=((8, 15, 4), (16, 24, 2), (25, MAX_BATCH_SIZE, 0), (30, 40, 3)))
    assert [limit(policy, n) for n in (1, 7, 8, 15, 16, 24, 25, 100)] == [8, 8, 4, 4, 2, 2, 0, 0]
    assert limit(PlannerPolicy(draft_tokens_by_load=((4, 16, 6),)), 10) == 6
    assert limit(PlannerPolicy(draft_tokens_by_load=((4, 16, 6),)), 17) == 8  # past the range: k


async def test_drafts_are_cut_to_the_load_the_verifier_reports():
    """The verifier's own count of running sequences, every gateway's: a sequence
    alone on this gateway is cut where the verifier says it is busy."""
    verifier = FakeVerifier(accept=8)
    policy = PlannerPolicy(draft_tokens_by_load=((2, MAX_BATCH_SIZE, 3),))
    async with gateway([verifier], FakeDrafter(draft_len=6), policy=policy) as gw:
        alone = await collect(gw)
        assert max(map(len, verifier.drafts)) > 3  # one sequence: below the table's first row
        verifier.drafts.clear()
        verifier.num_running = 2  # another gateway's sequence runs there too
        shared = await collect(gw)
    assert tokens_of(alone) == tokens_of(shared) == TARGET[:10]
    assert verifier.drafts and max(map(len, verifier.drafts)) == 3


def test_the_planners_policies_ship_on_and_only_the_debug_setting_turns_them_off():
    from gateway.config import GatewayConfig
    from speclane.speculation import SpeculationDebug

    assert GatewayConfig().debug == SpeculationDebug() and PlannerPolicy() == PlannerPolicy(
        next_round=True, lookup="auto", break_even=True)
    off = GatewayConfig(speculation_debug='{"next_round": false, "lookup": "off", "break_even": false}')
    assert (off.debug.next_round, off.debug.lookup, off.debug.break_even) == (False, "off", False)
    for wrong in ('{"next_round": 1}', '{"lookup": "always"}', '{"bogus": true}', '{"draft_token_cost": -1}'):
        with pytest.raises(ValueError, match="speculation debug"):
            GatewayConfig(speculation_debug=wrong)
    # They are not --speculative-config keys: such a key is named as unused, like any key speclane does not read.
    other = GatewayConfig(speculative_config='{"method": "ngram", "next_round_lookup": false}')
    assert other.unused_speculation_keys == ("next_round_lookup",) and other.speculation.method == "ngram"
