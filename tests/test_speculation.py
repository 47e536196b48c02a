"""Speculation settings have one owner (speclane/speculation.py): the gateway's
config and request checks and the drafter's session checks are the same code,
so a setting the gateway accepts is never refused by the drafter."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from speclane.speculation import (
    DRAFTER_WIDE_KEYS,
    LOAD_KEYS,
    VERIFIER_KEYS,
    DrafterLimits,
    SpeculationDebug,
    SpeculationSettings,
    SpeculativeConfig,
    parse_speculation_debug,
    parse_speculative_config,
    settings_from_proto,
    settings_to_proto,
    token_cost_at,
)

LIMITS = DrafterLimits(max_tree_depth=24, max_cached_requests=100, max_speculative_tokens=16)


def test_empty_config_gives_the_defaults():
    assert parse_speculative_config("") == SpeculativeConfig()


def test_vllm_keys_speclane_does_not_use_are_named_not_refused():
    config = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 3, "enforce_eager": true, "quantization": null, '
        '"disable_padded_drafter_batch": false}')
    assert (config.settings.method, config.settings.num_speculative_tokens) == ("ngram", 3)
    assert config.unused == ("disable_padded_drafter_batch", "enforce_eager", "quantization")


def test_vllm_config_splits_per_sequence_drafter_wide_and_verifier_keys():
    config = parse_speculative_config(
        '{"method": "deepseek_mtp", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "eagle_topk": 2, '
        '"suffix_decoding_max_tree_depth": 32, "suffix_decoding_max_cached_requests": 0}')
    assert (config.settings.method, config.settings.num_speculative_tokens) == ("mtp", 4)
    assert config.drafter_wide == {"suffix_decoding_max_tree_depth": 32, "suffix_decoding_max_cached_requests": 0}
    assert (config.method, config.verifier, config.unused) == ("mtp", {"eagle_topk": 2}, ())


def test_the_public_keys_are_the_ecosystems_and_at_most_sixteen():
    keys = {field.name for field in dataclasses.fields(SpeculationSettings)} | set(DRAFTER_WIDE_KEYS) \
        | set(LOAD_KEYS) | set(VERIFIER_KEYS)
    assert len(keys) == 16
    assert not any(key in keys for key in ("draft_token_cost", "next_round_lookup", "break_even_drafts",
                                           "suffix_decoding_use_tree_spec", "suffix_decoding_max_spec_offset"))


def test_the_debug_setting_switches_only_what_it_names():
    assert parse_speculation_debug("") == SpeculationDebug()
    assert parse_speculation_debug('{"draft_token_cost": 0}') == SpeculationDebug(draft_token_cost=0.0)
    for wrong in ('{"draft_token_cost": "auto"}', '{"draft_token_cost": 11}', '{"lookup": true}', '[1]'):
        with pytest.raises(ValueError):
            parse_speculation_debug(wrong)


@pytest.mark.parametrize("given_bounds, expected", [
    ({"prompt_lookup_min": 3}, (3, 3)),
    ({"prompt_lookup_max": 4}, (4, 4)),
    ({"prompt_lookup_min": 1, "prompt_lookup_max": 4}, (1, 4)),
])
def test_one_lookup_bound_rule_for_config_and_requests(given_bounds, expected):
    """vLLM's rule: when only one bound is given, the other takes its value."""
    from_config = parse_speculative_config(str(given_bounds).replace("'", '"')).settings
    from_request = SpeculationSettings().merged(given_bounds, LIMITS)
    assert (from_config.prompt_lookup_min, from_config.prompt_lookup_max) == expected
    assert (from_request.prompt_lookup_min, from_request.prompt_lookup_max) == expected


def test_a_request_may_repeat_a_drafter_wide_value_but_not_change_it():
    assert SpeculationSettings().merged({"suffix_decoding_max_tree_depth": 24}, LIMITS) == SpeculationSettings()
    with pytest.raises(ValueError, match="fixed by the drafter"):
        SpeculationSettings().merged({"suffix_decoding_max_tree_depth": 32}, LIMITS)
    with pytest.raises(ValueError, match="fixed by the drafter"):
        SpeculationSettings().merged({"suffix_decoding_max_cached_requests": 5}, LIMITS)


def test_the_drafters_limit_bounds_the_draft_length():
    assert SpeculationSettings().merged({"num_speculative_tokens": 16}, LIMITS).num_speculative_tokens == 16
    with pytest.raises(ValueError, match="at most 16"):
        SpeculationSettings().merged({"num_speculative_tokens": 17}, LIMITS)


@pytest.mark.parametrize("values", [
    {"method": "medusa"},
    {"num_speculative_tokens": 0},
    {"num_speculative_tokens": 65},
    {"num_speculative_tokens": "8"},
    {"prompt_lookup_min": 4, "prompt_lookup_max": 3},
    {"prompt_lookup_min": 0},
    {"suffix_decoding_min_token_prob": 1.5},
    {"suffix_decoding_max_spec_factor": float("nan")},
    {"suffix_decoding_max_spec_factor": -1.0},
    {"suffix_decoding_use_tree_spec": True},
    {"suffix_decoding_max_spec_offset": 1.0},
    {"bogus": 1},
])
def test_bad_values_are_refused(values):
    with pytest.raises(ValueError):
        SpeculationSettings().merged(values)


def test_bad_config_json_is_refused():
    for text in ("{", "[1]", '{"suffix_decoding_max_tree_depth": -1}', '{"method": "medusa"}'):
        with pytest.raises(ValueError):
            parse_speculative_config(text)


_OVERRIDES = st.fixed_dictionaries({}, optional={
    "method": st.sampled_from(["suffix", "ngram", "none", "eagle"]),
    "num_speculative_tokens": st.integers(-1, 70),
    "prompt_lookup_min": st.integers(0, 8),
    "prompt_lookup_max": st.integers(0, 8),
    "suffix_decoding_max_spec_factor": st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0]),
    "suffix_decoding_min_token_prob": st.sampled_from([0.0, 0.25, 1.0, 1.5]),
    "suffix_decoding_max_tree_depth": st.sampled_from([16, 24]),
    "suffix_decoding_max_cached_requests": st.sampled_from([100, 200]),
})


@given(_OVERRIDES)
def test_what_the_gateway_accepts_the_drafter_accepts_unchanged(overrides):
    try:
        settings = SpeculationSettings().merged(overrides, LIMITS).with_draft_length(LIMITS)
    except ValueError:
        return
    if settings.uses_drafter:
        received = settings_from_proto(settings_to_proto(settings), LIMITS)  # floats cross as float32
        # hybrid's drafter half is suffix decoding; everything else crosses unchanged.
        expected = dataclasses.replace(settings, method=settings.drafter_method)
        assert dataclasses.asdict(received) == pytest.approx(dataclasses.asdict(expected))


def test_head_methods_and_the_verifier_keys_of_a_vllm_eagle3_command_line():
    config = parse_speculative_config(
        '{"method": "eagle3", "model": "/heads/eagle3", "num_speculative_tokens": 4, '
        '"draft_tensor_parallel_size": 1}')
    settings = config.settings
    assert (settings.method, settings.num_speculative_tokens, config.unused) == ("eagle3", 4, ())
    assert settings.uses_head and not settings.uses_drafter


def test_deepseek_mtp_is_mtp_and_hybrid_uses_both_sources():
    assert SpeculationSettings(method="deepseek_mtp").method == "mtp"
    hybrid = SpeculationSettings(method="hybrid")
    assert hybrid.uses_head and hybrid.uses_drafter and hybrid.drafter_method == "suffix"
    assert settings_to_proto(hybrid).method == settings_to_proto(SpeculationSettings(method="suffix")).method


# As this CPU measured SmolLM2: cheap among 8 sequences (weight reads shared), dear among 32 (compute-bound).
COSTS = ((1, 0.17), (8, 0.1), (32, 0.36))


def test_a_draft_tokens_cost_is_the_measured_one_at_the_batch_size():
    assert token_cost_at((), 32) == 0.0  # nothing measured: drafts are free
    assert token_cost_at(COSTS, 1) == token_cost_at(COSTS, 0) == pytest.approx(0.17)
    assert token_cost_at(COSTS, 8) == pytest.approx(0.1)
    assert token_cost_at(COSTS, 20) == pytest.approx(0.23)  # halfway between 8 and 32
    assert token_cost_at(COSTS, 64) == pytest.approx(0.36)  # beyond the largest measured: its cost
    assert token_cost_at(((1, 0.2),), 32) == pytest.approx(0.2)  # one cost measured: it holds for every batch
