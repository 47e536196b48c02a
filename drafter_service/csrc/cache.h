// The SuffixDecoding cache (compiled twin of drafter_service/suffix_decoding.py)
// plus n-gram sessions, a batch step and snapshots.
//
// Active requests each own a per-request tree over prompt + output (or an
// n-gram index). Responses also enter their tenant's global tree token by
// token; the global trees keep at most `max_cached_requests` responses per
// tenant (negative: no limit) and at most `max_cached_tokens` response tokens
// in all (0: no limit), evicting the oldest response first. Every public
// method takes the cache's lock, so callers may release the GIL around it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "ngram_index.h"
#include "suffix_tree.h"

namespace speclane {

enum Method : int { kMethodSuffix = 1, kMethodNgram = 2 };

struct SessionParams {
  int method = kMethodSuffix;
  SpecParams spec;     // suffix; spec.max_spec_tokens is k for n-gram too
  int local_depth = 0; // per-request tree depth, 0: the cache's
  int ngram_min = 5;
  int ngram_max = 5;
  bool ngram_latest = false;
};

class Cache {
 public:
  Cache(int max_depth, int64_t max_cached_requests, int64_t max_cached_tokens);

  void start_request(int64_t id, const std::vector<int32_t>& prompt, const std::string& tenant,
                     const SessionParams& params);
  void add_active_response(int64_t id, const int32_t* tokens, size_t n);
  void stop_request(int64_t id);
  void evict_cached_response(int64_t id);
  Draft speculate(int64_t id, const int32_t* context, size_t n, const SpecParams& params);
  // A step's suffix budget where it overrides the session's (a factor <= 0 or a probability < 0 keeps the
  // session's).
  struct StepBudget {
    double max_spec_factor = 0;
    double min_token_prob = -1;
  };
  // Appends each request's committed tokens, then drafts for it from its whole
  // context with its session params, under its step budget where `budgets` has
  // one per request (it may be empty): one call per decode step of a batch.
  std::vector<Draft> step(const std::vector<int64_t>& ids, const std::vector<std::vector<int32_t>>& tokens,
                          const std::vector<StepBudget>& budgets = {});

  std::vector<int64_t> active_requests() const;
  std::vector<int64_t> cached_requests() const;  // oldest first
  int64_t cached_tokens() const;
  size_t memory_bytes() const;
  int max_depth() const { return max_depth_; }

  // The cached responses (tenant, id, tokens, oldest first) in a checksummed,
  // versioned format; restore rebuilds the global trees from it into an empty
  // cache and throws std::invalid_argument on anything malformed.
  std::string snapshot() const;
  void restore(const std::string& data);

 private:
  struct Tenant {
    explicit Tenant(int depth) : tree(depth) {}
    SuffixTree tree;
    std::list<int64_t> fifo;
  };
  struct Active {
    std::unique_ptr<SuffixTree> local;
    std::unique_ptr<NgramIndex> ngram;
    std::string tenant;
    SessionParams params;
    // Handles found once, not per token: the request's sequence in its own
    // tree, and its response in the tenant's global tree while that is cached.
    SuffixTree::Sequence* sequence = nullptr;
    Tenant* responses = nullptr;
    SuffixTree::Sequence* response = nullptr;
  };
  struct Cached {
    std::string tenant;
    std::list<int64_t>::iterator in_tenant;
    std::list<int64_t>::iterator in_all;
  };

  Active& active(int64_t id);
  void add_response(int64_t id, const std::string& tenant);
  void append(Active& request, const int32_t* tokens, size_t n);
  void evict(int64_t id);
  void enforce_token_budget();
  Draft propose(Active& request, const int32_t* context, size_t n, const SpecParams& params);

  int max_depth_;
  int64_t max_cached_requests_;
  int64_t max_cached_tokens_;
  int64_t cached_tokens_ = 0;
  std::unordered_map<int64_t, Active> active_;
  std::unordered_map<std::string, std::unique_ptr<Tenant>> tenants_;
  std::unordered_map<int64_t, Cached> cached_;
  std::list<int64_t> all_fifo_;
  mutable std::mutex mutex_;
};

}  // namespace speclane
