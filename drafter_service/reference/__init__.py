"""Pure-Python oracles of the compiled drafter core (drafter_service/csrc): the
suffix tree, SuffixDecoding's per-request and global trees, and n-gram prompt
lookup, written for clarity. The service never runs them; the differential
tests drive them and the core with the same operations and compare."""
