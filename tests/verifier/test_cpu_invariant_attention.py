"""The CPU's batch-invariant attention kernel (csrc/invariant_attention.cc):
right against SDPA over the same keys, and each query's bits its own, as a
plain decode step of that token computes them, whatever else the pass holds."""

import random

import numpy as np
import pytest
import torch

from tests.verifier.test_cpu_paged_attention import BLOCK, random_pass, reference
from verifier_service import _cpu_kernels
from verifier_service.attention.cpu_invariant import previous_tokens
from verifier_service.batch import Segment
from verifier_service.batch_invariant import spread_values
from verifier_service.tree import ancestors

WIDE_TREE = (-1, -1, -1, -1, 1, 1, 1, 1, 6, 6, 6, 6, 8, 8, 8, 8)  # each path among its siblings


def kernel(query, cache, tables, segments, previous, head_dim, scale, threads=2):
    out = torch.full_like(query, float("nan"))
    _cpu_kernels.attend_invariant(query.data_ptr(), out.data_ptr(), cache.data_ptr(), tables.data_ptr(),
                                  segments.data_ptr(), previous.data_ptr(), len(segments), query.shape[1],
                                  cache.shape[1], head_dim, BLOCK, tables.shape[1], scale,
                                  cache.dtype == torch.bfloat16, threads)
    return out


def chains(segments: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.arange(queries) - 1 for _, queries, _ in segments.tolist()])


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (14, 2, 64), (8, 2, 16), (2, 1, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_chains_and_prompt_chunks_equal_sdpa(heads, kv_heads, head_dim, dtype, threads):
    rng = random.Random(heads + head_dim)
    # Decodes, chains, and prompt chunks longer than the kernel's 32 queries scored together.
    shapes = [(rng.randint(1, 6), rng.randint(0, 70)) for _ in range(6)] + [(1, 0), (70, 0), (40, 300)]
    query, cache, tables, segments = random_pass(rng, shapes, heads, kv_heads, head_dim, head_dim)
    query, cache = query.to(dtype), cache.to(dtype)
    scale = head_dim ** -0.5
    got = kernel(query, cache, tables, segments, chains(segments), head_dim, scale, threads).float()
    expected = reference(query.float(), cache.float(), tables, segments, head_dim, 0, scale)
    tolerance = 2e-6 if dtype == torch.float32 else 2 ** -8 * expected.abs().max().item()
    assert torch.allclose(got, expected, atol=tolerance)


def test_a_tree_node_gets_the_bits_of_its_own_plain_decode_beside_other_sequences():
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, cached = 14, 2, 64, 90
    tree = Segment(block_table=(), start=cached, num_pending=1, parents=WIDE_TREE)
    # Another sequence's chain first, then the tree's segment; blocks in a shuffled order.
    shapes = [(3, 40), (tree.num_tokens, cached)]
    query, cache, tables, segments = random_pass(random.Random(1), shapes, heads, kv_heads, dim, dim)
    query = spread_values(generator, torch.device("cpu"), torch.bfloat16, *query.shape)
    cache = spread_values(generator, torch.device("cpu"), torch.bfloat16, *cache.shape)
    previous = torch.cat([torch.arange(3) - 1, torch.from_numpy(previous_tokens(tree))])
    together = kernel(query, cache, tables, segments, previous, dim, dim ** -0.5)

    first = segments[1, 0].item()
    slots = tables[1, torch.arange(cached + tree.num_tokens) // BLOCK] * BLOCK + torch.arange(
        cached + tree.num_tokens) % BLOCK
    for node, path in enumerate(ancestors(WIDE_TREE)):
        # The plain step: the context, the pending token, then the node's path, side by side in a cache of its own.
        order = torch.cat([slots[:cached + 1], slots[cached + 1 + torch.tensor(path, dtype=torch.long)]])
        plain_cache = torch.zeros(-(-len(order) // BLOCK) * BLOCK, kv_heads, 2 * dim, dtype=torch.bfloat16)
        plain_cache[:len(order)] = cache[order]
        plain = kernel(query[first + 1 + node][None].contiguous(), plain_cache,
                       torch.arange(plain_cache.shape[0] // BLOCK)[None], torch.tensor([[0, 1, len(order) - 1]]),
                       torch.tensor([-1]), dim, dim ** -0.5, threads=1)
        assert torch.equal(plain[0], together[first + 1 + node]), node


def test_the_previous_token_of_each_new_token_follows_the_chain_then_the_tree():
    assert previous_tokens(Segment((), 5, 3)).tolist() == [-1, 0, 1]
    assert previous_tokens(Segment((), 5, 2, (-1, -1, 0, 2))).tolist() == [-1, 0, 1, 1, 2, 4]
    assert np.array_equal(previous_tokens(Segment((), 0, 1, (-1, 0, 1))), [-1, 0, 1, 2])  # a chain as a tree
