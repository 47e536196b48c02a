"""The compiled drafter core as the service uses it: sessions keyed by ints,
and the steps a message carries drafted in one batch call (which runs without
the GIL)."""

import itertools
from collections.abc import Sequence

from drafter_service import _core
from drafter_service.draft import SOURCE_GLOBAL, SOURCE_NGRAM, SOURCE_REQUEST, Detour, Draft
from speclane.speculation import SpeculationSettings

CORE_SOURCES = {_core.SOURCE_REQUEST: SOURCE_REQUEST, _core.SOURCE_GLOBAL: SOURCE_GLOBAL,
                _core.SOURCE_NGRAM: SOURCE_NGRAM}
_CORE_METHODS = {"suffix": _core.METHOD_SUFFIX, "ngram": _core.METHOD_NGRAM}
# A step's suffix budget (max_spec_factor, min_token_prob) where it overrides the session's: a factor <= 0
# or a probability < 0 keeps the session's (drafter.v1.Step).
StepBudget = tuple[float, float]
SESSION_BUDGET: StepBudget = (0.0, -1.0)


def step_budget(max_spec_factor: float | None = None, min_token_prob: float | None = None) -> StepBudget:
    """The engine's form of a step's budget; None: the session's."""
    return (SESSION_BUDGET[0] if max_spec_factor is None else max_spec_factor,
            SESSION_BUDGET[1] if min_token_prob is None else min_token_prob)


# What the core's step returns per sequence: (token_ids, parents, probs, score, match_len, source, step_len,
# detours), each detour (position, token, token_ids, probs); converted straight to protobuf where served.
CoreDraft = tuple


def draft_from_core(result: CoreDraft) -> Draft:
    """The core's draft as the reference implementation gives it, to compare the two."""
    token_ids, parents, probs, score, match_len, source, step_len, detours = result
    return Draft(tuple(token_ids), tuple(parents), tuple(probs), score, match_len, CORE_SOURCES.get(source, ""),
                 step_len, tuple(Detour(position, token, tuple(tokens), tuple(detour_probs))
                                 for position, token, tokens, detour_probs in detours))


class DraftEngine:
    def __init__(self, max_tree_depth: int, max_cached_requests: int, max_cached_tokens: int = 0,
                 share_tenants: bool = False):
        self.core = _core.Cache(max_tree_depth, max_cached_requests, max_cached_tokens)
        self._share_tenants = share_tenants
        self._ids = itertools.count()

    def restore(self, data: bytes) -> None:
        """Loads a snapshot into this (empty) engine; raises ValueError if it is malformed."""
        self.core.restore(data)
        self._ids = itertools.count(max(self.core.cached_requests(), default=-1) + 1)

    def start(self, prompt_token_ids: Sequence[int], settings: SpeculationSettings, tenant: str,
              lookahead: int = 0) -> int:
        """A session; each draft goes on `lookahead` tokens past its step where it can (Draft.step_len)."""
        seq_id = next(self._ids)
        self.core.start_request(
            seq_id, list(prompt_token_ids), "" if self._share_tenants else tenant,
            method=_CORE_METHODS[settings.method], max_spec_tokens=settings.num_speculative_tokens,
            max_spec_factor=settings.suffix_decoding_max_spec_factor,
            min_token_prob=settings.suffix_decoding_min_token_prob,
            prompt_lookup_min=settings.prompt_lookup_min, prompt_lookup_max=settings.prompt_lookup_max,
            lookahead=lookahead)
        return seq_id

    def step(self, seq_ids: Sequence[int], token_ids: Sequence[list[int]],
             budgets: Sequence[StepBudget]) -> list[CoreDraft]:
        """Commits each sequence's new tokens and drafts under its budget, all in one call."""
        return self.core.step(seq_ids, token_ids, budgets)

    def end(self, seq_id: int) -> None:
        self.core.stop_request(seq_id)
