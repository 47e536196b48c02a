"""Several sequences' head drafts made together: every head step is one batch
over the sequences still drafting, each sequence attending over its own cache.
A batch drafts what each sequence would have drafted alone, leaves each cache
at its committed pairs, and keeps greedy output the target's."""

import copy

import pytest
import torch

from tests.verifier.test_heads import assert_head_cache_is_the_committed_pairs, head_engine  # noqa: F401
from verifier_service.heads.drafting import DraftRequest, HeadState
from verifier_service.sequence import Draft, GenerationParams

PROMPTS = [[5, 9, 11, 20, 7, 30, 41, 12], [3, 14, 15, 9, 2, 6], [27, 18, 28, 18, 28, 45, 9, 4, 52, 33, 1]]


def pending_states(engine) -> list[HeadState]:
    """Head states with different numbers of pairs not yet fed (no draft was made):
    after the prompt's pass, and after 0, 1 and 2 plain steps more."""
    params = GenerationParams(max_new_tokens=8, ignore_eos=True, num_head_draft_tokens=4, head_draft_on_demand=True)
    seqs = [engine.open(f"p{i}", prompt, params) for i, prompt in enumerate(PROMPTS)]
    engine.run_together([(seq, Draft()) for seq in seqs])
    for plain_steps, seq in enumerate(seqs):
        for _ in range(plain_steps):
            engine.verify(seq, Draft())
    states = [seq.head for seq in seqs]
    for seq in seqs:
        engine.close(seq)
    return states


def together_and_alone(drafter, states: list[HeadState], requests) -> tuple[list, list, list[int], int, list]:
    """The drafts of `requests(states)` made together, with the row counts of the head's steps and the host reads
    they took; and the same requests' drafts made one by one from copies of the states, with those copies."""
    with torch.inference_mode():
        copies = copy.deepcopy(states)
    forwards = []
    hook = drafter.head.register_forward_hook(lambda module, args, out: forwards.append(len(args[0])))
    try:
        with HostReads() as reads:
            together = drafter.draft_many(requests(states))
    finally:
        hook.remove()
    alone = [drafter.draft_many([request])[0] for request in requests(copies)]
    return together, alone, forwards, reads.count, copies


@pytest.mark.parametrize("temperature", [None, 0.8], ids=["greedy", "sampled"])
def test_a_batch_drafts_what_each_sequence_drafts_alone_in_one_head_step_per_token(head_engine, temperature):  # noqa: F811
    states = pending_states(head_engine)
    ks = [1, 4, 3]
    fed = sum(len(s.tokens) for s in states)
    together, expected, forwards, _, alone = together_and_alone(head_engine.head, states, lambda states: [
        *(DraftRequest(state, k, temperature, torch.Generator().manual_seed(i))
          for i, (state, k) in enumerate(zip(states, ks))),
        DraftRequest(HeadState(), 2, temperature)])  # nothing to draft from
    # One pass feeds every sequence's new pairs; then one step per draft position while any chain grows.
    assert forwards == [fed, 2, 2, 1]
    assert [d.token_ids for d in together[:3]] == [d.token_ids for d in expected[:3]]
    assert [len(d.token_ids) for d in together] == [*ks, 0]
    assert all(d.score == pytest.approx(e.score, rel=1e-4) for d, e in zip(together, expected))
    if temperature:
        assert all(torch.allclose(d.proposals, e.proposals, atol=1e-5) for d, e in zip(together[:3], expected))
    for batched, single in zip(states, alone):  # drafted from the same committed pairs, rolled back to them
        assert len(batched.kv) == len(single.kv) and not batched.tokens
        assert torch.allclose(batched.kv.keys, single.kv.keys, atol=1e-5)


class HostReads:
    """Reads of a tensor's values by the host (on an accelerator each waits for the device): tolist(), item(),
    int(), float() and bool()."""

    READS = ("tolist", "item", "__int__", "__float__", "__bool__")

    def __enter__(self):
        self.count, self._originals = 0, {name: getattr(torch.Tensor, name) for name in self.READS}
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, self._counted(original))
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)

    def _counted(self, original):
        def read(tensor, *args):
            self.count += 1
            return original(tensor, *args)
        return read


@pytest.mark.parametrize("temperature", [None, 0.8], ids=["greedy", "sampled"])
def test_a_draft_step_reads_the_host_once_however_many_sequences_draft(head_engine, temperature):  # noqa: F811
    drafter = head_engine.head
    states = pending_states(head_engine)

    def reads(copies: int) -> int:
        with torch.inference_mode():
            batch = [copy.deepcopy(state) for state in states for _ in range(copies)]
        requests = [DraftRequest(state, 3, temperature, torch.Generator().manual_seed(i))
                    for i, state in enumerate(batch)]
        with HostReads() as counted:
            drafts = drafter.draft_many(requests)
        assert [len(draft.token_ids) for draft in drafts] == [3] * len(batch)
        return counted.count

    assert reads(4) == reads(1) == 3  # one a draft step


@pytest.mark.parametrize("on_demand", [False, True], ids=["after-each-step", "on-demand"])
def test_sequences_stepped_together_are_drafted_together_and_keep_greedy_output(head_engine, hf_model,  # noqa: F811
                                                                                 monkeypatch, on_demand):
    """After a pass, the sequences it answered; on demand, the steps that ask
    for the head's draft and are about to run (submitted one at a time)."""
    def generate_all(k: int) -> list:
        params = GenerationParams(max_new_tokens=20, ignore_eos=True, num_head_draft_tokens=k,
                                  head_draft_on_demand=on_demand)
        seqs = [head_engine.open(f"s{i}", prompt, params) for i, prompt in enumerate(PROMPTS)]
        head_engine.run_together([(seq, Draft()) for seq in seqs])
        while live := [seq for seq in seqs if not seq.finished]:
            head_engine.run_together([(seq, Draft(from_head=True)) for seq in live])
        return seqs

    plain = generate_all(0)
    batch_sizes = []
    draft_many = head_engine.head.draft_many
    monkeypatch.setattr(head_engine.head, "draft_many",
                        lambda requests, *args: batch_sizes.append(len(requests)) or draft_many(requests, *args))
    drafted = generate_all(3)
    assert [seq.tokens for seq in drafted] == [seq.tokens for seq in plain]
    assert all(seq.num_draft_tokens > 0 for seq in drafted)
    assert batch_sizes[0] == len(PROMPTS)  # the first drafts, one batch
    for seq in drafted:
        head_engine.head.draft(seq.head, 1, None)  # feeds the last step's pairs, which no draft needed
        assert_head_cache_is_the_committed_pairs(head_engine, hf_model, seq)
        head_engine.close(seq)
    for seq in plain:
        head_engine.close(seq)

