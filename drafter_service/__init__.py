"""The drafter: CPU-only proposers (SuffixDecoding trees, n-gram prompt lookup) behind a gRPC session API.

`from drafter_service import SuffixDecodingCache` is a drop-in for Arctic Inference's class, on the compiled core.
"""

from drafter_service.arctic import SuffixDecodingCache, SuffixDecodingDraft

__all__ = ["SuffixDecodingCache", "SuffixDecodingDraft"]
