// Incremental n-gram prompt lookup (vLLM v1 semantics, see drafter_service/ngram.py):
// the longest n in [min_n, max_n] whose last-n tokens occurred earlier in the
// context, followed by at least one token; earliest (vLLM) or latest occurrence.
//
// Each appended token makes the n-grams ending just before it eligible: one
// hash insert per n. A lookup hashes the context's last n tokens for each n,
// longest first. Both cost O(max_n), independent of the context length,
// where vLLM rescans the whole context every step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "draft.h"
#include "edge_map.h"

namespace speclane {

class NgramIndex {
 public:
  NgramIndex(int min_n, int max_n, bool latest);

  void append(const int32_t* tokens, size_t n);
  Draft propose(int k) const;
  // The same answer by a full Knuth-Morris-Pratt pass over the reversed context
  // (earliest occurrence only): the baseline the index replaces.
  Draft propose_rescan(int k) const;
  const std::vector<int32_t>& tokens() const { return tokens_; }
  size_t memory_bytes() const;

 private:
  uint64_t step_hash(uint64_t hash, int32_t token, uint64_t* power) const;
  Draft draft_from(size_t follow, size_t match_len, int k) const;

  int min_n_, max_n_;
  bool latest_;
  std::vector<int32_t> tokens_;
  std::vector<EdgeMap> starts_;  // per n - min_n: n-gram hash -> start of its chosen occurrence
};

}  // namespace speclane
