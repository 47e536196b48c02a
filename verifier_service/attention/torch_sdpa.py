"""Attention over the paged cache in plain torch: the backend of the CPU, and
of any device that has none of its own yet.

The batch's segments are laid out padded, [sequences, longest segment] queries
against [sequences, longest context] keys gathered from the cache through the
block tables, and attended in one scaled_dot_product_attention call per layer.
Which key a query sees comes from the segments' compact descriptions (start,
length, pending tokens, draft parents, the layer's window), turned into one
boolean mask per pass on the device and shared by every layer with the same
window. Models whose scores need more than SDPA offers (softcapping,
attention sinks) take the same layout through explicit products.

Segments of similar lengths share a call (group_segments): padding every
segment to the pass's longest would make one sequence's long draft or prompt
chunk cost the whole batch (16 sequences at 600 tokens of context, one of them
verifying 25 tokens and the rest 4: 228 ms a pass padded together, 139 ms for
16 x 5 tokens), while each extra call costs the host its own gathers.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from verifier_service.attention.backend import LayerCall, slot_mapping
from verifier_service.batch import PassInputs, Segment
from verifier_service.kv_cache import PagedKVCache
from verifier_service.tree import depths, is_chain

# What one more padded call per layer costs, in query-key pairs times the query's width (heads x head
# dimension): the host's gathers and scatters, about 30 us on a CPU, where SDPA attends a pair of width 576
# in about 36 ns (measured on this project's 2-core hosts).
CALL_COST = 500_000


@dataclass
class Group:
    """Segments attended in one padded call."""

    query_index: torch.Tensor | None  # [B * Q] rows of the pass (T: a zero row for padding); None: rows first..
    first_row: int  # with query_index None: the group's queries are rows first .. first + B * Q, in order
    pass_rows: torch.Tensor  # [n] the pass rows the group's real queries answer
    padded_rows: torch.Tensor  # [n] where those are in the flattened [B * Q] output
    key_blocks: torch.Tensor  # [B * K / block_size] the blocks holding each segment's keys, in order
    visible: torch.Tensor  # [B, Q, K] bool, before any window
    query_positions: torch.Tensor  # [B, Q]
    key_positions: torch.Tensor  # [B, K]
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)
    biases: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor:
        if not window:
            return self.visible
        if window not in self.windowed:
            near = self.query_positions[:, :, None] - self.key_positions[:, None, :] < window
            self.windowed[window] = self.visible & near
        return self.windowed[window]

    def bias(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """The mask as SDPA's additive [B, 1, Q, K] bias (0 or -inf), made once per pass and window:
        SDPA adds a float bias faster than it applies a boolean mask on a CPU."""
        if window not in self.biases:
            allowed = self.mask(window)[:, None]
            self.biases[window] = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
                ~allowed, float("-inf"))
        return self.biases[window]


@dataclass
class Metadata:
    slot_mapping: torch.Tensor
    num_tokens: int
    groups: list[Group]

    @property
    def whole(self) -> bool:
        """One group whose padded queries are the pass's rows (decode or same-length verify steps)."""
        return len(self.groups) == 1 and self.groups[0].query_index is None


def group_segments(shapes: list[tuple[int, int]], call_pairs: float) -> list[list[int]]:
    """Which segments share a padded call: `shapes` holds each segment's (new
    tokens, context); a call pads its segments to the longest of each. Segments
    go into buckets by the powers of two of both (so padding at most doubles a
    segment's queries and keys), and neighbouring buckets merge where the
    pairs padding adds cost less than a call, `call_pairs` query-key pairs."""
    by_bucket: dict[tuple[int, int], list[int]] = {}
    for i, (num_tokens, context) in enumerate(shapes):
        by_bucket.setdefault(((num_tokens - 1).bit_length(), (context - 1).bit_length()), []).append(i)

    def pairs(members: list[int]) -> int:
        return len(members) * max(shapes[i][0] for i in members) * max(shapes[i][1] for i in members)

    groups: list[list[int]] = []
    for _, members in sorted(by_bucket.items()):
        if groups and pairs(groups[-1] + members) <= pairs(groups[-1]) + pairs(members) + call_pairs:
            groups[-1] += members
        else:
            groups.append(members)
    return groups


class TorchAttention:
    name = "torch-sdpa"
    split_kv = False

    def __init__(self, query_width: int):
        self.call_pairs = CALL_COST / query_width  # query_width: heads x head dimension of a layer's queries

    def prepare(self, segments: tuple[Segment, ...], inputs: PassInputs, block_size: int,
                device: torch.device) -> Metadata:
        return Metadata(slot_mapping(segments, block_size, device), inputs.positions.shape[1],
                        self.groups(segments, range(len(segments)), inputs, block_size, device))

    def groups(self, segments: tuple[Segment, ...], which, inputs: PassInputs, block_size: int,
               device: torch.device) -> list[Group]:
        """The padded calls that attend the segments `which` (indices into `segments`)."""
        which = list(which)
        shapes = [(segments[i].num_tokens, segments[i].start + segments[i].num_tokens) for i in which]
        positions = inputs.positions[0]
        return [padded_group([segments[which[m]] for m in members], [inputs.offsets[which[m]] for m in members],
                             positions, block_size, device) for members in group_segments(shapes, self.call_pairs)]

    def attend(self, metadata: Metadata, call: LayerCall, query: torch.Tensor, cache: PagedKVCache) -> torch.Tensor:
        if metadata.whole:
            return self._attend(metadata.groups[0], call, query, cache.kv[call.layer], cache)
        return self.attend_groups(metadata.groups, call, query, cache, None)

    def attend_groups(self, groups: list[Group], call: LayerCall, query: torch.Tensor, cache: PagedKVCache,
                      out: torch.Tensor | None) -> torch.Tensor:
        """Attends the rows of `groups` into `out` [T, heads, value_dim] (None: a new tensor, other rows unset)."""
        kv = cache.kv[call.layer]
        padded_query = torch.cat([query, query.new_zeros(1, *query.shape[1:])])
        for group in groups:
            q = (padded_query.index_select(0, group.query_index) if group.query_index is not None
                 else query[group.first_row:group.first_row + group.visible.shape[0] * group.visible.shape[1]])
            attended = self._attend(group, call, q, kv, cache)
            if out is None:
                out = query.new_empty(query.shape[0], *attended.shape[1:])
            out[group.pass_rows] = attended[group.padded_rows]
        return out

    @staticmethod
    def _attend(group: Group, call: LayerCall, query: torch.Tensor, kv: torch.Tensor,
                cache: PagedKVCache) -> torch.Tensor:
        """query [B * Q, heads, d] in the group's padded order; returns [B * Q, heads, d_v]."""
        batch, num_queries, context = group.visible.shape
        heads = query.shape[1]
        q = query.view(batch, num_queries, heads, -1).transpose(1, 2)  # [B, heads, Q, d]
        kv = _gather(kv, group.key_blocks, cache.block_size, batch, context)
        k, v = call.keys_values(kv[..., :cache.key_dim], kv[..., cache.key_dim:])
        if call.softcap or call.sinks is not None:
            o = _explicit_attention(q, k, v, group.mask(call.sliding_window), call)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=group.bias(call.sliding_window, q.dtype),
                                               scale=call.scaling, enable_gqa=k.shape[1] != heads)
        return o.transpose(1, 2).reshape(batch * num_queries, heads, o.shape[-1])


def _explicit_attention(q, k, v, mask, call: LayerCall) -> torch.Tensor:
    """What SDPA computes, with Gemma 2's score softcapping and GPT-OSS's sinks (a
    per-head logit in every softmax's denominator). Heads h = j * group + g share kv head j."""
    batch, heads, num_queries, dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads * num_queries, dim)
    scores = (grouped @ k.transpose(-1, -2)).float().view(batch, heads, num_queries, -1) * call.scaling
    if call.softcap:
        scores = torch.tanh(scores / call.softcap) * call.softcap
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    if call.sinks is not None:
        sinks = call.sinks.float().view(1, heads, 1, 1).expand(batch, heads, num_queries, 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = probs.to(v.dtype).reshape(batch, kv_heads, -1, scores.shape[-1])
    return (probs @ v).view(batch, heads, num_queries, v.shape[-1])


def _gather(cache: torch.Tensor, key_blocks: torch.Tensor, block_size: int, batch: int, context: int) -> torch.Tensor:
    """[B, kv_heads, K, dim] a layer's keys and values of the group's segments, copied a whole block at a time
    (one copy of block_size rows costs about what one row's does), then viewed up to the longest context, so
    SDPA attends no padding blocks."""
    blocks = cache.view(cache.shape[0] // block_size, block_size, *cache.shape[1:]).index_select(0, key_blocks)
    padded = len(key_blocks) // batch * block_size
    return blocks.view(batch, padded, *cache.shape[1:])[:, :context].transpose(1, 2)


def padded_group(segments: list[Segment], offsets: list[int], positions: torch.Tensor, block_size: int,
                 device: torch.device) -> Group:
    """One padded call's layout and visibility for `segments` (the Ascend backend builds a tree's mask with it)."""
    num_tokens = positions.shape[0]
    batch = len(segments)
    longest = max(seg.num_tokens for seg in segments)
    context = max(seg.start + seg.num_tokens for seg in segments)
    # Keys come in whole blocks: the ones past a segment's end are masked (the cache holds finite values there).
    num_blocks = -(-context // block_size)

    def column(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)[:, None]

    starts, lengths = column([s.start for s in segments]), column([s.num_tokens for s in segments])
    pending, first_row = column([s.num_pending for s in segments]), column(offsets)
    q_index = torch.arange(longest, device=device)[None, :]
    k_index = torch.arange(context, device=device)[None, :]

    real_query = q_index < lengths  # [B, Q]
    query_index = torch.where(real_query, first_row + q_index, num_tokens)
    flat = real_query.flatten().nonzero()[:, 0]
    pass_rows = query_index.flatten()[flat]

    # A shorter segment's missing blocks read block 0: masked, like every key past a segment's end.
    key_blocks = torch.tensor([(list(s.block_table) + [0] * num_blocks)[:num_blocks] for s in segments],
                              dtype=torch.long, device=device)
    local = k_index - starts  # [B, K] a key's index among the segment's new tokens (< 0: cached before)
    real_key = local < lengths

    padded_positions = torch.cat([positions, positions.new_zeros(1)])
    query_positions = padded_positions[query_index]
    new_key_rows = torch.where(real_key & (local >= 0), first_row + local, num_tokens)
    key_positions = torch.where(local < 0, k_index, padded_positions[new_key_rows])

    # Cached keys are seen by all; new ones causally (pending tokens, then a chain's nodes)...
    new_seen = (local[:, None, :] <= q_index[:, :, None]) & real_key[:, None, :]
    visible = (local[:, None, :] < 0) | new_seen
    trees = [i for i, s in enumerate(segments) if s.parents and not is_chain(s.parents)]
    if trees:  # ... and a tree's nodes only by their descendants
        visible &= _tree_visibility(segments, trees, pending, q_index, local, device)
    visible |= ~real_query[:, :, None]  # padding queries see everything: no empty softmax
    dense = bool(real_query.all()) and offsets == list(range(offsets[0], offsets[0] + batch * longest, longest))
    return Group(None if dense else query_index.flatten(), offsets[0], pass_rows, flat, key_blocks.flatten(),
                 visible, query_positions, key_positions)


def _tree_visibility(segments: list[Segment], trees: list[int], pending: torch.Tensor, q_index: torch.Tensor,
                     local: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[B, Q, K] False where a draft node would see a node that is not its ancestor.
    Ancestors are found by following parent pointers, as many times as the deepest tree is deep."""
    batch = len(segments)
    most = max(len(segments[i].parents) for i in trees)
    none = most  # the sentinel parent of a root's child, and of padding
    parents = torch.full((batch, most + 1), none, dtype=torch.long, device=device)
    for i in trees:
        tree = segments[i].parents
        parents[i, :len(tree)] = torch.tensor([p if p >= 0 else none for p in tree], dtype=torch.long)
    ancestor = torch.zeros(batch, most, most + 1, dtype=torch.bool, device=device)
    node = torch.arange(most, device=device).expand(batch, -1).contiguous()
    for _ in range(max(max(depths(segments[i].parents)) for i in trees)):
        ancestor.scatter_(2, node[..., None], True)
        node = parents.gather(1, node)
    query_node, key_node = q_index - pending, local - pending  # indices among the draft nodes
    both_drafts = (query_node >= 0)[:, :, None] & (key_node >= 0)[:, None, :] & (key_node < most)[:, None, :]
    is_tree = torch.zeros(batch, 1, 1, dtype=torch.bool, device=device)
    is_tree[trees] = True
    rows = torch.arange(batch, device=device)[:, None, None]
    seen = ancestor[rows, query_node.clamp(0, most - 1)[:, :, None], key_node.clamp(0, most - 1)[:, None, :]]
    return ~(both_drafts & is_tree) | seen
