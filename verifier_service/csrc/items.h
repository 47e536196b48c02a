// How the attention kernels spread a call's work over PyTorch's OpenMP threads (kernels.h): one item per
// (segment, KV head), split into contiguous runs of about equal cost (queries x keys).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace speclane {

// Below this many query-key products a call runs on one thread: waking another costs more than it saves.
constexpr int64_t kPairsPerThread = 1024;

// Calls run(first, last) on each thread with its run of items [first, last); segments [n, 3] hold each segment's
// first row, new tokens and cached tokens.
template <typename Run>
void split_items(const int64_t* segments, int64_t num_segments, int64_t kv_heads, int threads, Run run) {
  const int64_t items = num_segments * kv_heads;
  std::vector<int64_t> cost_before(items + 1, 0);
  for (int64_t item = 0; item < items; ++item) {
    const int64_t* seg = segments + 3 * (item / kv_heads);
    cost_before[item + 1] = cost_before[item] + seg[1] * (seg[1] + seg[2]);
  }
  const int64_t total = cost_before.back();
  const int n = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, total / kPairsPerThread)));
#pragma omp parallel num_threads(n)
  {
    const int t = omp_get_thread_num(), team = omp_get_num_threads();
    const int64_t first = std::lower_bound(cost_before.begin(), cost_before.end(), total * t / team) -
                          cost_before.begin();
    const int64_t last = std::lower_bound(cost_before.begin(), cost_before.end(), total * (t + 1) / team) -
                         cost_before.begin();
    run(first, std::min(last, items));
  }
}

}  // namespace speclane
