"""The KV budget: 64 sequences of 1k tokens fill a 64k-token pool exactly,
the 65th waits (or is refused), running sequences are never disturbed, and
the pool is empty again at the end. Preemption and prefix reuse are lossless."""

import pytest
import torch

from verifier_service.errors import ResourceExhausted
from verifier_service.model_runner import ModelRunner
from verifier_service.scheduler import BatchLimits
from verifier_service.sequence import Draft, GenerationParams

from .conftest import BLOCK, make_engine, save_tiny_llama
from .test_engine import GREEDY, reference

SEQ_TOKENS = 1024
PROMPT_LEN = 1000
NUM_SEQS = 64


@pytest.fixture(scope="module")
def long_runner(tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-2k"), max_context=2048)
    return ModelRunner(path, "cpu", torch.float32)


def prompt(i: int, length: int = PROMPT_LEN) -> list[int]:
    return [(i * 13 + j * 7) % 60 + 4 for j in range(length)]


def fill(engine, count: int):
    """Opens `count` sequences of PROMPT_LEN + 24 = 1024 tokens and submits their prefills."""
    params = GenerationParams(GREEDY, max_new_tokens=SEQ_TOKENS - PROMPT_LEN, ignore_eos=True)
    seqs = [engine.open(f"s{i}", prompt(i), params) for i in range(count)]
    answers = [[] for _ in seqs]
    for seq, box in zip(seqs, answers):
        engine.submit(seq, Draft(), box.append)
    return seqs, answers


def drive(engine, seqs, answers) -> None:
    """Steps every sequence to its end, resubmitting after each answer."""
    handled = [0] * len(seqs)
    while not all(s.finished for s in seqs):
        engine.step()
        for i, (seq, box) in enumerate(zip(seqs, answers)):
            if len(box) > handled[i]:
                handled[i] = len(box)
                assert not isinstance(box[-1], Exception), box[-1]
                if not seq.finished:
                    engine.submit(seq, Draft(), box.append)


def test_64_sequences_of_1k_fill_a_64k_pool_and_the_65th_waits(long_runner):
    passes = []
    engine = make_engine(long_runner, max_kv_tokens=NUM_SEQS * SEQ_TOKENS, on_step=passes.append,
                         limits=BatchLimits(max_tokens=2048, max_sequences=128, max_queue_wait=3600))
    seqs, answers = fill(engine, NUM_SEQS + 1)
    while not all(answers[:NUM_SEQS]):
        engine.step()
    extra = seqs[-1]
    assert extra.blocks is None and not answers[-1]  # waiting, not refused
    drive(engine, seqs, answers)
    # All 64 reached 1024 tokens together, filling the budget to the last block, without preemption.
    assert max(p.kv_used_tokens for p in passes) == NUM_SEQS * SEQ_TOKENS
    assert sum(s.num_steps for s in seqs) == len(seqs) * (SEQ_TOKENS - PROMPT_LEN)
    assert all(s.num_generated == SEQ_TOKENS - PROMPT_LEN for s in seqs)
    engine.step()
    assert engine.blocks.used_blocks == 0 and engine.blocks.free_blocks == engine.blocks.num_blocks
    engine.blocks.check()
    for seq in seqs[:3] + seqs[-1:]:
        assert seq.tokens[PROMPT_LEN:PROMPT_LEN + 4] == reference_start(long_runner, seq)


def reference_start(runner, seq, prompt_len: int = PROMPT_LEN) -> list[int]:
    """First tokens of the same prompt decoded alone on an empty engine (it takes the runner's cache over)."""
    alone = make_engine(runner)
    other = alone.open("alone", seq.tokens[:prompt_len], GenerationParams(GREEDY, max_new_tokens=4, ignore_eos=True))
    tokens = alone.prefill(other).token_ids
    while not other.finished:
        tokens += alone.verify(other, Draft()).token_ids
    return tokens


def test_one_more_is_refused_when_waiting_is_off(long_runner):
    engine = make_engine(long_runner, max_kv_tokens=4 * SEQ_TOKENS,
                         limits=BatchLimits(max_tokens=4096, max_sequences=128, max_queue_wait=0))
    seqs, answers = fill(engine, 4)
    while not all(answers):
        engine.step()
    held = engine.blocks.used_blocks
    late = engine.open("late", prompt(99), GenerationParams(GREEDY, max_new_tokens=4))
    refused = []
    engine.submit(late, Draft(), refused.append)
    engine.step()
    assert isinstance(refused[0], ResourceExhausted)
    assert engine.blocks.used_blocks == held and all(s.blocks is not None for s in seqs)
    for seq in seqs:
        engine.close(seq)
    engine.step()
    assert engine.blocks.used_blocks == 0


def test_a_prompt_larger_than_the_budget_is_refused(runner):
    engine = make_engine(runner, max_kv_tokens=32)
    seq = engine.open("big", list(range(4, 44)), GenerationParams(GREEDY, max_new_tokens=4))
    with pytest.raises(ResourceExhausted, match="budget"):
        engine.prefill(seq)


def test_preemption_under_a_tight_budget_is_lossless(runner, hf_model):
    """Two sequences whose growth overflows the pool: one is preempted and prefilled again."""
    engine = make_engine(runner, max_kv_tokens=64)
    prompts = [[5, 17, 9, 40, 22, 8, 31] * 3, [60, 2, 7, 11, 3] * 4]
    refs = [reference(hf_model, p, 30) for p in prompts]
    params = GenerationParams(GREEDY, max_new_tokens=30, ignore_eos=True)
    seqs = [engine.open(f"s{i}", p, params) for i, p in enumerate(prompts)]
    boxes = [[], []]
    for seq, box in zip(seqs, boxes):
        engine.submit(seq, Draft(), box.append)
    preempted = False
    while not all(s.finished for s in seqs):
        engine.step()
        preempted |= any(s.blocks is None and not s.finished for s in seqs)
        for i, (seq, box) in enumerate(zip(seqs, boxes)):
            if box:
                assert not isinstance(box[0], Exception)
                box.clear()
                if not seq.finished:
                    future = refs[i][seq.num_generated:]
                    engine.submit(seq, Draft(tuple(future[:3])), box.append)
    assert preempted
    for seq, ref, p in zip(seqs, refs, prompts):
        assert seq.tokens[len(p):] == ref


def test_a_follow_up_turn_reuses_the_conversation_kv(runner, hf_model):
    passes = []
    engine = make_engine(runner, prefix_caching=True, on_step=passes.append)
    first_prompt = [(3 * i) % 60 + 4 for i in range(40)]
    params = GenerationParams(GREEDY, max_new_tokens=6, ignore_eos=True)
    turn1 = engine.open("t1", first_prompt, params)
    engine.prefill(turn1)
    while not turn1.finished:
        engine.verify(turn1, Draft())
    assert engine.blocks.cached_blocks > 0
    second_prompt = turn1.tokens + [9, 10, 11]
    # Turn 1's KV ends inside a block: the tail's slots are copied, not computed again.
    assert (len(turn1.tokens) - 1) % BLOCK
    turn2 = engine.open("t2", second_prompt, params)
    passes.clear()
    first = engine.prefill(turn2)
    # Only the tokens after the cached conversation ran through the model: turn 1's last (its KV was never
    # computed) and the new ones.
    assert passes[0].num_tokens == len(second_prompt) - (len(turn1.tokens) - 1) == 4
    assert first.token_ids == reference(hf_model, second_prompt, 1)
    while not turn2.finished:
        engine.verify(turn2, Draft())
    assert turn2.tokens[len(second_prompt):] == reference(hf_model, second_prompt, 6)
    # What the prefill's answer reports as cached (usage's cached_tokens).
    assert (turn1.num_cached_prompt_tokens, turn2.num_cached_prompt_tokens) == (
        0, len(second_prompt) - passes[0].num_tokens)


def test_a_turn_ending_on_an_accepted_tree_path_hands_its_last_block_on_after_the_path_moved(runner, hf_model):
    """The last step's accepted path is a tree's second branch, whose KV rows move up with the next pass; the
    finished turn's last, partly full block is copied for the next turn after that move, not before."""
    engine = make_engine(runner, prefix_caching=True)
    first_prompt = [(5 * i) % 60 + 4 for i in range(37)]
    want = reference(hf_model, first_prompt, 9)
    turn1 = engine.open("t1", first_prompt, GenerationParams(GREEDY, max_new_tokens=9, ignore_eos=True))
    engine.prefill(turn1)
    while not turn1.finished:
        done = turn1.num_generated
        decoy = (want[done] + 1) % 60 + 4
        engine.verify(turn1, Draft((decoy, *want[done:done + 3]), parents=(-1, -1, 1, 2)))
    assert turn1.tokens[len(first_prompt):] == want
    assert (len(turn1.tokens) - 1) % BLOCK  # its KV ends inside a block
    second_prompt = turn1.tokens + [9, 10, 11]
    turn2 = engine.open("t2", second_prompt,
                        GenerationParams(GREEDY, max_new_tokens=4, ignore_eos=True, logprobs=5))
    first = engine.prefill(turn2)
    assert turn2.num_cached_prompt_tokens == len(turn1.tokens) - 1
    # The first token's distribution is transformers' over the whole prompt: the copied rows are the path's.
    with torch.inference_mode():
        row = torch.log_softmax(hf_model(torch.tensor([second_prompt])).logits[0, -1].float(), -1)
    top = torch.topk(row, 5)
    assert first.logprobs[0].top_token_ids == tuple(top.indices.tolist())
    assert first.logprobs[0].top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
    while not turn2.finished:
        engine.verify(turn2, Draft())
    assert turn2.tokens[len(second_prompt):] == reference(hf_model, second_prompt, 4)


def test_a_system_prompt_shared_by_concurrent_requests_is_computed_once(long_runner):
    """16 requests arriving together with one 1,000-token system prompt: the first
    computes it, the others wait for its blocks instead of computing them again."""
    passes = []
    engine = make_engine(long_runner, max_kv_tokens=32 * 1024, prefix_caching=True, on_step=passes.append,
                         limits=BatchLimits(max_tokens=512, max_sequences=64))
    system = prompt(7, 1000)
    prompts = [system + [(i * 5 + j) % 60 + 4 for j in range(20)] for i in range(16)]
    params = GenerationParams(GREEDY, max_new_tokens=2, ignore_eos=True)
    seqs = [engine.open(f"s{i}", p, params) for i, p in enumerate(prompts)]
    answers = [[] for _ in seqs]
    for seq, box in zip(seqs, answers):
        engine.submit(seq, Draft(), box.append)
    while not all(answers):
        engine.step()
    computed = sum(p.num_tokens for p in passes)
    unique = len(system) + 16 * 20
    assert computed <= 1.1 * unique, (computed, unique)
    assert engine.blocks.prefix_cache_hits >= 15 * (len(system) // BLOCK * BLOCK)
    for seq, p in list(zip(seqs, prompts))[:2]:  # and what they computed is right
        assert seq.tokens[len(p):] == reference_start(long_runner, seq, len(p))[:1]


def test_the_cache_starts_as_zeros_and_commits_its_memory_only_as_it_fills():
    """Attention reads whole blocks, so slots no token wrote are read (masked): they must be finite, even where
    freed memory held NaNs; and on a CPU a large cache still costs memory only as blocks fill."""
    import psutil

    from verifier_service.kv_cache import KVGeometry, PagedKVCache

    geometry = KVGeometry(num_layers=2, kv_heads=2, key_dim=64, value_dim=32)
    for _ in range(3):  # a cache the size of one just freed, whose memory held NaNs
        cache = PagedKVCache(geometry, 64, BLOCK, torch.float32, torch.device("cpu"))
        assert not any(tensor.any() for tensor in cache.kv)
        for tensor in cache.kv:
            tensor.fill_(float("nan"))
        del cache
    process = psutil.Process()
    before = process.memory_info().rss
    cache = PagedKVCache(geometry, 2**20 // BLOCK, BLOCK, torch.float32, torch.device("cpu"))  # 1.5 GiB
    assert process.memory_info().rss - before < 2**27
    cache.write(1, torch.tensor([5]), torch.ones(1, 2, 64), torch.full((1, 2, 32), 2.0))
    assert cache.keys[1][5].sum() == 128 and cache.values[1][5].sum() == 128
    assert cache.keys[1].shape == (2**20, 2, 64) and cache.values[1].shape == (2**20, 2, 32)
    assert not cache.kv[0][5].any() and not cache.kv[1][4].any()
