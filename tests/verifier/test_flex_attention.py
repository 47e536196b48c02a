"""The FlexAttention backend's block lists: a compiled kernel reads only the
cache blocks the block mask lists for each 16 packed queries, so a block a
query sees that is missing from its list would be silently skipped on CUDA.
(Its logits, through the eager call that reads every slot, are checked on every
architecture in test_architectures.py.)"""

import random

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from verifier_service.attention.backend import LayerCall
from verifier_service.attention.flex import QUERY_BLOCK, FlexAttention, key_span
from verifier_service.batch import Segment, StepPlan, pass_inputs
from verifier_service.kv_cache import KVGeometry, PagedKVCache

BLOCK = 4
NUM_BLOCKS = 96


def mixed_pass(seed: int):
    """Decodes over long contexts, a chain, a tree and a prompt chunk, on shuffled blocks."""
    rng = random.Random(seed)
    shapes = [(0, 1, ()), (37, 1, ()), (90, 1, ()), (12, 1, (-1, 0, 1, 2)), (25, 1, (-1, -1, 0, 0, 1, 4)),
              (0, 22, ()), (61, 1, ()), (5, 3, ())]
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    segments = []
    for start, pending, parents in shapes:
        count = -(-(start + pending + len(parents)) // BLOCK) + rng.randint(0, 2)  # tables may reach past the end
        table, free = tuple(free[:count]), free[count:]
        segments.append(Segment(table, start, pending, parents))
    plan = StepPlan((), tuple(rng.randrange(100) for _ in range(sum(s.num_tokens for s in segments))),
                    tuple(segments))
    return plan, pass_inputs(plan, torch.device("cpu"))


def cache(kv_heads=2, dim=8) -> PagedKVCache:
    kv = PagedKVCache(KVGeometry(1, kv_heads, dim, dim), NUM_BLOCKS, BLOCK, torch.float32, torch.device("cpu"),
                      split=True)
    kv.keys[0].normal_()
    kv.values[0].normal_()
    return kv


@pytest.mark.parametrize("window", [None, 6, 40])
def test_every_key_a_query_sees_is_in_a_block_listed_for_its_queries(window):
    plan, inputs = mixed_pass(1)
    kv = cache()
    metadata = FlexAttention(4, 2, compiled=False).prepare(plan.segments, inputs, BLOCK, torch.device("cpu"))
    block_mask = metadata.block_mask(window, kv, compiled=True)  # the mask function a kernel applies
    slots = NUM_BLOCKS * BLOCK
    seen = create_mask(block_mask.mask_mod, 1, 1, metadata.num_tokens, slots, device="cpu")[0, 0]
    # Blocks of 4 slots are listed by spans of 16 (4 consecutive blocks): a Triton tile's fewest keys.
    span = key_span(BLOCK)
    assert (span, block_mask.BLOCK_SIZE[1]) == (16, 16)
    listed = torch.zeros(metadata.num_tokens, slots // span, dtype=torch.bool)
    counts, indices = block_mask.kv_num_blocks[0, 0], block_mask.kv_indices[0, 0]
    for q in range(metadata.num_tokens):
        listed[q, indices[q // QUERY_BLOCK, :counts[q // QUERY_BLOCK]].long()] = True
    seen_spans = seen.view(metadata.num_tokens, slots // span, span).any(-1)
    assert seen_spans.any(-1).all()  # every query sees something
    assert not (seen_spans & ~listed).any()
    # ... and a list holds only the spans of its queries' own segments' blocks (a window drops early ones).
    for b in range(len(counts)):
        own = {block * BLOCK // span for seg in set(metadata.segment[b * QUERY_BLOCK:(b + 1) * QUERY_BLOCK].tolist())
               for block in metadata.tables[seg].tolist() if block >= 0}
        listed_here = set(indices[b, :counts[b]].tolist())
        assert listed_here == own if window is None else listed_here <= own
    if window:
        assert counts.sum() < metadata.block_mask(None, kv, compiled=True).kv_num_blocks.sum()


@pytest.mark.e2e  # inductor compiles the kernel with the host's C++ compiler, in a process of its own
def test_the_compiled_kernel_reading_only_the_listed_blocks_equals_the_eager_call_reading_all():
    """FlexAttention compiled for the CPU honours the block lists as the CUDA kernel does (the eager call
    ignores them): equal outputs show the lists hold every block a query needs, for causal rows, a tree, a
    window and softcapping at once. (Compiled for the CPU, FlexAttention does not return the log-sum-exp that
    sinks need.)"""
    kv = cache()
    eager, compiled = FlexAttention(4, 2, compiled=False), FlexAttention(4, 2, compiled=True)
    call = LayerCall(0, 8 ** -0.5, sliding_window=6, softcap=5.0)
    for seed, segments in ((2, 8), (3, 6)):  # two passes of other sizes: the kernel compiled for dynamic shapes
        plan, _ = mixed_pass(seed)
        plan = StepPlan((), plan.input_ids[:sum(s.num_tokens for s in plan.segments[:segments])],
                        plan.segments[:segments])
        inputs = pass_inputs(plan, torch.device("cpu"))
        query = torch.randn(inputs.positions.shape[1], 4, 8)
        expected = eager.attend(eager.prepare(plan.segments, inputs, BLOCK, torch.device("cpu")), call, query, kv)
        got = compiled.attend(compiled.prepare(plan.segments, inputs, BLOCK, torch.device("cpu")), call, query, kv)
        assert torch.allclose(got, expected, atol=1e-5), seed
