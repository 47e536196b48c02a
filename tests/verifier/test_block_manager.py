"""The block manager against a plain oracle of what each cache slot holds.

Sequences over a tiny alphabet (so that prompts share prefixes) are admitted,
compute and commit tokens, finish or are preempted, under a pool small
enough to evict. The oracle writes each computed token's id into its slot,
as the KV would be written, and checks after every step that: a sequence
never writes a block another holds; every token a sequence finds cached is
the token at that position of its prompt; reference counts equal the holders;
and once every sequence is gone no block is held."""

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from verifier_service.block_manager import BlockManager, BlockTable, MoveSlots

BLOCK = 4
NUM_BLOCKS = 12


class Running:
    def __init__(self, tokens: list[int]):
        self.tokens = tokens
        self.table = BlockTable()
        self.num_cached = 0  # tokens whose KV is written


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.blocks = BlockManager(NUM_BLOCKS, BLOCK, enable_prefix_caching=True)
        self.slots: dict[int, int] = {}  # slot -> the token id whose KV it holds
        self.running: list[Running] = []

    def _write(self, seq: Running, upto: int) -> None:
        """Computes the sequence's tokens [num_cached, upto): into blocks only it holds."""
        for i in range(seq.num_cached, upto):
            block = seq.table.blocks[i // BLOCK]
            assert self.blocks._refs[block] == 1, "a shared block would be overwritten"
            self.slots[seq.table.slot(i, BLOCK)] = seq.tokens[i]
        seq.num_cached = upto
        self.blocks.commit(seq.table, seq.tokens, upto)

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=14))
    def admit(self, prompt):
        seq = Running(prompt)
        cached = self.blocks.allocate(seq.table, prompt, len(prompt))
        if cached is None:
            return
        assert cached < len(prompt)  # never the last prompt token
        for move in self.blocks.take_moves():  # a tail's slots, copied as the next pass would
            copied = [self.slots.get(src) for src in move.src]
            for dst, token in zip(move.dst, copied):
                self.slots[dst] = token
        for i in range(cached):  # what the cache hands over is this prompt's
            assert self.slots.get(seq.table.slot(i, BLOCK)) == prompt[i]
        seq.num_cached = cached
        self._write(seq, len(prompt))
        self.running.append(seq)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 50), new=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def decode(self, index, new):
        seq = self.running[index % len(self.running)]
        if not self.blocks.grow(seq.table, len(seq.tokens) + len(new)):
            return
        seq.tokens = seq.tokens + new
        self._write(seq, len(seq.tokens))

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 50))
    def finish(self, index):
        seq = self.running.pop(index % len(self.running))
        self.blocks.free(seq.table, seq.tokens, seq.num_cached)
        assert seq.table.blocks == []

    @invariant()
    def bookkeeping_agrees(self):
        self.blocks.check()
        holders: dict[int, int] = {}
        for seq in self.running:
            for block in seq.table.blocks:
                holders[block] = holders.get(block, 0) + 1
        assert all(self.blocks._refs[b] == holders.get(b, 0) for b in range(NUM_BLOCKS))
        assert self.blocks.used_blocks == len(holders)

    def teardown(self):
        for seq in self.running:
            self.blocks.free(seq.table)
        assert self.blocks.used_blocks == 0 and self.blocks.free_blocks == NUM_BLOCKS


BlockManagerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestBlockManager = BlockManagerMachine.TestCase


def test_concurrent_prompts_share_a_prefix_while_all_run():
    blocks = BlockManager(16, BLOCK)
    system = list(range(10, 22))  # three full blocks
    first, second = BlockTable(), BlockTable()
    assert blocks.allocate(first, system + [1, 2], 14) == 0
    blocks.commit(first, system + [1, 2], 14)
    assert blocks.allocate(second, system + [3], 13) == 12  # while the first still runs
    assert first.blocks[:3] == second.blocks[:3] and first.blocks[3] != second.blocks[3]
    assert (blocks.prefix_cache_queries, blocks.prefix_cache_hits) == (27, 12)


def test_evicted_prefixes_are_the_least_recently_freed_and_their_tails_first():
    blocks = BlockManager(4, BLOCK)
    old, new = BlockTable(), BlockTable()
    for table, tokens in ((old, [1] * 9), (new, [2] * 9)):
        blocks.allocate(table, tokens, 8)
        blocks.commit(table, tokens, 8)
    blocks.free(old)
    blocks.free(new)
    assert blocks.cached_blocks == 4
    # One block is needed: the old prompt's second block goes first; its first block and the new prompt stay.
    assert blocks.allocate(BlockTable(), [3] * 3, 4) == 0
    assert blocks.allocate(BlockTable(), [1] * 9, 8) == BLOCK
    assert blocks.allocate(BlockTable(), [2] * 9, 8) is None  # no space is left for its second block


def test_blocks_are_shared_only_among_sequences_with_the_same_salt():
    blocks = BlockManager(16, BLOCK)
    prompt = list(range(10, 19))
    owner = BlockTable("team-a")
    blocks.allocate(owner, prompt, 9)
    blocks.commit(owner, prompt, 8)
    assert blocks.allocate(BlockTable("team-b"), prompt, 9) == 0
    assert blocks.allocate(BlockTable(), prompt, 9) == 0
    assert blocks.allocate(BlockTable("team-a"), prompt, 9) == 8
    assert blocks.cached_tokens(prompt, "team-a") == 8 and blocks.cached_tokens(prompt, "team-b") == 0


def test_a_finished_sequences_last_block_is_copied_for_a_prompt_continuing_it():
    blocks = BlockManager(16, BLOCK)
    turn = BlockTable("chat")
    tokens = list(range(10, 17))  # a full block and 3 tokens of the next
    blocks.allocate(turn, tokens, 8)
    blocks.commit(turn, tokens, 7)
    tail_block = turn.blocks[1]
    blocks.free(turn, tokens, 7)
    assert blocks.cached_blocks == 2
    # The next turn continues it: the full block is shared, the tail's 3 slots copied into a block of its own.
    follow = BlockTable("chat")
    assert blocks.allocate(follow, tokens + [1, 2], 9) == 7
    assert blocks.take_moves() == [MoveSlots(tuple(tail_block * BLOCK + i for i in range(3)),
                                             tuple(follow.blocks[1] * BLOCK + i for i in range(3)))]
    assert (blocks.prefix_cache_queries, blocks.prefix_cache_hits) == (7 + 9, 7)
    # Only as far as the tokens agree, never the prompt's last token, and never under another salt.
    assert blocks.allocate(BlockTable("chat"), tokens[:5] + [99, 98], 7) == 5
    assert blocks.allocate(BlockTable("chat"), tokens[:6], 6) == 5
    assert blocks.allocate(BlockTable("other"), tokens + [1], 8) == 0
    blocks.take_moves()
    blocks.check()


def test_an_evicted_tail_is_forgotten():
    blocks = BlockManager(2, BLOCK)
    turn = BlockTable()
    blocks.allocate(turn, [5, 6, 7], 3)
    blocks.commit(turn, [5, 6, 7], 2)
    blocks.free(turn, [5, 6, 7], 2)
    assert blocks.cached_blocks == 1
    taker = BlockTable()
    assert blocks.allocate(taker, [1] * 8, 8) == 0  # both blocks, the tail's among them
    blocks.check()
    blocks.free(taker)
    assert blocks.allocate(BlockTable(), [5, 6, 7, 8], 4) == 0


def test_a_prompt_leaving_a_cached_block_midway_copies_the_slots_it_shares():
    blocks = BlockManager(16, BLOCK)
    running = BlockTable()
    tokens = list(range(10, 19))  # two full blocks and one token
    blocks.allocate(running, tokens, 9)
    blocks.commit(running, tokens, 9)
    # A reply rendered otherwise than generated: the prompt agrees with the second block's first 2 tokens only.
    other = BlockTable()
    assert blocks.allocate(other, tokens[:6] + [70, 71, 72], 9) == 6
    assert other.blocks[0] == running.blocks[0] and other.blocks[1] != running.blocks[1]
    assert blocks.take_moves() == [MoveSlots(tuple(running.blocks[1] * BLOCK + i for i in range(2)),
                                             tuple(other.blocks[1] * BLOCK + i for i in range(2)))]
    blocks.check()
