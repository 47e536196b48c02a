"""The drafter: CPU-only proposers (SuffixDecoding trees, n-gram prompt lookup) behind a gRPC session API."""
