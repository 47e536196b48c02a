// bf16 products on CPUs with AVX512-BF16 and no AMX (AMD Zen 4 and 5, Intel Cooper Lake), every row summed in one
// order whatever else the pass holds: bf16_linear.py documents why.
//
// oneDNN streams a decode step's weights at a third of this machine's memory bandwidth (24 against 66-75 GB/s for a
// plain read of the same bytes): its bf16 product is built for many rows. This kernel reads each weight byte once
// per pass, from a copy packed at load as the dot-product instruction wants it: for 16 outputs, the pairs of inputs
// k and k + 1 side by side, [out / 16][in / 2][16][2].
//
// The sums: each output is the instruction's running sum over the pairs of inputs (odd product, then even), from
// zero in each block of `block` inputs, and the blocks' sums are added in order; the bias last; then rounded to
// bf16 (nearest even). So a row's bits do not depend on the other rows.

#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define SPECLANE_BF16_TARGET __attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))

namespace speclane {
namespace {

constexpr int64_t kLanes = 16;  // outputs a vector holds
constexpr int64_t kLine = 2 * kLanes;  // a pair of inputs for 16 outputs: one 64-byte cache line of the packed weight

// y[m, 16 t + i] for NT groups of 16 outputs from group `group`, MG input rows; fetching into cache, a line per pair
// of inputs, from `fetch` on as it goes, unless null.
template <int NT, int MG>
SPECLANE_BF16_TARGET void tile(const uint16_t* x, const uint16_t* packed, const uint16_t* bias, uint16_t* y,
                               int64_t in, int64_t out, int64_t block, int64_t group, const uint16_t* fetch) {
  const int64_t pairs = in / 2;
  const uint16_t* w = packed + group * pairs * kLine;
  __m512 total[NT][MG] = {};
  for (int64_t first = 0; first < pairs; first += block / 2) {
    const int64_t last = std::min(pairs, first + block / 2);
    __m512 acc[NT][MG];
    for (int j = 0; j < NT; ++j)
      for (int m = 0; m < MG; ++m) acc[j][m] = _mm512_setzero_ps();
    for (int64_t p = first; p < last; ++p) {
      // The weights first, then each row's pair of inputs broadcast in turn: registers for NT x MG sums, NT
      // weight vectors and one row's inputs (a tile of 16 rows fits in AVX-512's 32).
      __m512bh wv[NT];
      for (int j = 0; j < NT; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + (j * pairs + p) * kLine);
      if (fetch != nullptr) _mm_prefetch(reinterpret_cast<const char*>(fetch + p * kLine), _MM_HINT_T0);
      for (int m = 0; m < MG; ++m) {
        int32_t both;
        __builtin_memcpy(&both, x + m * in + 2 * p, sizeof both);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(both);
        for (int j = 0; j < NT; ++j) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], wv[j], xv);
      }
    }
    for (int j = 0; j < NT; ++j)
      for (int m = 0; m < MG; ++m) total[j][m] = first == 0 ? acc[j][m] : _mm512_add_ps(total[j][m], acc[j][m]);
  }
  for (int j = 0; j < NT; ++j) {
    const int64_t o = (group + j) * kLanes;
    __m512 b = _mm512_setzero_ps();
    if (bias != nullptr)
      b = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + o))), 16));
    for (int m = 0; m < MG; ++m) {
      const __m512 v = bias != nullptr ? _mm512_add_ps(total[j][m], b) : total[j][m];
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * out + o), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

using Tile = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t, int64_t,
                      int64_t, const uint16_t*);

template <int NT, int... M>
constexpr std::array<Tile, sizeof...(M)> tiles_by_rows(std::integer_sequence<int, M...>) {
  return {&tile<NT, M + 1>...};
}

constexpr int kGroup = 4;  // input rows a tile of 4 groups holds at most
constexpr int kTiles = 4;  // groups of 16 outputs such a tile holds
constexpr int64_t kWideRows = 16;  // input rows a tile of one group holds at most
// Lines a tile of one group fetches ahead of its reads: any of 128-512 gave the same times.
constexpr int64_t kFetchLines = 256;

// The tiles of NT groups for 1 to MG rows, [rows - 1].
template <int NT, int MG>
constexpr auto kTilesByRows = tiles_by_rows<NT>(std::make_integer_sequence<int, MG>{});

// Groups [first, last) of 16 outputs against every input row.
SPECLANE_BF16_TARGET void groups(const uint16_t* x, const uint16_t* packed, const uint16_t* bias, uint16_t* y,
                                 int64_t rows, int64_t in, int64_t out, int64_t block, int64_t wide_rows,
                                 int64_t ahead_rows, int64_t first, int64_t last) {
  const int64_t pairs = in / 2;
  if (rows >= 2 && rows <= wide_rows) {
    // Every row in one tile of one group: the weights stream from memory once, fetched far enough ahead that the
    // memory keeps reading while the tile computes (the packed groups follow each other, so the fetching runs on
    // into the next group). One row streams as fast through the tiles below (1.02x the time this way).
    const Tile one = kTilesByRows<1, kWideRows>[rows - 1];
    for (int64_t g = first; g < last; ++g)
      one(x, packed, bias, y, in, out, block, g, packed + (g * pairs + kFetchLines) * kLine);
    return;
  }
  // Tiles of 4 groups by 4 rows: a group's first tile reads its weights from memory and the later tiles from
  // cache, so the memory would wait while they compute. In passes of at least ahead_rows rows, the group's tile t
  // fetches the next group's t-th 16 outputs as it goes instead, a line per pair of inputs, about the rate the
  // memory serves one core; the next group's first tile then finds its weights in cache.
  const bool ahead = ahead_rows > 0 && rows >= ahead_rows;
  for (int64_t g = first; g < last; g += kTiles) {
    const int64_t n = std::min<int64_t>(kTiles, last - g), next = std::min<int64_t>(kTiles, last - g - n);
    for (int64_t m = 0; m < rows; m += kGroup) {
      const int64_t mg = std::min<int64_t>(kGroup, rows - m), t = m / kGroup;
      const uint16_t* fetch = ahead && t < next ? packed + ((g + n) + t) * pairs * kLine : nullptr;
      if (n == kTiles) {
        kTilesByRows<kTiles, kGroup>[mg - 1](x + m * in, packed, bias, y + m * out, in, out, block, g, fetch);
      } else {  // a thread's last, short run: a group at a time
        for (int64_t j = 0; j < n; ++j)
          kTilesByRows<1, kGroup>[mg - 1](x + m * in, packed, bias, y + m * out, in, out, block, g + j, nullptr);
      }
    }
  }
}

}  // namespace

bool bf16_linear_ready() { return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw"); }

void bf16_linear(uintptr_t x, uintptr_t packed, uintptr_t bias, uintptr_t y, int64_t rows, int64_t in_features,
                 int64_t out_features, int64_t block, int64_t wide_rows, int64_t ahead_rows, int threads) {
  if (rows == 0) return;  // a prompt chunk's logits, none wanted
  wide_rows = std::min(wide_rows, kWideRows);
  const int64_t count = out_features / kLanes;
  const int64_t tiles = (count + kTiles - 1) / kTiles;
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(threads, tiles)))
  {
    const int t = omp_get_thread_num(), team = omp_get_num_threads();
    const int64_t first = std::min(count, tiles * t / team * kTiles);
    const int64_t last = std::min(count, tiles * (t + 1) / team * kTiles);
    groups(reinterpret_cast<const uint16_t*>(x), reinterpret_cast<const uint16_t*>(packed),
           bias ? reinterpret_cast<const uint16_t*>(bias) : nullptr, reinterpret_cast<uint16_t*>(y), rows, in_features,
           out_features, block, wide_rows, ahead_rows, first, last);
  }
}

}  // namespace speclane

#else

namespace speclane {
bool bf16_linear_ready() { return false; }
void bf16_linear(uintptr_t, uintptr_t, uintptr_t, uintptr_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                 int) {}
}  // namespace speclane

#endif
