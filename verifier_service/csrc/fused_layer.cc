// The elementwise steps of a Llama-form decoder layer's pass on a CPU, fp32 or bf16, each one call instead of the
// operators transformers' forward launches for it: at a decode step's one row those launches, not the arithmetic,
// were the cost (fused_layer.py). In bf16 each step rounds where transformers' bf16 operators round (every product
// and sum to bf16, computed in fp32 as PyTorch's CPU operators compute them), so the rotary embedding and the
// residual sums give its bits; SwiGLU's sigmoid is ours, within an fp32 ulp or two of PyTorch's before rounding.
//
// rope_store: the rotary embedding of the rotate-half form (Llama's, Qwen's, Mistral's) applied to the pass's
//   queries in place and to its keys, which go with their values into the cache. Layouts: query rows [T] of
//   `heads` heads of head_dim each, `query_stride` values apart (so a slice of a fused q/k/v product is read in
//   place); key and value rows likewise with kv_heads heads; cos and sin [T, head_dim] as the model's rotary
//   module makes them; cache [slots, kv_heads, 2 * head_dim] (a slot's key beside its value); slots [T] int64.
// silu_mul: SwiGLU's activation, out [T, width] = silu(gate) * up of gate_up [T, 2 * width] (gate first).
//
// Every value is of one type E: float, or bf16 as uint16_t.

#include <omp.h>

#include <cmath>
#include <cstdint>

#include "kernels.h"
#include "vec.h"

namespace speclane {
namespace {

constexpr int64_t kParallelValues = 1 << 15;  // fewer values than this take one thread: a team costs more

// A result of E's operators: fp32's own, or rounded to bf16 (kept in a float).
SPECLANE_INLINE v16 rounded(v16 v, float) { return v; }
SPECLANE_INLINE float rounded(float v, float) { return v; }

SPECLANE_INLINE v16 rounded(v16 v, uint16_t) {
  uint16_t half[16];
  store16(half, v);
  return load16(half);
}

SPECLANE_INLINE float rounded(float v, uint16_t) {
  uint16_t half;
  from_float(v, &half);
  return to_float(half);
}

// y = x rotated: y[i] = x[i] cos[i] - x[i + half] sin[i], y[i + half] = x[i + half] cos[i + half] + x[i] sin[i + half].
// x and y may be the same row.
template <typename E>
SPECLANE_INLINE void rotate(const E* x, E* y, const E* cos, const E* sin, int64_t head_dim) {
  const int64_t half = head_dim / 2, whole = half / 16 * 16;
  const E kind{};
  for (int64_t i = 0; i < whole; i += 16) {
    const v16 a = load16(x + i), b = load16(x + half + i);
    const v16 low = rounded(rounded(a * load16(cos + i), kind) - rounded(b * load16(sin + i), kind), kind);
    const v16 high = rounded(rounded(b * load16(cos + half + i), kind) + rounded(a * load16(sin + half + i), kind),
                             kind);
    store16(y + i, low);
    store16(y + half + i, high);
  }
  for (int64_t i = whole; i < half; ++i) {
    const float a = to_float(x[i]), b = to_float(x[i + half]);
    from_float(rounded(a * to_float(cos[i]), kind) - rounded(b * to_float(sin[i]), kind), y + i);
    from_float(rounded(b * to_float(cos[i + half]), kind) + rounded(a * to_float(sin[i + half]), kind), y + i + half);
  }
}

template <typename E>
SPECLANE_CLONES void rope_row(E* query, int64_t heads, const E* key, const E* value, int64_t kv_heads,
                              int64_t head_dim, const E* cos, const E* sin, E* cache_row) {
  for (int64_t h = 0; h < heads; ++h) rotate(query + h * head_dim, query + h * head_dim, cos, sin, head_dim);
  for (int64_t h = 0; h < kv_heads; ++h) {
    E* slot = cache_row + h * 2 * head_dim;
    rotate(key + h * head_dim, slot, cos, sin, head_dim);
    for (int64_t i = 0; i < head_dim; ++i) slot[head_dim + i] = value[h * head_dim + i];
  }
}

template <typename E>
void rope_rows(E* q, int64_t query_stride, int64_t heads, const E* k, int64_t key_stride, const E* v,
               int64_t value_stride, int64_t kv_heads, int64_t head_dim, const E* c, const E* s, E* kv,
               const int64_t* slot, int64_t rows, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * (heads + kv_heads) * head_dim >= kParallelValues)
  for (int64_t r = 0; r < rows; ++r)
    rope_row(q + r * query_stride, heads, k + r * key_stride, v + r * value_stride, kv_heads, head_dim,
             c + r * head_dim, s + r * head_dim, kv + slot[r] * kv_heads * 2 * head_dim);
}

// silu(g) = g sigmoid(g), the sigmoid from e^-|g| (exp_nonpositive's domain); rounded to E, then times up.
template <typename E>
SPECLANE_CLONES void silu_mul_row(const E* gate, const E* up, E* out, int64_t width) {
  const int64_t whole = width / 16 * 16;
  const E kind{};
  for (int64_t i = 0; i < whole; i += 16) {
    const v16 g = load16(gate + i);
    const v16 e = exp_nonpositive(g < 0 ? g : -g);
    const v16 sigmoid = (g < 0 ? e : splat(1.0f)) / (e + 1.0f);
    store16(out + i, rounded(g * sigmoid, kind) * load16(up + i));
  }
  for (int64_t i = whole; i < width; ++i) {
    const float g = to_float(gate[i]);
    from_float(rounded(g / (1.0f + std::exp(-g)), kind) * to_float(up[i]), out + i);
  }
}

template <typename E>
void silu_mul_rows(const E* in, E* y, int64_t rows, int64_t width, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * width >= kParallelValues)
  for (int64_t r = 0; r < rows; ++r) silu_mul_row(in + r * 2 * width, in + r * 2 * width + width, y + r * width, width);
}

}  // namespace

void rope_store(uintptr_t query, int64_t query_stride, int64_t heads, uintptr_t key, int64_t key_stride,
                uintptr_t value, int64_t value_stride, int64_t kv_heads, int64_t head_dim, uintptr_t cos,
                uintptr_t sin, uintptr_t cache, uintptr_t slots, int64_t rows, bool bf16, int threads) {
  by_element_type(bf16, [&](auto kind) {
    using E = decltype(kind);
    rope_rows(reinterpret_cast<E*>(query), query_stride, heads, reinterpret_cast<const E*>(key), key_stride,
              reinterpret_cast<const E*>(value), value_stride, kv_heads, head_dim, reinterpret_cast<const E*>(cos),
              reinterpret_cast<const E*>(sin), reinterpret_cast<E*>(cache), reinterpret_cast<const int64_t*>(slots),
              rows, threads);
  });
}

void silu_mul(uintptr_t gate_up, uintptr_t out, int64_t rows, int64_t width, bool bf16, int threads) {
  by_element_type(bf16, [&](auto kind) {
    using E = decltype(kind);
    silu_mul_rows(reinterpret_cast<const E*>(gate_up), reinterpret_cast<E*>(out), rows, width, threads);
  });
}

}  // namespace speclane
