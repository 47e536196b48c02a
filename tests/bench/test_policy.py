import pytest

from speclane.speculation import SpeculationSettings
from speclane_cli.bench.policy import Trace, load, replay

# A reply that copies 40 tokens of its prompt after a short preamble of its own.
SOURCE = tuple(range(100, 140))
COPY = Trace(prompt=(1, 2, 3) + SOURCE + (4, 5), output=(7, 8) + SOURCE)
NGRAM = SpeculationSettings(method="ngram", num_speculative_tokens=4)


def test_a_verbatim_copy_is_drafted_whole_and_every_step_is_priced():
    copied = replay([COPY], NGRAM, token_cost=0.5, next_round=False)
    assert copied.tokens == len(COPY.output) - 1
    # Once two tokens of the copy are out, every draft is right in full (the last one cut by the reply's end).
    assert copied.drafted - copied.accepted == 1
    assert copied.steps == 3 + (len(SOURCE) - 2 + 4) // 5
    assert copied.cost == pytest.approx(copied.steps + 0.5 * copied.drafted)
    plain = replay([Trace(COPY.prompt, tuple(range(500, 540)))], NGRAM, token_cost=0.5, next_round=False)
    assert (plain.drafted, plain.steps, plain.speed) == (0, 39, 1.0)


def test_next_round_offers_continue_a_fully_accepted_draft():
    offered = replay([COPY], NGRAM, token_cost=0.2, next_round=True)
    fresh = replay([COPY], NGRAM, token_cost=0.2, next_round=False)
    assert offered.next_round_steps > 0 and fresh.next_round_steps == 0
    assert offered.tokens == fresh.tokens and offered.accepted <= offered.drafted


def test_detours_let_steps_after_a_rejected_draft_run_on_an_offer(monkeypatch):
    """After "1 2" the prompt went on "3 4 5" three times and "6 7 8" once: drafts
    follow "3", and the reply's "6" rejects them. The tree's other branch is a
    detour there, so the step after runs on its offer; without detours it cannot."""

    import speclane_cli.bench.policy as policy

    often, once = (1, 2, 3, 4, 5, 9), (1, 2, 6, 7, 8, 9)
    trace = Trace(prompt=often * 3 + once, output=(10, 11) + once + often + once + once)
    suffix = SpeculationSettings(method="suffix", num_speculative_tokens=4)
    with_detours = replay([trace], suffix, token_cost=0.1)
    plain = policy.draft_to_proto

    def without_detours(draft, committed_len):
        drafted = plain(draft, committed_len)
        drafted.ClearField("detours")
        return drafted

    monkeypatch.setattr(policy, "draft_to_proto", without_detours)
    without = replay([trace], suffix, token_cost=0.1)
    assert with_detours.next_round_steps > without.next_round_steps
    assert with_detours.tokens == without.tokens


def test_the_break_even_cut_stops_drafts_that_keep_failing():
    # "1 2" goes on with a new token each time, so every draft after it is rejected at once.
    trace = Trace(prompt=(1, 2, 3, 4) * 5, output=sum(((1, 2, 100 + i) for i in range(12)), ()))
    drafting, cut = (replay([trace], NGRAM, token_cost=0.5, break_even=on) for on in (False, True))
    assert cut.tokens == drafting.tokens
    assert cut.drafted < drafting.drafted / 2 and cut.speed > drafting.speed


def test_the_suffix_budget_knob_changes_the_drafts():
    short, long = (replay([COPY], SpeculationSettings(num_speculative_tokens=16,
                                                      suffix_decoding_max_spec_factor=factor),
                          token_cost=0.1, next_round=False) for factor in (0.5, 4.0))
    assert long.steps < short.steps and long.speed > short.speed


def test_recorded_traces_load_back(tmp_path):
    path = tmp_path / "traces.json"
    path.write_text('{"code-edit": [[[1, 2, 3], [4, 5]]]}')
    assert load(path) == {"code-edit": [Trace((1, 2, 3), (4, 5))]}
