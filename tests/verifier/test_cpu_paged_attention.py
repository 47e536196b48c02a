"""The CPU attention kernel (csrc/paged_attention.cc) against SDPA over the same keys, gathered in order."""

import random

import pytest
import torch
import torch.nn.functional as F

from verifier_service import _cpu_kernels

BLOCK = 16


def reference(query, cache, tables, segments, key_dim, window, scale):
    out = torch.empty(query.shape[0], query.shape[1], cache.shape[2] - key_dim)
    for (first, queries, cached), table in zip(segments.tolist(), tables):
        index = torch.arange(cached + queries)
        kv = cache[table[index // BLOCK] * BLOCK + index % BLOCK]  # [keys, kv_heads, key_dim + value_dim]
        k, v = kv[..., :key_dim].transpose(0, 1), kv[..., key_dim:].transpose(0, 1)
        position = cached + torch.arange(queries)[:, None]
        seen = index[None, :] <= position
        if window:
            seen &= position - index[None, :] < window
        q = query[first:first + queries].transpose(0, 1)
        out[first:first + queries] = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=seen, scale=scale, enable_gqa=True)[0].transpose(0, 1)
    return out


def kernel(query, cache, tables, segments, key_dim, window, scale, threads):
    out = torch.full((query.shape[0], query.shape[1], cache.shape[2] - key_dim), float("nan"))
    _cpu_kernels.attend(query.data_ptr(), out.data_ptr(), cache.data_ptr(), tables.data_ptr(),
                        segments.data_ptr(), len(segments), query.shape[1], cache.shape[1], key_dim,
                        cache.shape[2] - key_dim, BLOCK, tables.shape[1], window, scale, threads)
    return out


def random_pass(rng: random.Random, shapes, heads, kv_heads, key_dim, value_dim):
    """shapes: (new tokens, cached tokens) per segment; blocks handed out shuffled."""
    needed = [-(-(queries + cached) // BLOCK) for queries, cached in shapes]
    order = list(range(sum(needed) + 3))
    rng.shuffle(order)
    width = max(needed)
    tables, rows, first = [], [], 0
    for (queries, cached), count in zip(shapes, needed):
        blocks, order = order[:count], order[count:]
        tables.append(blocks + [0] * (width - count))
        rows.append((first, queries, cached))
        first += queries
    cache = torch.randn((sum(needed) + 3) * BLOCK, kv_heads, key_dim + value_dim)
    return (torch.randn(first, heads, key_dim), cache, torch.tensor(tables, dtype=torch.int64),
            torch.tensor(rows, dtype=torch.int64))


@pytest.mark.parametrize("heads, kv_heads, key_dim, value_dim", [
    (9, 3, 64, 64),  # SmolLM2's layout
    (4, 4, 128, 128),  # no grouping
    (8, 2, 16, 16),  # the tiny test models'
    (6, 2, 96, 96),  # six vectors a row: accumulators for two rows at a time
    (2, 1, 256, 256),  # a row's values in two halves
])
@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_equals_sdpa(heads, kv_heads, key_dim, value_dim, window, threads):
    """Segments of 1 to 17 tokens over 0 to 300 cached: partial tiles of keys and of query rows."""
    rng = random.Random(heads * 1000 + key_dim + window)
    shapes = [(rng.randint(1, 6), rng.randint(0, 70)) for _ in range(9)] + [(1, 0), (6, 300), (17, 33)]
    query, cache, tables, segments = random_pass(rng, shapes, heads, kv_heads, key_dim, value_dim)
    scale = key_dim ** -0.5
    got = kernel(query, cache, tables, segments, key_dim, window, scale, threads)
    assert torch.allclose(got, reference(query, cache, tables, segments, key_dim, window, scale), atol=2e-6)


def test_a_sequence_gets_the_same_bits_alone_and_in_any_batch():
    rng = random.Random(3)
    query, cache, tables, segments = random_pass(rng, [(3, 40), (1, 500), (5, 9), (2, 130)], 9, 3, 64, 64)
    together = kernel(query, cache, tables, segments, 64, 0, 0.125, 2)
    for i, (first, queries, cached) in enumerate(segments.tolist()):
        alone = kernel(query[first:first + queries].contiguous(), cache, tables[i:i + 1],
                       torch.tensor([[0, queries, cached]]), 64, 0, 0.125, 1)
        assert torch.equal(alone, together[first:first + queries])


def test_head_dimensions_without_a_compiled_kernel_are_refused():
    assert _cpu_kernels.attends(64, 64) and _cpu_kernels.attends(128, 128)
    assert not _cpu_kernels.attends(48, 48) and not _cpu_kernels.attends(192, 128)  # the padded path takes these
    rng = random.Random(0)
    query, cache, tables, segments = random_pass(rng, [(1, 5)], 4, 1, 48, 48)
    with pytest.raises(ValueError, match="head dimensions"):
        kernel(query, cache, tables, segments, 48, 0, 0.1, 1)
