// A draft as the compiled core returns it (mirrors drafter_service/draft.py).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace speclane {

enum Source : int { kSourceNone = 0, kSourceRequest = 1, kSourceGlobal = 2, kSourceNgram = 3 };

struct Draft {
  std::vector<int32_t> token_ids;
  std::vector<int32_t> parents;  // -1: child of the last committed token
  std::vector<double> probs;
  double score = 0.0;
  int match_len = 0;
  int source = kSourceNone;
  // Tokens of this step's draft where it goes on past them (SpecParams.lookahead); 0: all of it.
  int step_len = 0;
};

}  // namespace speclane
