// Attention of short query segments (decodes and chain verifies) over the paged KV cache on a CPU, reading
// each key and value in place through the block table.
//
// The plain-torch path gathers every segment's blocks into a padded copy and hands it to SDPA: at 32 decoding
// sequences that copy and the padding were 58% of a SmolLM2 step. Here one work item is (segment, KV head): it
// reads each of the segment's keys once, scores it against all the queries of that head's group, takes each
// query's softmax over the keys it sees, then reads each value once. Each query's result is computed in the same
// order whatever else is in the pass, so a token's attention does not depend on its batch.
//
// Layouts (fp32, contiguous): query [T, heads, key_dim]; out [T, heads, value_dim]; cache
// [slots, kv_heads, key_dim + value_dim] (a slot's key beside its value); tables [segments, max_blocks];
// segments [segments, 3]: first row in the pass, queries, keys cached before them. Query i of a segment is at
// position cached + i and sees keys [max(0, position + 1 - window), position + 1) (window 0: no window).

#include <omp.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

struct Call {
  const float* query;
  float* out;
  const float* cache;
  const int64_t* tables;
  const int64_t* segments;
  int64_t heads, kv_heads, key_dim, value_dim, block_size, max_blocks, window;
  float scale;
};

#if defined(__x86_64__)
#define SPECLANE_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SPECLANE_CLONES
#endif

// e^x for x <= 0 (scores minus their maximum), in a form the compiler vectorizes: 2^n times Cephes' degree-6
// polynomial of the remainder (relative error about 2e-7; SDPA's own vectorized exp is of this order).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = __builtin_floorf(x * 1.44269504f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691e-4f;
  p = p * r + 1.3981999e-3f;
  p = p * r + 8.3334519e-3f;
  p = p * r + 4.1665795e-2f;
  p = p * r + 1.6666665e-1f;
  p = p * r + 5.0000001e-1f;
  p = p * r * r + r + 1.0f;
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

// One (segment, KV head): scores [rows, keys] where row = query * group + head in group. KD and VD are the head
// dimensions where known at compile time (0: the call's), so the products unroll into whole vector registers.
template <int KD, int VD>
SPECLANE_CLONES void attend_item(const Call& c, int64_t segment, int64_t kv_head, std::vector<float>& scratch,
                                 std::vector<const float*>& keys) {
  const int64_t* seg = c.segments + 3 * segment;
  const int64_t first_row = seg[0], queries = seg[1], cached = seg[2];
  const int64_t group = c.heads / c.kv_heads, rows = queries * group;
  const int64_t kd = KD ? KD : c.key_dim, vd = VD ? VD : c.value_dim, slot_width = c.kv_heads * (kd + vd);
  const int64_t* table = c.tables + segment * c.max_blocks;
  // Query i sees keys [lo(i), cached + i + 1); lo grows with i, so keys before lo(0) are seen by none.
  auto lo = [&](int64_t i) { return c.window > 0 ? std::max<int64_t>(0, cached + i + 1 - c.window) : 0; };
  const int64_t first_key = lo(0), num_keys = cached + queries - first_key;
  scratch.resize(rows * (num_keys + kd + vd + 1));
  float* scores = scratch.data();
  float* q = scores + rows * num_keys;  // [rows, kd] the group's queries, contiguous
  float* acc = q + rows * kd;           // [rows, vd]
  float* inverse_sums = acc + rows * vd;

  keys.resize(num_keys);
  // Block by block: a division per key costs as much as a small head's product.
  for (int64_t k = 0, block = first_key / c.block_size, offset = first_key % c.block_size; k < num_keys; ++block) {
    const float* row = c.cache + (table[block] * c.block_size + offset) * slot_width + kv_head * (kd + vd);
    for (; offset < c.block_size && k < num_keys; ++offset, ++k, row += slot_width) keys[k] = row;
    offset = 0;
  }
  for (int64_t row = 0; row < rows; ++row)
    std::copy_n(c.query + ((first_row + row / group) * c.heads + kv_head * group + row % group) * kd, kd,
                q + row * kd);

  // Keys come from blocks anywhere in memory: prefetched a few ahead, or each read waits for memory in turn.
  constexpr int64_t ahead = 8;
  for (int64_t k = 0; k < num_keys; ++k) {
    const float* key = keys[k];
    if (k + ahead < num_keys)
      for (int64_t d = 0; d < kd; d += 16) __builtin_prefetch(keys[k + ahead] + d);
    for (int64_t row = 0; row < rows; ++row) {
      const float* qr = q + row * kd;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < (KD ? KD : kd); ++d) dot += qr[d] * key[d];
      scores[row * num_keys + k] = dot * c.scale;
    }
  }
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t i = row / group;
    float* s = scores + row * num_keys;
    const int64_t begin = lo(i) - first_key, end = cached + i + 1 - first_key;
    float most = s[begin];
#pragma omp simd reduction(max : most)
    for (int64_t k = begin + 1; k < end; ++k) most = std::max(most, s[k]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t k = begin; k < end; ++k) {
      s[k] = exp_nonpositive(s[k] - most);
      sum += s[k];
    }
    // Keys a query does not see weigh nothing in the products below.
    std::fill(s, s + begin, 0.0f);
    std::fill(s + end, s + num_keys, 0.0f);
    inverse_sums[row] = 1.0f / sum;
  }
  std::fill(acc, acc + rows * vd, 0.0f);
  for (int64_t k = 0; k < num_keys; ++k) {
    const float* value = keys[k] + kd;
    if (k + ahead < num_keys)
      for (int64_t d = 0; d < vd; d += 16) __builtin_prefetch(keys[k + ahead] + kd + d);
    for (int64_t row = 0; row < rows; ++row) {
      const float p = scores[row * num_keys + k];
      float* a = acc + row * vd;
#pragma omp simd
      for (int64_t d = 0; d < (VD ? VD : vd); ++d) a[d] += p * value[d];
    }
  }
  for (int64_t row = 0; row < rows; ++row) {
    float* o = c.out + ((first_row + row / group) * c.heads + kv_head * group + row % group) * vd;
    const float* a = acc + row * vd;
    for (int64_t d = 0; d < vd; ++d) o[d] = a[d] * inverse_sums[row];
  }
}

using ItemFn = void (*)(const Call&, int64_t, int64_t, std::vector<float>&, std::vector<const float*>&);

// The head dimensions of the models served (and the tiny test models'), compiled; any other runs the general form.
template <int... Dims>
ItemFn compiled_for(int64_t key_dim, int64_t value_dim) {
  ItemFn found = attend_item<0, 0>;
  ((key_dim == Dims && value_dim == Dims ? (found = attend_item<Dims, Dims>, true) : false) || ...);
  return found;
}

ItemFn item_function(int64_t key_dim, int64_t value_dim) {
  return compiled_for<16, 32, 64, 96, 128, 256>(key_dim, value_dim);
}

// Below this many query-key products a call runs on one thread: waking another costs more than it saves.
constexpr int64_t kPairsPerThread = 4096;

void attend(uintptr_t query, uintptr_t out, uintptr_t cache, uintptr_t tables, uintptr_t segments,
            int64_t num_segments, int64_t heads, int64_t kv_heads, int64_t key_dim, int64_t value_dim,
            int64_t block_size, int64_t max_blocks, int64_t window, double scale, int threads) {
  const Call c{reinterpret_cast<const float*>(query), reinterpret_cast<float*>(out),
               reinterpret_cast<const float*>(cache), reinterpret_cast<const int64_t*>(tables),
               reinterpret_cast<const int64_t*>(segments), heads, kv_heads, key_dim, value_dim, block_size,
               max_blocks, window, static_cast<float>(scale)};
  // Items (segment, KV head) split into contiguous runs of about equal cost (queries x keys).
  std::vector<int64_t> cost_before(num_segments * kv_heads + 1, 0);
  for (int64_t item = 0; item < num_segments * kv_heads; ++item) {
    const int64_t* seg = c.segments + 3 * (item / kv_heads);
    cost_before[item + 1] = cost_before[item] + seg[1] * (seg[1] + seg[2]);
  }
  const int64_t total = cost_before.back();
  const int n = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, total / kPairsPerThread)));
  const ItemFn item_fn = item_function(key_dim, value_dim);
  pybind11::gil_scoped_release release;
  // The threads are PyTorch's own: the module links libgomp.so.1 by that name, which the dynamic loader resolves to
  // the copy torch has loaded, so this region reuses torch's team. (A pool of its own measured a 32-sequence decode
  // step 1.4x slower: torch's workers spin between its operators, on the cores the pool needed.)
#pragma omp parallel num_threads(n)
  {
    const int t = omp_get_thread_num(), team = omp_get_num_threads();
    const auto begin = std::lower_bound(cost_before.begin(), cost_before.end(), total * t / team) -
                       cost_before.begin();
    const auto end = std::lower_bound(cost_before.begin(), cost_before.end(), total * (t + 1) / team) -
                     cost_before.begin();
    std::vector<float> scratch;
    std::vector<const float*> keys;
    for (int64_t item = begin; item < std::min<int64_t>(end, num_segments * kv_heads); ++item)
      item_fn(c, item / kv_heads, item % kv_heads, scratch, keys);
  }
}

}  // namespace

PYBIND11_MODULE(_paged_attention, m) {
  m.doc() = "Attention of decodes and chain verifies over the paged KV cache, on a CPU (fp32)";
  m.def("attend", &attend);
}
