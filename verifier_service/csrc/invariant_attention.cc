// Batch-invariant attention over the paged KV cache on a CPU, fp32 or bf16: every query's result is a function of
// its own query and the keys and values it sees, in sequence order, and of nothing else in the pass (the other
// sequences, its own segment's other tokens, a draft tree's siblings, how a prompt was cut into chunks, the
// threads). A token verified in a tree therefore gets the bits a plain decode step gives it, which is what makes a
// bf16 target's speculation lossless (batch_invariant.py).
//
// For each query, in fp32: its scores (each a dot product summed in one fixed pattern over the head dimension);
// their maximum; e^(score - maximum) of the keys it sees, laid out by their index among those keys (so a tree
// node's path, stored after its siblings, is summed as a plain step holds it: side by side after the context);
// their sum in lanes of that index; then the values of those keys weighed in that order, and scaled by 1 / sum.
//
// Layouts (E: float or bf16 as uint16_t, contiguous): query [T, heads, D]; out [T, heads, D]; cache
// [slots, kv_heads, 2 D] (a slot's key beside its value); tables [segments, max_blocks]; segments [segments, 3]:
// first row in the pass, new tokens, keys cached before them; previous [T]: the new token (an index among its
// segment's) that a row's token follows, -1 for the first. Query j sees the cached keys and the new tokens on its
// chain of `previous` back from itself, which precede it in the segment (a tree's parents come before their
// children).

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "items.h"
#include "kernels.h"
#include "vec.h"

namespace speclane {
namespace {

constexpr int64_t kTile = 16;        // keys in the lanes of one vector
constexpr int64_t kKeyBlock = 64;    // keys scored together: four tiles
constexpr int64_t kQueryChunk = 32;  // queries scored together: their rows of scores stay small

struct Call {
  const void* query;
  void* out;
  const void* cache;
  const int64_t* tables;
  const int64_t* segments;
  const int64_t* previous;
  int64_t heads, kv_heads, block_size, max_blocks;
  float scale;
};

// Scores of KT tiles of 16 keys (their values transposed: dimension d's at kt + d * kt_stride) for QR query rows.
// Each score sums its products in order of d, one accumulator per score, whatever QR and KT: a score's bits must
// not depend on which rows and keys share its block.
template <int D, int QR, int KT>
SPECLANE_INLINE void score_block(const float* q, const float* kt, int64_t kt_stride, float* scores, int64_t stride,
                                 float scale) {
  v16 acc[QR][KT] = {};
  for (int d = 0; d < D; ++d) {
    v16 k[KT];
    for (int t = 0; t < KT; ++t) k[t] = load(kt + d * kt_stride + 16 * t);
    for (int r = 0; r < QR; ++r) {
      const float x = q[r * D + d];
      for (int t = 0; t < KT; ++t) acc[r][t] += x * k[t];
    }
  }
  for (int r = 0; r < QR; ++r)
    for (int t = 0; t < KT; ++t) store(scores + r * stride + 16 * t, acc[r][t] * scale);
}

// score_block over rows [0, rows): blocks of 4, then one of the rest.
template <int D, int KT>
SPECLANE_INLINE void score_rows(const float* q, const float* kt, int64_t kt_stride, float* scores, int64_t stride,
                                float scale, int64_t rows) {
  int64_t row = 0;
  for (; row + 4 <= rows; row += 4)
    score_block<D, 4, KT>(q + row * D, kt, kt_stride, scores + row * stride, stride, scale);
  q += row * D;
  scores += row * stride;
  switch (rows - row) {
    case 3: score_block<D, 3, KT>(q, kt, kt_stride, scores, stride, scale); break;
    case 2: score_block<D, 2, KT>(q, kt, kt_stride, scores, stride, scale); break;
    case 1: score_block<D, 1, KT>(q, kt, kt_stride, scores, stride, scale); break;
    default: break;
  }
}

// score_rows over `tiles` (1 to 4) tiles of keys.
template <int D>
SPECLANE_INLINE void score_keys(int64_t tiles, const float* q, const float* kt, int64_t kt_stride, float* scores,
                                int64_t stride, float scale, int64_t rows) {
  switch (tiles) {
    case 4: score_rows<D, 4>(q, kt, kt_stride, scores, stride, scale, rows); break;
    case 3: score_rows<D, 3>(q, kt, kt_stride, scores, stride, scale, rows); break;
    case 2: score_rows<D, 2>(q, kt, kt_stride, scores, stride, scale, rows); break;
    default: score_rows<D, 1>(q, kt, kt_stride, scores, stride, scale, rows); break;
  }
}

// out[r] = sum over l of p[r][l] * value l, in order of l, times inverse_sums[r]: VR rows and VC vectors of 16 of
// the head dimension at a time, in registers.
template <typename E, int VR, int VC>
SPECLANE_INLINE void weigh_values(const float* p, int64_t p_stride, const E* const* values, int64_t count,
                                  int64_t column, float* out, int64_t out_stride, const float* inverse_sums) {
  v16 acc[VR][VC] = {};
  for (int64_t l = 0; l < count; ++l) {
    const E* value = values[l] + column;
    if (l + 8 < count)
      for (int c = 0; c < VC; ++c) __builtin_prefetch(values[l + 8] + column + 16 * c);
    v16 v[VC];
    for (int c = 0; c < VC; ++c) v[c] = load16(value + 16 * c);
    for (int r = 0; r < VR; ++r) {
      const float weight = p[r * p_stride + l];
      for (int c = 0; c < VC; ++c) acc[r][c] += weight * v[c];
    }
  }
  for (int r = 0; r < VR; ++r)
    for (int c = 0; c < VC; ++c) store(out + r * out_stride + column + 16 * c, acc[r][c] * inverse_sums[r]);
}

// One query's group of rows: p [group, p_stride] weighs the values in order.
template <typename V, int D>
SPECLANE_INLINE void weigh_group(const float* p, int64_t p_stride, const V* const* values, int64_t count,
                                 int64_t group, float* result, const float* inverse_sums) {
  constexpr int VC = D / 16 < 8 ? D / 16 : 8, VR = 16 / VC < 4 ? 16 / VC : 4;
  for (int64_t column = 0; column < D; column += 16 * VC) {
    int64_t g = 0;
    for (; g + VR <= group; g += VR)
      weigh_values<V, VR, VC>(p + g * p_stride, p_stride, values, count, column, result + g * D, D, inverse_sums + g);
    const int64_t rest = group - g;
    if (VR > 3 && rest == 3)
      weigh_values<V, 3, VC>(p + g * p_stride, p_stride, values, count, column, result + g * D, D, inverse_sums + g);
    if (VR > 2 && rest == 2)
      weigh_values<V, 2, VC>(p + g * p_stride, p_stride, values, count, column, result + g * D, D, inverse_sums + g);
    if (VR > 1 && rest == 1)
      weigh_values<V, 1, VC>(p + g * p_stride, p_stride, values, count, column, result + g * D, D, inverse_sums + g);
  }
}

// From this many new tokens a segment's keys and values are widened to fp32 once, the keys transposed, rather than
// per query chunk and per query: the same values, read by every query of a prompt chunk.
constexpr int64_t kWidenFrom = 8;

struct Scratch {
  std::vector<float> floats;
  std::vector<float> wide;  // [D, keys] the keys transposed, then [keys, D] the values
  std::vector<const void*> keys;    // each key's row in the cache, by index in the segment
  std::vector<const void*> values;  // each key's value, by index in the segment (widened or in the cache)
  std::vector<const void*> seen;    // the values one query sees, in order
  std::vector<int64_t> seen_index;  // their indices
  std::vector<int64_t> depth;       // each new token's path length
};

// Keys k0 .. k0 + 15 of the item (s.keys), fp32 and transposed: dimension d's at out + d * out_stride.
template <typename E, int D>
SPECLANE_INLINE void transpose_tile(const Scratch& s, int64_t k0, float* out, int64_t out_stride) {
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    v16 tile[16];
    for (int k = 0; k < 16; ++k) {
      __builtin_prefetch(static_cast<const E*>(s.keys[k0 + 2 * kTile + k]) + d0);
      tile[k] = load16(static_cast<const E*>(s.keys[k0 + k]) + d0);
    }
    transpose16(tile);
    for (int d = 0; d < 16; ++d) store(out + (d0 + d) * out_stride, tile[d]);
  }
}

template <typename E, int D>
SPECLANE_CLONES void attend_item(const Call& c, int64_t segment, int64_t kv_head, Scratch& s) {
  const int64_t* seg = c.segments + 3 * segment;
  const int64_t first_row = seg[0], queries = seg[1], cached = seg[2];
  const int64_t group = c.heads / c.kv_heads, num_keys = cached + queries, slot_width = c.kv_heads * 2 * D;
  const int64_t* table = c.tables + segment * c.max_blocks;
  const E* cache = static_cast<const E*>(c.cache);
  const E* query = static_cast<const E*>(c.query);
  E* out = static_cast<E*>(c.out);

  const int64_t padded_keys = (num_keys + kTile - 1) / kTile * kTile;
  s.keys.resize(padded_keys + 2 * kTile);
  for (int64_t k = 0, block = 0; k < num_keys; ++block) {
    const E* row = cache + table[block] * c.block_size * slot_width + kv_head * 2 * D;
    for (int64_t offset = 0; offset < c.block_size && k < num_keys; ++offset, ++k, row += slot_width) s.keys[k] = row;
  }
  // The last tile's padding (its scores go unread) and two tiles after it (only prefetched): the last key again.
  std::fill(s.keys.begin() + num_keys, s.keys.end(), s.keys[num_keys - 1]);
  auto key = [&](int64_t k) { return static_cast<const E*>(s.keys[k]); };

  const int64_t chunk_rows = std::min(queries, kQueryChunk) * group;
  const int64_t stride = padded_keys;  // a row of scores, or of one query's weights
  s.floats.resize(chunk_rows * (stride + D) + D * kKeyBlock + group * (stride + D + 1));
  float* scores = s.floats.data();          // [chunk rows, stride] by key index
  float* q = scores + chunk_rows * stride;  // [chunk rows, D]
  float* kt = q + chunk_rows * D;           // [D, 64] a block's keys, transposed
  float* p = kt + D * kKeyBlock;            // [group, stride] one query's weights, by index among the keys it sees
  float* result = p + group * stride;       // [group, D]
  float* inverse_sums = result + group * D;
  const bool wide = queries >= kWidenFrom;
  float* wide_keys = nullptr;    // [D, stride]
  float* wide_values = nullptr;  // [keys, D]
  if (wide) {
    s.wide.resize(2 * stride * D);
    wide_keys = s.wide.data();
    wide_values = wide_keys + stride * D;
    for (int64_t k0 = 0; k0 < stride; k0 += kTile) transpose_tile<E, D>(s, k0, wide_keys + k0, stride);
    for (int64_t k = 0; k < num_keys; ++k)
      for (int64_t d = 0; d < D; ++d) wide_values[k * D + d] = to_float(key(k)[D + d]);
  }
  // Each new token's path length (itself and the new tokens before it): its previous one's plus one.
  s.depth.resize(queries);
  int64_t* depth = s.depth.data();
  for (int64_t j = 0; j < queries; ++j) {
    const int64_t before = c.previous[first_row + j];
    depth[j] = before < 0 ? 1 : depth[before] + 1;
  }
  v16 lane;
  for (int i = 0; i < 16; ++i) lane[i] = static_cast<float>(i);
  s.values.resize(num_keys);
  for (int64_t k = 0; k < num_keys; ++k)
    s.values[k] = wide ? static_cast<const void*>(wide_values + k * D) : static_cast<const void*>(key(k) + D);
  // A tree query's keys: the cached ones, the same for every query, then its path (filled in per query).
  s.seen_index.resize(num_keys);
  s.seen.resize(num_keys);
  for (int64_t k = 0; k < cached; ++k) {
    s.seen_index[k] = k;
    s.seen[k] = s.values[k];
  }

  for (int64_t q0 = 0; q0 < queries; q0 += kQueryChunk) {
    const int64_t q1 = std::min(queries, q0 + kQueryChunk), key_end = cached + q1;
    for (int64_t row = 0; row < (q1 - q0) * group; ++row) {
      const E* source = query + ((first_row + q0 + row / group) * c.heads + kv_head * group + row % group) * D;
      for (int64_t d = 0; d < D; ++d) q[row * D + d] = to_float(source[d]);
    }
    // Scores of each block of keys for the queries that may see one of its keys (query j sees none past cached + j).
    for (int64_t k0 = 0; k0 < key_end; k0 += kKeyBlock) {
      const int64_t tiles = std::min<int64_t>(kKeyBlock, key_end - k0 + kTile - 1) / kTile;
      if (!wide)
        for (int64_t t = 0; t < tiles; ++t) transpose_tile<E, D>(s, k0 + t * kTile, kt + t * kTile, kKeyBlock);
      const int64_t first_query = std::max(q0, k0 - cached);
      score_keys<D>(tiles, q + (first_query - q0) * group * D, wide ? wide_keys + k0 : kt, wide ? stride : kKeyBlock,
                    scores + (first_query - q0) * group * stride + k0, stride, c.scale, (q1 - first_query) * group);
    }
    for (int64_t j = q0; j < q1; ++j) {
      // The keys query j sees, in order: the cached ones, then its chain of new tokens. Where that chain is every
      // new token before it (a prompt, a decode, a chain draft), they are the segment's first keys, in place.
      const int64_t count = cached + depth[j];
      const bool in_place = depth[j] == j + 1;
      float* weights = in_place ? scores + (j - q0) * group * stride : p;  // [group, stride]
      if (!in_place) {
        for (int64_t t = j, at = count - 1; t >= 0; t = c.previous[first_row + t], --at) {
          s.seen_index[at] = cached + t;
          s.seen[at] = s.values[cached + t];
        }
        for (int64_t g = 0; g < group; ++g)
          for (int64_t l = 0; l < count; ++l)
            weights[g * stride + l] = scores[((j - q0) * group + g) * stride + s.seen_index[l]];
      }
      // Whole tiles, then the last one's lanes up to `count` (the rest weigh 0).
      const int64_t whole = count / kTile * kTile;
      const auto tail = lane < splat(static_cast<float>(count - whole));
      for (int64_t g = 0; g < group; ++g) {
        float* row = weights + g * stride;
        v16 most = splat(-__builtin_huge_valf());
        for (int64_t l0 = 0; l0 < whole; l0 += kTile) {
          const v16 x = load(row + l0);
          most = x > most ? x : most;
        }
        if (whole < count) {
          const v16 x = load(row + whole);
          most = tail ? (x > most ? x : most) : most;
        }
        const float largest = lanes_max(most);
        v16 sums{};
        for (int64_t l0 = 0; l0 < whole; l0 += kTile) {
          const v16 e = exp_nonpositive(load(row + l0) - largest);
          sums += e;
          store(row + l0, e);
        }
        if (whole < count) {
          const v16 e = tail ? exp_nonpositive(load(row + whole) - largest) : v16{};
          sums += e;
          store(row + whole, e);
        }
        inverse_sums[g] = 1.0f / lanes_sum(sums);
      }
      const void* const* values = in_place ? s.values.data() : s.seen.data();
      if (wide)
        weigh_group<float, D>(weights, stride, reinterpret_cast<const float* const*>(values), count, group, result,
                              inverse_sums);
      else
        weigh_group<E, D>(weights, stride, reinterpret_cast<const E* const*>(values), count, group, result,
                          inverse_sums);
      for (int64_t g = 0; g < group; ++g) {
        E* target = out + ((first_row + j) * c.heads + kv_head * group + g) * D;
        for (int64_t d = 0; d < D; ++d) from_float(result[g * D + d], target + d);
      }
    }
  }
}

using ItemFn = void (*)(const Call&, int64_t, int64_t, Scratch&);

template <typename E, int... Dims>
ItemFn compiled_for(int64_t head_dim) {
  ItemFn found = nullptr;
  ((head_dim == Dims ? (found = attend_item<E, Dims>, true) : false) || ...);
  return found;
}

ItemFn item_function(int64_t head_dim, bool bf16) {
  return bf16 ? compiled_for<uint16_t, 16, 32, 64, 96, 128, 256>(head_dim)
              : compiled_for<float, 16, 32, 64, 96, 128, 256>(head_dim);
}

}  // namespace

bool attends_invariantly(int64_t head_dim) { return item_function(head_dim, false) != nullptr; }

void attend_invariant(uintptr_t query, uintptr_t out, uintptr_t cache, uintptr_t tables, uintptr_t segments,
                      uintptr_t previous, int64_t num_segments, int64_t heads, int64_t kv_heads, int64_t head_dim,
                      int64_t block_size, int64_t max_blocks, double scale, bool bf16, int threads) {
  const Call c{reinterpret_cast<const void*>(query), reinterpret_cast<void*>(out),
               reinterpret_cast<const void*>(cache), reinterpret_cast<const int64_t*>(tables),
               reinterpret_cast<const int64_t*>(segments), reinterpret_cast<const int64_t*>(previous), heads,
               kv_heads, block_size, max_blocks, static_cast<float>(scale)};
  const ItemFn item_fn = item_function(head_dim, bf16);
  if (item_fn == nullptr) throw std::invalid_argument("no invariant attention kernel for this head dimension");
  split_items(c.segments, num_segments, kv_heads, threads, [&](int64_t first, int64_t last) {
    Scratch scratch;
    for (int64_t item = first; item < last; ++item) item_fn(c, item / kv_heads, item % kv_heads, scratch);
  });
}

}  // namespace speclane
