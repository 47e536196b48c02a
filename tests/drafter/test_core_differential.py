"""The compiled core against the pure-Python reference: the same random operation
sequences must give identical drafts, scores, counts and cache contents."""

from hypothesis import given, settings
from hypothesis import strategies as st

from drafter_service import SuffixDecodingCache as ArcticApiCache
from drafter_service import _core
from drafter_service.engine import draft_from_core
from drafter_service.reference.ngram import propose_ngram
from drafter_service.reference.suffix_decoding import SuffixDecodingCache
from drafter_service.reference.suffix_tree import SuffixTree

tokens = st.lists(st.integers(0, 3), max_size=8)
spec_args = st.tuples(
    st.integers(1, 10),                                # k
    st.sampled_from([0.5, 1.0, 2.0, 4.0]),             # factor
    st.sampled_from([-1.0, 0.0, 1.0, 3.0]),            # offset
    st.sampled_from([0.0, 0.1, 0.3, 0.5, 1.0]),        # min_token_prob
    st.booleans(),                                     # tree
    st.booleans(),                                     # reanchor
    st.sampled_from([0, 0, 1, 4]),                     # lookahead
)
tree_ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 3), tokens),
        st.tuples(st.just("repeat"), st.integers(0, 3), st.integers(1, 12)),
        st.tuples(st.just("remove"), st.integers(0, 3)),
        st.tuples(st.just("seal"), st.integers(0, 3)),
    ),
    max_size=14,
)
cache_ops = st.lists(
    st.one_of(
        st.tuples(st.just("start"), st.integers(0, 4), tokens, st.sampled_from(["", "t"]), st.integers(1, 8)),
        st.tuples(st.just("append"), st.integers(0, 4), tokens),
        st.tuples(st.just("repeat"), st.integers(0, 4), st.integers(1, 12)),
        st.tuples(st.just("speculate"), st.integers(0, 4), spec_args),
        st.tuples(st.just("stop"), st.integers(0, 4)),
        st.tuples(st.just("evict"), st.integers(0, 4)),
        st.tuples(st.just("snapshot"),),
    ),
    max_size=25,
)


def same(core_result, reference) -> bool:
    draft = draft_from_core(core_result)
    return draft == reference  # tokens, parents, probs, score, match length, source and step length


@settings(max_examples=250, deadline=None)
@given(max_depth=st.integers(1, 7), ops=tree_ops, contexts=st.lists(tokens, min_size=1, max_size=3), args=spec_args)
def test_suffix_tree_matches_reference(max_depth, ops, contexts, args):
    core, reference, model, sealed = _core.SuffixTree(max_depth), SuffixTree(max_depth), {}, set()
    for op in ops:
        seq = op[1]
        if op[0] in ("append", "repeat"):
            if seq in sealed:
                continue
            if seq not in model:
                core.add_sequence(seq)
                reference.add_sequence(seq)
                model[seq] = []
            new = op[2] if op[0] == "append" else model[seq][-op[2]:]
            core.append(seq, new)
            reference.append(seq, new)
            model[seq] += new
        elif seq in model and op[0] == "remove":
            core.remove_sequence(seq)
            reference.remove_sequence(seq)
            del model[seq]
            sealed.discard(seq)
        elif seq in model:
            core.seal(seq)
            sealed.add(seq)
        assert core.num_nodes == reference.num_nodes  # same node boundaries
    for pattern, count in reference.pattern_counts().items():
        assert core.count(list(pattern)) == count
    for context in contexts + [model[seq][-6:] for seq in model]:
        assert same(core.speculate(context, *args), reference.speculate(context, *args))


def cache_run(ops, max_cached_requests, max_cached_tokens):
    """Drives the reference, the core and the core's Arctic API alike, comparing after every operation."""
    depth = 6
    reference = SuffixDecodingCache(depth, max_cached_requests, max_cached_tokens)
    core = _core.Cache(depth, max_cached_requests, max_cached_tokens)
    # Mirrors the run while every request uses the Arctic API's one tenant and one depth.
    arctic = ArcticApiCache(depth, max_cached_requests, max_cached_tokens)
    contexts: dict[int, list[int]] = {}
    for op in ops:
        kind, req = op[0], (op[1] if len(op) > 1 else None)
        if kind == "start" and req not in contexts:
            reference.start_request(str(req), op[2], op[3], op[4])
            core.start_request(req, op[2], op[3], max_tree_depth=op[4])
            if op[3] != "" or op[4] != depth:
                arctic = None
            elif arctic is not None:
                arctic.start_request(str(req), tuple(op[2]))
            contexts[req] = list(op[2])
        elif kind in ("append", "repeat") and req in contexts:
            new = op[2] if kind == "append" else contexts[req][-op[2]:]
            reference.add_active_response(str(req), new)
            core.add_active_response(req, new)
            if arctic is not None:
                arctic.add_active_response(str(req), new if kind == "append" else tuple(new))
            contexts[req] += new
        elif kind == "speculate" and req in contexts:
            context = contexts[req]
            # The full context (every match length's position known from the request's sequences),
            # a shorter tail, and contexts that leave the sequences' tails one or two tokens back.
            for variant in (context, context[-3:], context[:-1] + [9], context[:-2] + [9] + context[-1:]):
                assert same(core.speculate(req, variant, *op[2]), reference.speculate(str(req), variant, *op[2]))
            k, factor, offset, min_token_prob, use_tree, *_ = op[2]
            if arctic is not None:  # drafts from the last max_tree_depth tokens of the context
                expected = reference.speculate(str(req), context[-depth:], k, factor, offset, min_token_prob,
                                               use_tree)
                got = arctic.speculate(str(req), context, max_spec_tokens=k, max_spec_factor=factor,
                                       max_spec_offset=offset, min_token_prob=min_token_prob, use_tree_spec=use_tree)
                assert (tuple(got.token_ids), tuple(got.parents), tuple(got.probs), got.score, got.match_len) == (
                    expected.token_ids, expected.parents, expected.probs, expected.score, expected.match_len)
            # The batch step drafts from the whole context with the session's params (defaults here).
            (stepped,) = core.step([req], [[]])
            assert same(stepped, reference.speculate(str(req), context, 16))
        elif kind == "stop" and req in contexts:
            reference.stop_request(str(req))
            core.stop_request(req)
            if arctic is not None:
                arctic.stop_request(str(req))
            del contexts[req]
        elif kind == "evict" and str(req) in reference.cached_requests:
            reference.evict_cached_response(str(req))
            core.evict_cached_response(req)
            if arctic is not None:
                arctic.evict_cached_response(str(req))
        elif kind == "snapshot":
            for active in list(contexts):  # a snapshot holds responses, not running requests
                reference.stop_request(str(active))
                core.stop_request(active)
                if arctic is not None:
                    arctic.stop_request(str(active))
            contexts.clear()
            restored = _core.Cache(depth, max_cached_requests, max_cached_tokens)
            restored.restore(core.snapshot())
            core = restored
        assert {str(req) for req in core.cached_requests()} == reference.cached_requests
        if arctic is not None:
            assert set(arctic.cached_requests) == reference.cached_requests
            assert set(arctic.active_requests) == reference.active_requests
        assert {str(req) for req in core.active_requests()} == reference.active_requests
        assert core.cached_tokens() == reference.cached_tokens


@settings(max_examples=250, deadline=None)
@given(ops=cache_ops, max_cached_requests=st.integers(0, 3), max_cached_tokens=st.sampled_from([0, 6, 20]))
def test_cache_matches_reference(ops, max_cached_requests, max_cached_tokens):
    cache_run(ops, max_cached_requests, max_cached_tokens)


@settings(max_examples=150, deadline=None)
@given(ops=cache_ops, max_cached_requests=st.integers(0, 3), max_cached_tokens=st.sampled_from([0, 6, 20]))
def test_arctic_api_matches_reference(ops, max_cached_requests, max_cached_tokens):
    one_tenant = [("start", op[1], op[2], "", 6) if op[0] == "start" else op for op in ops]
    cache_run(one_tenant, max_cached_requests, max_cached_tokens)


def latest_ngram(context, k, min_n, max_n):
    """Brute force: the longest suffix n in [min_n, max_n] with an earlier occurrence, its LATEST one."""
    end = len(context)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        starts = [p for p in range(end - n) if context[p:p + n] == context[end - n:]]
        if starts:
            follow = starts[-1] + n
            return tuple(context[follow:follow + k]), n
    return (), 0


@settings(max_examples=300, deadline=None)
@given(context=st.lists(st.integers(0, 2), max_size=40), chunk=st.integers(1, 7), k=st.integers(1, 6),
       min_n=st.integers(1, 3), extra=st.integers(0, 3))
def test_incremental_ngram_matches_full_rescan(context, chunk, k, min_n, extra):
    max_n = min_n + extra
    earliest, latest = _core.NgramIndex(min_n, max_n), _core.NgramIndex(min_n, max_n, latest=True)
    for start in range(0, len(context), chunk):  # appended in chunks, as steps commit them
        for index in (earliest, latest):
            index.append(context[start:start + chunk])
        prefix = context[:start + chunk]
        reference = propose_ngram(prefix, k, min_n, max_n)
        got = earliest.propose(k)
        assert (tuple(got[0]), got[4]) == (reference.token_ids, reference.match_len)
        assert earliest.propose_rescan(k) == got
        got_latest = latest.propose(k)
        assert (tuple(got_latest[0]), got_latest[4]) == latest_ngram(prefix, k, min_n, max_n)
