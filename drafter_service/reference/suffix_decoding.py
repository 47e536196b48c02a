"""The SuffixDecoding cache: a per-request suffix tree over prompt + output and
a global tree over earlier responses (not prompts), one per tenant.

Responses enter the global tree token by token while their requests run, so
concurrent requests benefit at once; each tenant's tree keeps at most
`max_cached_requests` responses, and all trees together at most
`max_cached_tokens` response tokens (0: no limit), evicting whole responses
first in, first out. The API follows Arctic Inference's SuffixDecodingCache.
This is the pure-Python reference; the service runs the compiled twin
(drafter_service/csrc), which is tested against it.
"""

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from drafter_service.draft import SOURCE_GLOBAL, SOURCE_REQUEST, Draft
from drafter_service.reference.suffix_tree import SuffixTree

_LOCAL_SEQUENCE = 0  # the one sequence of a per-request tree: prompt + output


@dataclass
class _TenantResponses:
    tree: SuffixTree
    fifo: OrderedDict = field(default_factory=OrderedDict)  # request id -> None, oldest first


@dataclass
class _ActiveRequest:
    tree: SuffixTree
    tenant: str


class SuffixDecodingCache:
    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000, max_cached_tokens: int = 0):
        if max_tree_depth < 1:
            raise ValueError("max_tree_depth must be >= 1")
        if max_cached_requests < 0:
            raise ValueError("max_cached_requests must be >= 0")
        if max_cached_tokens < 0:
            raise ValueError("max_cached_tokens must be >= 0")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_cached_tokens = max_cached_tokens
        self.cached_tokens = 0
        self._active: dict[str, _ActiveRequest] = {}
        self._tenants: dict[str, _TenantResponses] = {}
        self._tenant_of_cached: dict[str, str] = {}  # request id -> tenant, oldest first

    @property
    def active_requests(self) -> frozenset[str]:
        return frozenset(self._active)

    @property
    def cached_requests(self) -> frozenset[str]:
        """Requests whose response is in a global tree (running ones included)."""
        return frozenset(self._tenant_of_cached)

    def start_request(self, req_id: str, prompt_token_ids: Sequence[int], tenant: str = "",
                      max_tree_depth: int | None = None) -> None:
        """Indexes the prompt in a new per-request tree and opens the request's
        response in its tenant's global tree (a cached response of the same id is replaced)."""
        if req_id in self._active:
            raise ValueError(f"request {req_id!r} is already active")
        if req_id in self._tenant_of_cached:
            self.evict_cached_response(req_id)
        local = SuffixTree(max_tree_depth or self.max_tree_depth)
        local.add_sequence(_LOCAL_SEQUENCE)
        local.append(_LOCAL_SEQUENCE, prompt_token_ids)
        self._active[req_id] = _ActiveRequest(local, tenant)
        if self.max_cached_requests == 0:
            return
        responses = self._tenants.get(tenant)
        if responses is None:
            responses = self._tenants[tenant] = _TenantResponses(SuffixTree(self.max_tree_depth))
        responses.tree.add_sequence(req_id)
        responses.fifo[req_id] = None
        self._tenant_of_cached[req_id] = tenant
        while len(responses.fifo) > self.max_cached_requests:
            self.evict_cached_response(next(iter(responses.fifo)))

    def add_active_response(self, req_id: str, token_ids: Sequence[int]) -> None:
        request = self._active[req_id]
        request.tree.append(_LOCAL_SEQUENCE, token_ids)
        responses = self._tenants.get(request.tenant)
        # The response may already be evicted when more requests run than the cache holds.
        if responses is not None and req_id in responses.tree:
            responses.tree.append(req_id, token_ids)
            self.cached_tokens += len(token_ids)
            while self.max_cached_tokens and self.cached_tokens > self.max_cached_tokens:
                self.evict_cached_response(next(iter(self._tenant_of_cached)))

    def stop_request(self, req_id: str) -> None:
        """Drops the per-request tree; a non-empty response stays in the global tree."""
        request = self._active.pop(req_id)
        responses = self._tenants.get(request.tenant)
        if responses is not None and req_id in responses.tree and responses.tree.sequence_length(req_id) == 0:
            self.evict_cached_response(req_id)

    def evict_cached_response(self, req_id: str) -> None:
        tenant = self._tenant_of_cached.pop(req_id, None)
        if tenant is None:
            raise ValueError(f"request {req_id!r} has no cached response")
        responses = self._tenants[tenant]
        self.cached_tokens -= responses.tree.sequence_length(req_id)
        responses.tree.remove_sequence(req_id)
        del responses.fifo[req_id]
        if not responses.fifo:
            del self._tenants[tenant]

    def speculate(
        self,
        req_id: str,
        context: Sequence[int],
        max_spec_tokens: int,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        use_tree_spec: bool = False,
        reanchor: bool = True,
        lookahead: int = 0,
    ) -> Draft:
        """Drafts from the request's own tree and its tenant's global tree; the
        higher score wins whole (ties keep the request's own draft)."""
        request = self._active[req_id]
        args = (context, max_spec_tokens, max_spec_factor, max_spec_offset, min_token_prob, use_tree_spec, reanchor,
                lookahead)
        draft = replace(request.tree.speculate(*args), source=SOURCE_REQUEST)
        responses = self._tenants.get(request.tenant)
        if responses is not None:
            global_draft = responses.tree.speculate(*args)
            if global_draft.score > draft.score:
                draft = replace(global_draft, source=SOURCE_GLOBAL)
        return draft
