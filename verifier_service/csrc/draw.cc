// A token from each row of probabilities by inverting its cumulative sum at the row's uniform: the first token
// whose running sum exceeds the uniform times the row's total, as sampling.draw's float64 cumulative sum and
// searchsorted find it, without writing that sum out (its float64 copy and sum were 60% of a sampled decode's
// judging on this repository's CPU host). The total is summed in double 16 lanes at a time; the running sum goes
// 16 tokens at a time, and token by token only from the block where it passes the target. A token of probability 0
// is never drawn: where rounding leaves the running sum short of the target, the last token with mass is. A row
// without positive finite mass gets the last token (its step fails on its own, verify._usable).
//
// Layout: probs [rows] of `vocab` fp32 values, row_stride apart; uniforms [rows] fp32; out [rows] int64.

#include <omp.h>

#include <cstdint>

#include "kernels.h"
#include "vec.h"

namespace speclane {
namespace {

typedef double v16d __attribute__((vector_size(128)));
typedef double v8d __attribute__((vector_size(64)));
typedef double v4d __attribute__((vector_size(32)));

SPECLANE_INLINE v16d widen(const float* p) { return __builtin_convertvector(load(p), v16d); }

SPECLANE_INLINE double lanes_sum(v16d v) {
  const v8d half = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4d quarter = __builtin_shufflevector(half, half, 0, 1, 2, 3) + __builtin_shufflevector(half, half, 4, 5, 6, 7);
  return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

SPECLANE_CLONES int64_t draw_row(const float* row, int64_t vocab, double uniform) {
  const int64_t whole = vocab / 16 * 16;
  v16d lanes = {};
  for (int64_t i = 0; i < whole; i += 16) lanes += widen(row + i);
  double total = lanes_sum(lanes);
  for (int64_t i = whole; i < vocab; ++i) total += row[i];
  if (!(total > 0.0 && total - total == 0.0)) return vocab - 1;  // no mass, NaN or infinite
  const double target = uniform * total;
  double running = 0.0;
  int64_t i = 0;
  for (; i < whole; i += 16) {
    const double block = lanes_sum(widen(row + i));
    if (running + block > target) break;
    running += block;
  }
  for (; i < vocab; ++i) {
    running += row[i];
    if (running > target && row[i] > 0.0f) return i;
  }
  for (int64_t j = vocab - 1; j > 0; --j)
    if (row[j] > 0.0f) return j;
  return 0;
}

}  // namespace

void draw(uintptr_t probs, int64_t row_stride, uintptr_t uniforms, uintptr_t out, int64_t rows, int64_t vocab,
          int threads) {
  const float* p = reinterpret_cast<const float*>(probs);
  const float* u = reinterpret_cast<const float*>(uniforms);
  int64_t* tokens = reinterpret_cast<int64_t*>(out);
#pragma omp parallel for num_threads(threads) if (rows > 1) schedule(static)
  for (int64_t r = 0; r < rows; ++r) tokens[r] = draw_row(p + r * row_stride, vocab, u[r]);
}

}  // namespace speclane
