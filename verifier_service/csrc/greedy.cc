// Each row's argmax of a pass's logits, fp32 or bf16, as torch.argmax picks it: the first maximum, and the first
// NaN where a row has one (a NaN counts as the largest value). One read of the row in the model's dtype for its
// largest value, a second that stops at its first occurrence: torch's reduction on a CPU, and the fp32 copy of
// bf16 logits before it, took 5-7 ms of a 16-sequence verify pass of Qwen2.5's 151,936-entry rows.
//
// Layout: logits [rows] of `vocab` values each, row_stride apart; out [rows] int64.

#include <omp.h>

#include <cstdint>

#include "kernels.h"
#include "vec.h"

namespace speclane {
namespace {

template <typename E>
SPECLANE_CLONES int64_t argmax_row(const E* row, int64_t vocab) {
  const int64_t whole = vocab / 16 * 16;
  v16 most = splat(-__builtin_huge_valf());
  v16i unordered = {};
  for (int64_t i = 0; i < whole; i += 16) {
    const v16 x = load16(row + i);
    most = x > most ? x : most;
    unordered |= x != x;
  }
  float largest = lanes_max(most);
  bool nan = false;
  for (int i = 0; i < 16; ++i) nan |= unordered[i] != 0;
  for (int64_t i = whole; i < vocab; ++i) {
    const float x = to_float(row[i]);
    nan |= x != x;
    largest = x > largest ? x : largest;
  }
  if (nan) {
    for (int64_t i = 0; i < vocab; ++i)
      if (to_float(row[i]) != to_float(row[i])) return i;
  }
  for (int64_t i = 0; i < whole; i += 16) {
    const v16i hit = load16(row + i) == largest;
    for (int lane = 0; lane < 16; ++lane)
      if (hit[lane]) return i + lane;
  }
  for (int64_t i = whole; i < vocab; ++i)
    if (to_float(row[i]) == largest) return i;
  return 0;  // an empty row
}

template <typename E>
void argmax_rows(const E* logits, int64_t* out, int64_t rows, int64_t vocab, int64_t row_stride, int threads) {
#pragma omp parallel for num_threads(threads) if (rows > 1) schedule(static)
  for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(logits + r * row_stride, vocab);
}

}  // namespace

void row_argmax(uintptr_t logits, uintptr_t out, int64_t rows, int64_t vocab, int64_t row_stride, bool bf16,
                int threads) {
  by_element_type(bf16, [&](auto kind) {
    argmax_rows(reinterpret_cast<const decltype(kind)*>(logits), reinterpret_cast<int64_t*>(out), rows, vocab,
                row_stride, threads);
  });
}

}  // namespace speclane
