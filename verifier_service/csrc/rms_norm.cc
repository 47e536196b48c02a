// Llama's RMSNorm on a CPU, fp32 or bf16: y = weight * E(x / sqrt(mean(x^2) + eps)), each row in one pass over
// its values rather than the seven operator calls (conversions, pow, mean, rsqrt, two products) of transformers'
// forward, which cost more than the arithmetic at a decode step's few rows. Roundings as there: the normalized row
// to the input's dtype E, then its product with the weight. A row's sum of squares has one order (16 lanes, then
// lanes_sum, then the tail), so its result does not depend on the other rows: batch-invariant by construction.
//
// Layouts: x and y [rows, hidden] contiguous, weight [hidden], all of E (float, or bf16 as uint16_t).
//
// add_rms_norm: a decoder layer's residual add (rounded to E, as transformers' add rounds) and the norm after it in
// one call.

#include <omp.h>

#include <cmath>
#include <cstdint>

#include "kernels.h"
#include "vec.h"

namespace speclane {
namespace {

constexpr int64_t kParallelValues = 1 << 15;  // fewer values than this take one thread: a team costs more

template <typename E>
SPECLANE_CLONES void norm_row(const E* x, const E* weight, E* y, int64_t hidden, float eps) {
  const int64_t whole = hidden / 16 * 16;
  v16 squares = {};
  for (int64_t k = 0; k < whole; k += 16) {
    const v16 v = load16(x + k);
    squares += v * v;
  }
  float sum = lanes_sum(squares);
  for (int64_t k = whole; k < hidden; ++k) sum += to_float(x[k]) * to_float(x[k]);
  const float scale = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps);
  E normalized[16];
  for (int64_t k = 0; k < whole; k += 16) {
    store16(normalized, load16(x + k) * scale);
    store16(y + k, load16(normalized) * load16(weight + k));
  }
  for (int64_t k = whole; k < hidden; ++k) {
    E one;
    from_float(to_float(x[k]) * scale, &one);
    from_float(to_float(one) * to_float(weight[k]), y + k);
  }
}

template <typename E>
void norm_rows(const E* x, const E* weight, E* y, int64_t rows, int64_t hidden, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * hidden >= kParallelValues) schedule(static)
  for (int64_t r = 0; r < rows; ++r) norm_row(x + r * hidden, weight, y + r * hidden, hidden, eps);
}

template <typename E>
SPECLANE_CLONES void add_row(const E* x, E* residual, int64_t hidden) {
  const int64_t whole = hidden / 16 * 16;
  for (int64_t k = 0; k < whole; k += 16) store16(residual + k, load16(residual + k) + load16(x + k));
  for (int64_t k = whole; k < hidden; ++k) from_float(to_float(residual[k]) + to_float(x[k]), residual + k);
}

template <typename E>
void add_norm_rows(const E* x, E* residual, const E* weight, E* y, int64_t rows, int64_t hidden, float eps,
                   int threads) {
#pragma omp parallel for num_threads(threads) if (rows * hidden >= kParallelValues) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    add_row(x + r * hidden, residual + r * hidden, hidden);
    norm_row(residual + r * hidden, weight, y + r * hidden, hidden, eps);
  }
}

}  // namespace

void add_rms_norm(uintptr_t x, uintptr_t residual, uintptr_t weight, uintptr_t y, int64_t rows, int64_t hidden,
                  double eps, bool bf16, int threads) {
  by_element_type(bf16, [&](auto kind) {
    using E = decltype(kind);
    add_norm_rows(reinterpret_cast<const E*>(x), reinterpret_cast<E*>(residual), reinterpret_cast<const E*>(weight),
                  reinterpret_cast<E*>(y), rows, hidden, static_cast<float>(eps), threads);
  });
}

void rms_norm(uintptr_t x, uintptr_t weight, uintptr_t y, int64_t rows, int64_t hidden, double eps, bool bf16,
              int threads) {
  by_element_type(bf16, [&](auto kind) {
    using E = decltype(kind);
    norm_rows(reinterpret_cast<const E*>(x), reinterpret_cast<const E*>(weight), reinterpret_cast<E*>(y), rows, hidden,
              static_cast<float>(eps), threads);
  });
}

}  // namespace speclane
