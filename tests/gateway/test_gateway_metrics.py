import asyncio

import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics, SequenceTimer
from gateway.verifier_pool import VerifierPool
from protos.verifier.v1 import verifier_pb2
from speclane.net import free_port
from tests.gateway.fake_services import FakeDrafter, FakeVerifier, collect, gateway, generation, serve
from tests.gateway.fakes import MODEL_NAME


def samples(metrics: GatewayMetrics) -> dict:
    text = metrics.render().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(metrics, name, **labels):
    return samples(metrics).get((name, tuple(sorted({"model_name": "m", **labels}.items()))), 0.0)


def test_verify_steps_feed_vllm_spec_decode_counters():
    metrics = GatewayMetrics("m")
    metrics.record_verify_step(num_draft_tokens=5, num_accepted=3)
    metrics.record_verify_step(num_draft_tokens=4, num_accepted=1)
    metrics.record_verify_step(num_draft_tokens=0, num_accepted=0)  # no draft: a plain decode step
    assert value(metrics, "vllm:spec_decode_num_drafts_total") == 2
    assert value(metrics, "vllm:spec_decode_num_draft_tokens_total") == 9
    assert value(metrics, "vllm:spec_decode_num_accepted_tokens_total") == 4
    assert value(metrics, "speclane:verify_steps_total") == 3
    per_position = [value(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
                    for p in range(4)]
    assert per_position == [2, 1, 1, 0]


def test_accepting_more_than_drafted_is_a_bug():
    with pytest.raises(ValueError):
        GatewayMetrics("m").record_verify_step(num_draft_tokens=2, num_accepted=3)


def test_requests_tokens_and_latency():
    metrics = GatewayMetrics("m")
    with metrics.in_flight():
        assert value(metrics, "vllm:num_requests_running") == 1
        metrics.record_first_token(0.2)
        metrics.record_request("length", prompt_tokens=10, generation_tokens=4, e2e_seconds=1.5)
    metrics.record_error("overloaded")
    assert value(metrics, "vllm:num_requests_running") == 0
    assert value(metrics, "vllm:request_success_total", finished_reason="length") == 1
    assert value(metrics, "vllm:prompt_tokens_total") == 10
    assert value(metrics, "vllm:generation_tokens_total") == 4
    assert value(metrics, "vllm:time_to_first_token_seconds_count") == 1
    assert value(metrics, "vllm:e2e_request_latency_seconds_sum") == 1.5
    assert value(metrics, "speclane:request_errors_total", error_type="overloaded") == 1


def test_each_instance_has_its_own_registry():
    first, second = GatewayMetrics("m"), GatewayMetrics("m")
    first.record_verify_step(3, 3)
    assert value(second, "speclane:verify_steps_total") == 0


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_sequence_timeline_in_vllm_terms():
    metrics, clock = GatewayMetrics("m"), Clock()
    timer = SequenceTimer(metrics, clock)
    timer.prefilled(1, queue_seconds=0.25, prefill_seconds=0.5)
    clock.now += 0.1
    timer.stepped(4)  # one step, four tokens: one inter-token latency, as vLLM counts a step
    clock.now += 0.3
    timer.stepped(0)  # a step that committed nothing is no token interval
    clock.now += 0.2
    timer.stepped(2)
    timer.close()
    timer.close()  # recorded once
    assert value(metrics, "vllm:inter_token_latency_seconds_count") == 2
    assert value(metrics, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.6)
    assert value(metrics, "vllm:time_per_output_token_seconds_count") == 2
    assert value(metrics, "vllm:request_queue_time_seconds_sum") == 0.25
    assert value(metrics, "vllm:request_prefill_time_seconds_sum") == 0.5
    assert value(metrics, "vllm:request_decode_time_seconds_sum") == pytest.approx(0.6)
    assert value(metrics, "vllm:request_inference_time_seconds_sum") == pytest.approx(1.1)
    assert value(metrics, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.6 / 6)
    assert value(metrics, "vllm:request_decode_time_seconds_count") == 1


def test_a_verifier_without_timings_and_a_sequence_without_a_first_token():
    metrics = GatewayMetrics("m")
    timer = SequenceTimer(metrics, Clock())
    timer.prefilled(1, queue_seconds=None, prefill_seconds=None)
    timer.close()
    SequenceTimer(metrics).close()  # aborted before its first token: no phases
    assert value(metrics, "vllm:request_decode_time_seconds_count") == 1
    assert value(metrics, "vllm:request_queue_time_seconds_count") == 0
    assert value(metrics, "vllm:request_inference_time_seconds_count") == 0
    assert value(metrics, "vllm:request_time_per_output_token_seconds_count") == 0


def load(**fields) -> verifier_pb2.EngineLoad:
    return verifier_pb2.EngineLoad(**fields)


def test_verifier_loads_are_summed_under_vllm_names():
    metrics = GatewayMetrics("m")
    loads = [(load(num_running=2, num_waiting=1, kv_used_tokens=300, kv_max_tokens=1000, num_preemptions=4,
                   prefix_cache_queries=100, prefix_cache_hits=60), True),
             (load(num_running=1, num_waiting=2, kv_used_tokens=100, kv_max_tokens=1000, num_preemptions=1,
                   prefix_cache_queries=50, prefix_cache_hits=10), True),
             # Did not answer the last poll: out of the gauges, its totals kept in the counters.
             (load(num_running=9, num_waiting=9, kv_used_tokens=900, kv_max_tokens=1000, num_preemptions=10,
                   prefix_cache_queries=1000, prefix_cache_hits=500), False)]
    metrics.add_verifier_loads(lambda: loads)
    assert value(metrics, "vllm:num_requests_waiting") == 3
    assert value(metrics, "speclane:verifier_requests_running") == 3
    assert value(metrics, "vllm:kv_cache_usage_perc") == pytest.approx(0.2)
    assert value(metrics, "vllm:num_preemptions_total") == 15
    assert value(metrics, "vllm:prefix_cache_queries_total") == 1150
    assert value(metrics, "vllm:prefix_cache_hits_total") == 570
    loads.clear()  # nothing known yet: no samples rather than made-up zeros
    assert ("vllm:kv_cache_usage_perc", (("model_name", "m"),)) not in samples(metrics)


class LoadedVerifier(FakeVerifier):
    """A fake verifier that reports a load and times its prefill answers."""

    def __init__(self, running: int):
        super().__init__()
        self.running = running

    async def GetLoad(self, request, context):
        return load(num_running=self.running, kv_used_tokens=10 * self.running, kv_max_tokens=100,
                    num_preemptions=self.running)

    async def Session(self, request_iterator, context):
        first = True
        async for response in super().Session(request_iterator, context):
            if first:
                response.queue_seconds, response.prefill_seconds = 0.125, 0.25
                first = False
            else:
                await asyncio.sleep(0.03)  # the verifier's own 30 ms: a 20 ms forward pass, 5 ms of head drafting
                response.step_seconds, response.forward_seconds, response.head_draft_seconds = 0.03, 0.02, 0.005
            yield response


@pytest.mark.anyio
async def test_the_pool_polls_every_verifier_and_skips_one_that_is_down():
    async with serve(LoadedVerifier(2).add_to) as first, serve(LoadedVerifier(3).add_to) as second:
        pool = VerifierPool((first, second, f"127.0.0.1:{free_port()}"))
        metrics = GatewayMetrics("m")
        pool.attach_metrics(metrics)
        with structlog.testing.capture_logs() as logs:
            await pool.refresh_loads(timeout_seconds=2)
            await pool.refresh_loads(timeout_seconds=2)
        await pool.close()
    assert value(metrics, "speclane:verifier_requests_running") == 5
    assert value(metrics, "vllm:kv_cache_usage_perc") == pytest.approx(0.25)
    assert value(metrics, "vllm:num_preemptions_total") == 5
    assert value(metrics, "speclane:verifiers_serving", model_name="m") == 3  # until a health check says otherwise
    down = [entry for entry in logs if entry["event"] == "verifier_load_unavailable"]
    assert len(down) == 1 and down[0]["address"].startswith("127.0.0.1:")  # logged once per outage


@pytest.mark.anyio
async def test_generations_observe_their_phases_from_the_verifiers_answers():
    async with gateway([LoadedVerifier(1)], FakeDrafter(draft_len=3)) as gw:
        deltas = await collect(gw, generation(max_tokens=10))
    steps = len(deltas) - 1  # the first delta is the prefill's token
    assert value(gw.metrics, "vllm:request_queue_time_seconds_sum", model_name=MODEL_NAME) == 0.125
    assert value(gw.metrics, "vllm:request_prefill_time_seconds_sum", model_name=MODEL_NAME) == 0.25
    assert value(gw.metrics, "vllm:request_decode_time_seconds_count", model_name=MODEL_NAME) == 1
    assert value(gw.metrics, "vllm:inter_token_latency_seconds_count", model_name=MODEL_NAME) == steps
    assert value(gw.metrics, "vllm:request_inference_time_seconds_sum", model_name=MODEL_NAME) >= 0.25


@pytest.mark.anyio
async def test_each_step_is_split_into_drafter_verifier_forward_head_and_network_time():
    drafter = FakeDrafter(draft_len=3)
    drafter.delay = 0.01
    async with gateway([LoadedVerifier(1)], drafter) as gw:
        deltas = await collect(gw, generation(max_tokens=10))
    steps = len(deltas) - 1

    def seconds(part):
        assert value(gw.metrics, f"speclane:step_{part}_seconds_count", model_name=MODEL_NAME) == steps
        return value(gw.metrics, f"speclane:step_{part}_seconds_sum", model_name=MODEL_NAME) / steps

    assert seconds("verifier") == pytest.approx(0.03) and seconds("forward") == pytest.approx(0.02)
    assert seconds("head_draft") == pytest.approx(0.005)
    assert 0.01 <= seconds("drafter_wait") < 0.5
    wait = seconds("verifier_wait")
    assert 0.03 <= wait < 0.5
    assert seconds("network") == pytest.approx(wait - 0.03, abs=1e-6)  # what the verifier does not account for
