"""One layer's attention at SmolLM2's shape (9 query heads, 3 KV heads, head dimension 64, fp32), the CPU kernel
(csrc/paged_attention.cc, reading blocks in place) against the padded path it replaced for short segments (a
whole-block gather through the block tables, then one SDPA call with a float mask); the host's threads. Contexts
of 300 to 300 + 7 x (sequences - 1) tokens in shuffled blocks. Prints a markdown row per shape: median us.

    flock /tmp/speclane-bench.lock .venv/bin/python docs/benchmarks/verifier-engine/attention_kernel.py
"""

import random
import statistics
import time

import torch
import torch.nn.functional as F

from verifier_service import _cpu_kernels

HEADS, KV_HEADS, DIM, BLOCK, CONTEXT = 9, 3, 64, 16, 300
# (sequences, new tokens each)
SHAPES = [(1, 1), (32, 1), (64, 1), (1, 3), (8, 3), (32, 3), (1, 6), (16, 6), (32, 6), (32, 8), (1, 12), (4, 12),
          (1, 16), (16, 16)]


def median_us(fn, repeats: int = 200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def row(sequences: int, queries: int) -> str:
    rng = random.Random(0)
    contexts = [CONTEXT + 7 * i for i in range(sequences)]
    needed = [-(-(c + queries) // BLOCK) for c in contexts]
    order = list(range(sum(needed)))
    rng.shuffle(order)
    width = max(needed)
    tables = []
    for count in needed:
        tables.append(order[:count] + [0] * (width - count))
        order = order[count:]
    cache = torch.randn(sum(needed) * BLOCK, KV_HEADS, 2 * DIM)
    table = torch.tensor(tables, dtype=torch.int64)
    segments = torch.tensor([(i * queries, queries, c) for i, c in enumerate(contexts)], dtype=torch.int64)
    query = torch.randn(sequences * queries, HEADS, DIM)
    out = torch.empty_like(query)

    def kernel():
        _cpu_kernels.attend(query.data_ptr(), out.data_ptr(), cache.data_ptr(), table.data_ptr(),
                            segments.data_ptr(), sequences, HEADS, KV_HEADS, DIM, DIM, BLOCK, width, 0,
                            DIM ** -0.5, torch.get_num_threads())

    longest = max(contexts) + queries
    blocks = table[:, :-(-longest // BLOCK)].flatten()
    index = torch.arange(longest)
    position = torch.tensor(contexts)[:, None, None] + torch.arange(queries)[None, :, None]
    bias = torch.zeros(sequences, 1, queries, longest).masked_fill_(~(index <= position)[:, None], float("-inf"))
    padded_query = query.view(sequences, queries, HEADS, DIM).transpose(1, 2)

    def padded():
        kv = cache.view(-1, BLOCK, KV_HEADS, 2 * DIM).index_select(0, blocks).view(sequences, -1, KV_HEADS, 2 * DIM)
        kv = kv[:, :longest].transpose(1, 2)
        return F.scaled_dot_product_attention(padded_query, kv[..., :DIM], kv[..., DIM:], attn_mask=bias,
                                              enable_gqa=True)

    kernel()
    assert torch.allclose(out.view(sequences, queries, HEADS, DIM).transpose(1, 2), padded(), atol=1e-5)
    kernel_us, padded_us = median_us(kernel), median_us(padded)
    return f"| {sequences} | {queries} | {kernel_us:.0f} | {padded_us:.0f} | {kernel_us / padded_us:.2f}x |"


def main() -> None:
    print(f"threads: {torch.get_num_threads()}\n")
    print("| sequences | new tokens each | kernel us | gather + SDPA us | kernel / padded |\n|---|---|---|---|---|")
    for sequences, queries in SHAPES:
        print(row(sequences, queries))


if __name__ == "__main__":
    main()
