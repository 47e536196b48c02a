"""Token-sequence helpers every service uses."""


def common_prefix(a, b) -> int:
    """How many leading tokens two sequences share: a cached prompt's reusable KV, or how much of a
    draft the target wrote (greedy verification accepts exactly that)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
