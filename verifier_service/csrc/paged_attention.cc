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

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "items.h"
#include "kernels.h"
#include "vec.h"

namespace speclane {
namespace {

struct Call {
  const float* query;
  float* out;
  const float* cache;
  const int64_t* tables;
  const int64_t* segments;
  int64_t heads, kv_heads, block_size, max_blocks, window;  // head dimensions: attend_item's template arguments
  float scale;
};

constexpr int64_t kTile = 16;  // keys scored together, lanes of one vector

// Scores of 16 keys (rows: the keys' first KD values, transposed into kt [KD][16]) for QR query rows.
template <int KD, int QR>
SPECLANE_INLINE void score_rows(const float* q, const float* kt, float* scores, int64_t stride, float scale) {
  // Partial sums a row, so that at least 8 independent products are in flight: the multipliers' latency.
  constexpr int P = QR >= 4 ? 2 : 4;
  v16 acc[QR][P] = {};
  for (int d = 0; d < KD; d += P)
    for (int r = 0; r < QR; ++r)
      for (int i = 0; i < P; ++i) acc[r][i] += q[r * KD + d + i] * load(kt + (d + i) * kTile);
  for (int r = 0; r < QR; ++r) {
    v16 sum = acc[r][0];
    for (int i = 1; i < P; ++i) sum += acc[r][i];
    store(scores + r * stride, sum * scale);
  }
}

// score_rows over rows [0, rows): tiles of 4, then one of the rest, so that a few rows (a decode's group of heads)
// still share each load. (Plain calls, not a generic lambda: a lambda is compiled for the baseline target, not for
// each of the caller's clones, and measured 2.5x slower.)
template <int KD>
SPECLANE_INLINE void score_tile(const float* q, const float* kt, float* scores, int64_t stride, float scale,
                                int64_t rows) {
  int64_t row = 0;
  for (; row + 4 <= rows; row += 4) score_rows<KD, 4>(q + row * KD, kt, scores + row * stride, stride, scale);
  q += row * KD;
  scores += row * stride;
  switch (rows - row) {
    case 3: score_rows<KD, 3>(q, kt, scores, stride, scale); break;
    case 2: score_rows<KD, 2>(q, kt, scores, stride, scale); break;
    case 1: score_rows<KD, 1>(q, kt, scores, stride, scale); break;
    default: break;
  }
}

// Accumulates p [rows, keys] times the keys' values, VR rows and VC vectors of VD at a time, in registers.
template <int VD, int VR, int VC>
SPECLANE_INLINE void weigh_values(const float* p, const float* const* keys, int64_t num_keys, int64_t stride,
                                  int64_t value_offset, int64_t column, float* out, const float* inverse_sums,
                                  int64_t out_stride) {
  v16 acc[VR][VC] = {};
  constexpr int64_t ahead = 8;
  for (int64_t k = 0; k < num_keys; ++k) {
    const float* value = keys[k] + value_offset + column;
    if (k + ahead < num_keys)
      for (int c = 0; c < VC; ++c) __builtin_prefetch(keys[k + ahead] + value_offset + column + 16 * c);
    v16 v[VC];
#pragma GCC unroll 16
    for (int c = 0; c < VC; ++c) v[c] = load(value + 16 * c);
#pragma GCC unroll 4
    for (int r = 0; r < VR; ++r) {
      const float weight = p[r * stride + k];
#pragma GCC unroll 16
      for (int c = 0; c < VC; ++c) acc[r][c] += weight * v[c];
    }
  }
  for (int r = 0; r < VR; ++r)
    for (int c = 0; c < VC; ++c) store(out + r * out_stride + column + 16 * c, acc[r][c] * inverse_sums[r]);
}

// One (segment, KV head); row = query * group + head in group. KD and VD (multiples of 16) are the head dimensions.
//  1. Scores: 16 keys at a time, transposed in registers so that each query's products with them are one vector.
//  2. Each row's softmax over the keys its query sees; the others weigh 0.
//  3. The values, each read once per few rows, weighed into accumulators held in registers.
template <int KD, int VD>
SPECLANE_CLONES void attend_item(const Call& c, int64_t segment, int64_t kv_head, std::vector<float>& scratch,
                                 std::vector<const float*>& keys) {
  const int64_t* seg = c.segments + 3 * segment;
  const int64_t first_row = seg[0], queries = seg[1], cached = seg[2];
  const int64_t group = c.heads / c.kv_heads, rows = queries * group, slot_width = c.kv_heads * (KD + VD);
  const int64_t* table = c.tables + segment * c.max_blocks;
  // Query i sees keys [lo(i), cached + i + 1); lo grows with i, so keys before lo(0) are seen by none.
  auto lo = [&](int64_t i) { return c.window > 0 ? std::max<int64_t>(0, cached + i + 1 - c.window) : 0; };
  const int64_t first_key = lo(0), num_keys = cached + queries - first_key;
  const int64_t stride = (num_keys + kTile - 1) / kTile * kTile;  // a row of scores, whole tiles
  scratch.resize(rows * (stride + KD + VD + 1) + KD * kTile);
  float* scores = scratch.data();
  float* q = scores + rows * stride;  // [rows, KD] the group's queries, contiguous
  float* out = q + rows * KD;         // [rows, VD]
  float* inverse_sums = out + rows * VD;
  float* kt = inverse_sums + rows;    // [KD, 16] a tile's keys, transposed

  keys.resize(stride + 2 * kTile);
  // Block by block: a division per key costs as much as a small head's product.
  for (int64_t k = 0, block = first_key / c.block_size, offset = first_key % c.block_size; k < num_keys; ++block) {
    const float* row = c.cache + (table[block] * c.block_size + offset) * slot_width + kv_head * (KD + VD);
    for (; offset < c.block_size && k < num_keys; ++offset, ++k, row += slot_width) keys[k] = row;
    offset = 0;
  }
  // The last tile's padding (weighed 0) and two tiles after it (only prefetched): the last key again.
  for (int64_t k = num_keys; k < stride + 2 * kTile; ++k) keys[k] = keys[num_keys - 1];
  for (int64_t row = 0; row < rows; ++row)
    std::copy_n(c.query + ((first_row + row / group) * c.heads + kv_head * group + row % group) * KD, KD,
                q + row * KD);

  for (int64_t k0 = 0; k0 < stride; k0 += kTile) {
    for (int64_t d0 = 0; d0 < KD; d0 += 16) {
      v16 tile[16];
      // Keys come from blocks anywhere in memory: each load asks for the same line of the key two tiles on, so the
      // reads overlap. (Asking for a whole tile's lines at once overflowed the outstanding misses: a 32-sequence
      // decode step's attention took 1.1x as long as with one key at a time; two tiles on, 0.9-0.96x.)
      for (int k = 0; k < 16; ++k) {
        __builtin_prefetch(keys[k0 + 2 * kTile + k] + d0);
        tile[k] = load(keys[k0 + k] + d0);
      }
      transpose16(tile);
      for (int d = 0; d < 16; ++d) store(kt + (d0 + d) * kTile, tile[d]);
    }
    score_tile<KD>(q, kt, scores + k0, stride, c.scale, rows);
  }

  for (int64_t row = 0; row < rows; ++row) {
    const int64_t i = row / group;
    float* s = scores + row * stride;
    const int64_t begin = lo(i) - first_key, end = cached + i + 1 - first_key;
    v16 lane;
    for (int64_t k = 0; k < 16; ++k) lane[k] = static_cast<float>(k);
    auto seen = [&](int64_t k0) { return (lane + static_cast<float>(k0) >= static_cast<float>(begin)) &
                                         (lane + static_cast<float>(k0) < static_cast<float>(end)); };
    const v16 none = splat(-__builtin_huge_valf());
    // The tiles holding keys it sees; the others weigh 0.
    const int64_t first_tile = begin / kTile * kTile, past_tiles = (end + kTile - 1) / kTile * kTile;
    // Only the first and last tiles need the lanes masked: a masked select over every tile took most of the time.
    auto whole = [&](int64_t k0) { return k0 >= begin && k0 + kTile <= end; };
    v16 most = none;
    for (int64_t k0 = first_tile; k0 < past_tiles; k0 += kTile) {
      const v16 x = load(s + k0);
      most = whole(k0) ? (x > most ? x : most) : (seen(k0) ? (x > most ? x : most) : most);
    }
    const float largest = lanes_max(most);
    v16 sums{};
    for (int64_t k0 = first_tile; k0 < past_tiles; k0 += kTile) {
      const v16 p = whole(k0) ? exp_nonpositive(load(s + k0) - largest)
                              : (seen(k0) ? exp_nonpositive(load(s + k0) - largest) : v16{});
      sums += p;
      store(s + k0, p);
    }
    std::fill(s, s + first_tile, 0.0f);
    std::fill(s + past_tiles, s + stride, 0.0f);
    inverse_sums[row] = 1.0f / lanes_sum(sums);
  }

  // Registers for 16 accumulators: 4 rows of a 64-wide head, 2 of 128, one row's half of 256.
  constexpr int VC = VD / 16 < 8 ? VD / 16 : 8, VR = 16 / VC < 4 ? 16 / VC : 4;
  for (int64_t column = 0; column < VD; column += 16 * VC) {
    int64_t row = 0;
    for (; row + VR <= rows; row += VR)
      weigh_values<VD, VR, VC>(scores + row * stride, keys.data(), num_keys, stride, KD, column, out + row * VD,
                               inverse_sums + row, VD);
    const int64_t rest = rows - row;
    if (VR > 3 && rest == 3)
      weigh_values<VD, 3, VC>(scores + row * stride, keys.data(), num_keys, stride, KD, column, out + row * VD,
                              inverse_sums + row, VD);
    if (VR > 2 && rest == 2)
      weigh_values<VD, 2, VC>(scores + row * stride, keys.data(), num_keys, stride, KD, column, out + row * VD,
                              inverse_sums + row, VD);
    if (VR > 1 && rest == 1)
      weigh_values<VD, 1, VC>(scores + row * stride, keys.data(), num_keys, stride, KD, column, out + row * VD,
                              inverse_sums + row, VD);
  }
  for (int64_t row = 0; row < rows; ++row)
    std::copy_n(out + row * VD, VD, c.out + ((first_row + row / group) * c.heads + kv_head * group + row % group) * VD);
}

using ItemFn = void (*)(const Call&, int64_t, int64_t, std::vector<float>&, std::vector<const float*>&);

// The head dimensions of the models served (and the tiny test models'), compiled; others take the padded path.
template <int... Dims>
ItemFn compiled_for(int64_t key_dim, int64_t value_dim) {
  ItemFn found = nullptr;
  ((key_dim == Dims && value_dim == Dims ? (found = attend_item<Dims, Dims>, true) : false) || ...);
  return found;
}

ItemFn item_function(int64_t key_dim, int64_t value_dim) {
  return compiled_for<16, 32, 64, 96, 128, 256>(key_dim, value_dim);
}

}  // namespace

bool attends(int64_t key_dim, int64_t value_dim) { return item_function(key_dim, value_dim) != nullptr; }

void attend(uintptr_t query, uintptr_t out, uintptr_t cache, uintptr_t tables, uintptr_t segments,
            int64_t num_segments, int64_t heads, int64_t kv_heads, int64_t key_dim, int64_t value_dim,
            int64_t block_size, int64_t max_blocks, int64_t window, double scale, int threads) {
  const Call c{reinterpret_cast<const float*>(query), reinterpret_cast<float*>(out),
               reinterpret_cast<const float*>(cache), reinterpret_cast<const int64_t*>(tables),
               reinterpret_cast<const int64_t*>(segments), heads, kv_heads, block_size, max_blocks, window,
               static_cast<float>(scale)};
  const ItemFn item_fn = item_function(key_dim, value_dim);
  if (item_fn == nullptr) throw std::invalid_argument("no attention kernel for these head dimensions");
  split_items(c.segments, num_segments, kv_heads, threads, [&](int64_t first, int64_t last) {
    std::vector<float> scratch;
    std::vector<const float*> keys;
    for (int64_t item = first; item < last; ++item) item_fn(c, item / kv_heads, item % kv_heads, scratch, keys);
  });
}

}  // namespace speclane
