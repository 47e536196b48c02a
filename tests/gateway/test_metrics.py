import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics


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
