"""SuffixDecodingCache: per-request trees, per-tenant global response trees, FIFO eviction."""

from drafter_service.draft import SOURCE_GLOBAL, SOURCE_REQUEST
from drafter_service.reference.suffix_decoding import SuffixDecodingCache

RESPONSE = list(range(100, 120))


def run_request(cache, req_id, prompt, response, tenant=""):
    cache.start_request(req_id, prompt, tenant)
    for token in response:  # token by token, as decoding commits them
        cache.add_active_response(req_id, [token])
    cache.stop_request(req_id)


def draft_after(cache, prompt, generated, tenant=""):
    """Draft for a new request whose output so far is `generated`."""
    cache.start_request("probe", prompt, tenant)
    cache.add_active_response("probe", generated)
    draft = cache.speculate("probe", prompt + generated, max_spec_tokens=8, max_spec_factor=4.0)
    cache.stop_request("probe")
    cache.evict_cached_response("probe")
    return draft


def test_per_request_tree_drafts_from_the_prompt():
    cache = SuffixDecodingCache(max_tree_depth=8, max_cached_requests=0)
    cache.start_request("r", [1, 2, 3, 4, 5, 6], "")
    cache.add_active_response("r", [1, 2])
    draft = cache.speculate("r", [1, 2, 3, 4, 5, 6, 1, 2], max_spec_tokens=4)
    assert draft.token_ids == (3, 4)  # budget = floor(1.0 * match_len 2)
    assert draft.source == SOURCE_REQUEST


def test_global_tree_learns_from_a_finished_request():
    cache = SuffixDecodingCache(max_tree_depth=16, max_cached_requests=10)
    before = draft_after(cache, [7, 8, 9], RESPONSE[:3])
    run_request(cache, "a", [1, 2, 3], RESPONSE)
    after = draft_after(cache, [7, 8, 9], RESPONSE[:3])
    assert before.token_ids == ()
    assert after.token_ids == tuple(RESPONSE[3:11])
    assert after.source == SOURCE_GLOBAL
    assert cache.active_requests == frozenset()
    assert cache.cached_requests == {"a"}


def test_running_requests_feed_the_global_tree_at_once():
    cache = SuffixDecodingCache(max_tree_depth=16, max_cached_requests=10)
    cache.start_request("a", [1, 2, 3], "")
    cache.add_active_response("a", RESPONSE[:10])
    assert draft_after(cache, [7], RESPONSE[:3]).token_ids == tuple(RESPONSE[3:10])


def test_prompts_do_not_enter_the_global_tree():
    cache = SuffixDecodingCache(max_tree_depth=16, max_cached_requests=10)
    run_request(cache, "a", RESPONSE, [1, 2])
    assert draft_after(cache, [7], RESPONSE[:3]).token_ids == ()


def test_fifo_eviction_by_max_cached_requests():
    cache = SuffixDecodingCache(max_tree_depth=16, max_cached_requests=2)
    responses = {name: [offset + i for i in range(10)] for name, offset in (("r1", 200), ("r2", 300), ("r3", 400))}
    for name, response in responses.items():
        run_request(cache, name, [1], response)
    assert cache.cached_requests == {"r2", "r3"}
    # A probe request takes a slot too, evicting r2 while it runs; r3 stays.
    assert draft_after(cache, [1], responses["r1"][:3]).token_ids == ()
    assert draft_after(cache, [1], responses["r3"][:3]).token_ids == tuple(responses["r3"][3:10])
    assert cache.cached_requests == {"r3"}


def test_tenants_never_share_responses():
    cache = SuffixDecodingCache(max_tree_depth=16, max_cached_requests=10)
    run_request(cache, "a", [1], RESPONSE, tenant="tenant-a")
    assert draft_after(cache, [1], RESPONSE[:3], tenant="tenant-b").token_ids == ()
    assert draft_after(cache, [1], RESPONSE[:3], tenant="").token_ids == ()
    assert draft_after(cache, [1], RESPONSE[:3], tenant="tenant-a").token_ids == tuple(RESPONSE[3:11])


def test_zero_max_cached_requests_disables_the_global_tree():
    cache = SuffixDecodingCache(max_tree_depth=8, max_cached_requests=0)
    run_request(cache, "a", [1], RESPONSE)
    assert cache.cached_requests == frozenset()
    cache.start_request("b", [1], "")
    cache.add_active_response("b", RESPONSE[:3])
    assert cache.speculate("b", [1, *RESPONSE[:3]], max_spec_tokens=8).token_ids == ()


def test_higher_score_wins_between_request_and_global_drafts():
    cache = SuffixDecodingCache(max_tree_depth=16, max_cached_requests=10)
    run_request(cache, "a", [1], [5, 6, 7, 8, 9, 10])
    # The request's own prompt says 5 -> 50 once; the global tree says 5 -> 6 -> 7 ... for sure.
    cache.start_request("b", [5, 50, 2], "")
    cache.add_active_response("b", [5])
    draft = cache.speculate("b", [5, 50, 2, 5], max_spec_tokens=4, max_spec_offset=3)
    assert draft.token_ids == (6, 7, 8, 9)
    assert draft.source == SOURCE_GLOBAL


def test_empty_responses_are_not_cached():
    cache = SuffixDecodingCache(max_tree_depth=16, max_cached_requests=10)
    run_request(cache, "a", [1, 2], [])
    assert cache.cached_requests == frozenset()


def test_restarting_a_request_id_replaces_its_cached_response():
    cache = SuffixDecodingCache(max_tree_depth=16, max_cached_requests=10)
    run_request(cache, "a", [1], RESPONSE)
    run_request(cache, "a", [1], [1, 2, 3])
    assert draft_after(cache, [9], RESPONSE[:3]).token_ids == ()
