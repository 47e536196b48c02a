// A draft as the compiled core returns it (mirrors drafter_service/draft.py).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace speclane {

enum Source : int { kSourceNone = 0, kSourceRequest = 1, kSourceGlobal = 2, kSourceNgram = 3 };

// Where a draft goes under another outcome of its step: `position` of the step's tokens accepted, then the
// target's `token` (a correction where position < the step's length, else another bonus token than the
// continuation's), then this draft. Its probabilities start afresh: they are conditional on that outcome.
struct Detour {
  int position = 0;
  int32_t token = 0;
  std::vector<int32_t> token_ids;
  std::vector<double> probs;
};

// Detours a draft offers at most: with the step's own continuation they fill one verifier NextRound
// (protos/conventions.py: MAX_NEXT_ROUND_CONTINUATIONS).
constexpr int kMaxDetours = 7;

struct Draft {
  std::vector<int32_t> token_ids;
  std::vector<int32_t> parents;  // -1: child of the last committed token
  std::vector<double> probs;
  double score = 0.0;
  int match_len = 0;
  int source = kSourceNone;
  // Tokens of this step's draft where it goes on past them (SpecParams.lookahead); 0: all of it.
  int step_len = 0;
  // The likeliest other outcomes' drafts, where lookahead is on (SpecParams.lookahead), likeliest first.
  std::vector<Detour> detours;
};

}  // namespace speclane
