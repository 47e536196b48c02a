#include "ngram_index.h"

#include <algorithm>
#include <stdexcept>

namespace speclane {
namespace {

constexpr uint64_t kBase = 0x9E3779B97F4A7C15ull;  // odd: a unit modulo 2^64

}  // namespace

NgramIndex::NgramIndex(int min_n, int max_n, bool latest) : min_n_(min_n), max_n_(max_n), latest_(latest) {
  if (min_n < 1 || max_n < min_n || max_n > 1024) throw std::invalid_argument("need 1 <= min_n <= max_n <= 1024");
  starts_.resize(static_cast<size_t>(max_n - min_n + 1));
}

uint64_t NgramIndex::step_hash(uint64_t hash, int32_t token, uint64_t* power) const {
  // Polynomial hash read right to left, so every length shares one pass.
  hash += (static_cast<uint64_t>(static_cast<uint32_t>(token)) + 1) * *power;
  *power *= kBase;
  return hash == ~0ull ? 0 : hash;  // ~0 marks an empty EdgeMap slot
}

void NgramIndex::append(const int32_t* tokens, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    tokens_.push_back(tokens[i]);
    // The n-grams ending at the previous token now have a follower.
    size_t end = tokens_.size() - 1;
    uint64_t hash = 0, power = 1;
    for (size_t len = 1; len <= static_cast<size_t>(max_n_) && len <= end; ++len) {
      hash = step_hash(hash, tokens_[end - len], &power);
      if (len < static_cast<size_t>(min_n_)) continue;
      EdgeMap& starts = starts_[len - min_n_];
      if (latest_ || starts.find(hash) == kNone) starts.set(hash, static_cast<uint32_t>(end - len));
    }
  }
}

Draft NgramIndex::propose(int k) const {
  const size_t end = tokens_.size();
  const size_t longest = std::min(static_cast<size_t>(max_n_), end ? end - 1 : 0);
  if (k < 1 || longest < static_cast<size_t>(min_n_)) return draft_from(0, 0, 0);
  std::vector<uint64_t> hashes(longest + 1);
  uint64_t hash = 0, power = 1;
  for (size_t len = 1; len <= longest; ++len) hashes[len] = hash = step_hash(hash, tokens_[end - len], &power);
  for (size_t len = longest; len >= static_cast<size_t>(min_n_); --len) {
    uint32_t start = starts_[len - min_n_].find(hashes[len]);
    // A hash collision (not a real occurrence) counts as no match.
    if (start != kNone && std::equal(tokens_.begin() + start, tokens_.begin() + start + len, tokens_.end() - len))
      return draft_from(start + len, len, k);
  }
  return draft_from(0, 0, 0);
}

Draft NgramIndex::propose_rescan(int k) const {
  const size_t end = tokens_.size();
  const size_t max_n = std::min(static_cast<size_t>(max_n_), end ? end - 1 : 0);
  if (k < 1 || max_n < static_cast<size_t>(min_n_)) return draft_from(0, 0, 0);
  std::vector<int32_t> pattern(max_n);
  for (size_t i = 0; i < max_n; ++i) pattern[i] = tokens_[end - 1 - i];
  std::vector<size_t> fail(max_n, 0);
  for (size_t i = 1, border = 0; i < max_n; ++i) {
    while (border && pattern[i] != pattern[border]) border = fail[border - 1];
    if (pattern[i] == pattern[border]) ++border;
    fail[i] = border;
  }
  size_t best_len = 0, best_back = 0, state = 0;
  for (size_t back = 1; back < end; ++back) {
    int32_t token = tokens_[end - 1 - back];
    while (state && pattern[state] != token) state = fail[state - 1];
    if (pattern[state] == token) ++state;
    if (state >= best_len) best_len = state, best_back = back;  // ties move to the earlier occurrence
    if (state == max_n) state = fail[state - 1];
  }
  if (best_len < static_cast<size_t>(min_n_)) return draft_from(0, 0, 0);
  return draft_from(end - 1 - best_back + best_len, best_len, k);
}

Draft NgramIndex::draft_from(size_t follow, size_t match_len, int k) const {
  Draft draft;
  draft.source = kSourceNgram;
  draft.match_len = static_cast<int>(match_len);
  if (match_len == 0) return draft;
  size_t stop = std::min(tokens_.size(), follow + static_cast<size_t>(k));
  for (size_t i = follow; i < stop; ++i) {
    draft.parents.push_back(static_cast<int32_t>(draft.token_ids.size()) - 1);
    draft.token_ids.push_back(tokens_[i]);
  }
  return draft;
}

size_t NgramIndex::memory_bytes() const {
  size_t bytes = sizeof(*this) + tokens_.capacity() * sizeof(int32_t);
  for (const EdgeMap& starts : starts_) bytes += sizeof(starts) + starts.memory_bytes();
  return bytes;
}

}  // namespace speclane
