// The elementwise steps of a Llama-form decoder layer's pass on a CPU (fp32), each one call instead of the
// operators transformers' forward launches for it: at a decode step's one row those launches, not the arithmetic,
// were the cost (fused_layer.py).
//
// rope_store: the rotary embedding of the rotate-half form (Llama's, Qwen's, Mistral's) applied to the pass's
//   queries in place and to its keys, which go with their values into the cache. Layouts: query rows [T] of
//   `heads` heads of head_dim each, `query_stride` floats apart (so a slice of a fused q/k/v product is read in
//   place); key and value rows likewise with kv_heads heads; cos and sin [T, head_dim] as the model's rotary
//   module makes them; cache [slots, kv_heads, 2 * head_dim] (a slot's key beside its value); slots [T] int64.
// silu_mul: SwiGLU's activation, out [T, width] = silu(gate) * up of gate_up [T, 2 * width] (gate first).

#include <omp.h>

#include <cmath>
#include <cstdint>

#include "kernels.h"
#include "vec.h"

namespace speclane {
namespace {

constexpr int64_t kParallelValues = 1 << 15;  // fewer values than this take one thread: a team costs more

// y = x rotated: y[i] = x[i] cos[i] - x[i + half] sin[i], y[i + half] = x[i + half] cos[i + half] + x[i] sin[i + half].
// x and y may be the same row.
SPECLANE_INLINE void rotate(const float* x, float* y, const float* cos, const float* sin, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    y[i] = a * cos[i] - b * sin[i];
    y[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

SPECLANE_CLONES void rope_row(float* query, int64_t heads, const float* key, const float* value, int64_t kv_heads,
                              int64_t head_dim, const float* cos, const float* sin, float* cache_row) {
  for (int64_t h = 0; h < heads; ++h) rotate(query + h * head_dim, query + h * head_dim, cos, sin, head_dim);
  for (int64_t h = 0; h < kv_heads; ++h) {
    float* slot = cache_row + h * 2 * head_dim;
    rotate(key + h * head_dim, slot, cos, sin, head_dim);
    for (int64_t i = 0; i < head_dim; ++i) slot[head_dim + i] = value[h * head_dim + i];
  }
}

// silu(g) = g sigmoid(g), the sigmoid from e^-|g| (exp_nonpositive's domain).
SPECLANE_CLONES void silu_mul_row(const float* gate, const float* up, float* out, int64_t width) {
  const int64_t whole = width / 16 * 16;
  for (int64_t i = 0; i < whole; i += 16) {
    const v16 g = load(gate + i);
    const v16 e = exp_nonpositive(g < 0 ? g : -g);
    const v16 sigmoid = (g < 0 ? e : splat(1.0f)) / (e + 1.0f);
    store(out + i, g * sigmoid * load(up + i));
  }
  for (int64_t i = whole; i < width; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

}  // namespace

void rope_store(uintptr_t query, int64_t query_stride, int64_t heads, uintptr_t key, int64_t key_stride,
                uintptr_t value, int64_t value_stride, int64_t kv_heads, int64_t head_dim, uintptr_t cos,
                uintptr_t sin, uintptr_t cache, uintptr_t slots, int64_t rows, int threads) {
  auto* q = reinterpret_cast<float*>(query);
  const auto* k = reinterpret_cast<const float*>(key);
  const auto* v = reinterpret_cast<const float*>(value);
  const auto* c = reinterpret_cast<const float*>(cos);
  const auto* s = reinterpret_cast<const float*>(sin);
  auto* kv = reinterpret_cast<float*>(cache);
  const auto* slot = reinterpret_cast<const int64_t*>(slots);
#pragma omp parallel for num_threads(threads) if (rows * (heads + kv_heads) * head_dim >= kParallelValues)
  for (int64_t r = 0; r < rows; ++r)
    rope_row(q + r * query_stride, heads, k + r * key_stride, v + r * value_stride, kv_heads, head_dim,
             c + r * head_dim, s + r * head_dim, kv + slot[r] * kv_heads * 2 * head_dim);
}

void silu_mul(uintptr_t gate_up, uintptr_t out, int64_t rows, int64_t width, int threads) {
  const auto* in = reinterpret_cast<const float*>(gate_up);
  auto* y = reinterpret_cast<float*>(out);
#pragma omp parallel for num_threads(threads) if (rows * width >= kParallelValues)
  for (int64_t r = 0; r < rows; ++r) silu_mul_row(in + r * 2 * width, in + r * 2 * width + width, y + r * width, width);
}

}  // namespace speclane
