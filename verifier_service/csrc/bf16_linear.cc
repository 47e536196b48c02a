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
#include <cstdint>

#include "kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define SPECLANE_BF16_TARGET __attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))

namespace speclane {
namespace {

constexpr int64_t kLanes = 16;  // outputs a vector holds
constexpr int64_t kLine = 2 * kLanes;  // a pair of inputs for 16 outputs: one 64-byte cache line of the packed weight

// y[m, 16 t + i] for NT groups of 16 outputs from group `group`, MG input rows; fetching `ahead` (another group's
// weights, read as one group's, a line a pair of inputs) into cache as it goes, unless null.
template <int NT, int MG>
SPECLANE_BF16_TARGET inline void tile(const uint16_t* x, const uint16_t* packed, const uint16_t* bias, uint16_t* y,
                                      int64_t in, int64_t out, int64_t block, int64_t group, const uint16_t* ahead) {
  const int64_t pairs = in / 2;
  const uint16_t* w = packed + group * pairs * kLine;
  __m512 total[NT][MG] = {};
  for (int64_t first = 0; first < pairs; first += block / 2) {
    const int64_t last = std::min(pairs, first + block / 2);
    __m512 acc[NT][MG];
    for (int j = 0; j < NT; ++j)
      for (int m = 0; m < MG; ++m) acc[j][m] = _mm512_setzero_ps();
    for (int64_t p = first; p < last; ++p) {
      __m512bh xv[MG];
      for (int m = 0; m < MG; ++m) {
        int32_t both;
        __builtin_memcpy(&both, x + m * in + 2 * p, sizeof both);
        xv[m] = (__m512bh)_mm512_set1_epi32(both);
      }
      for (int j = 0; j < NT; ++j) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (j * pairs + p) * kLine);
        for (int m = 0; m < MG; ++m) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], wv, xv[m]);
        if (j == 0 && ahead != nullptr) _mm_prefetch(reinterpret_cast<const char*>(ahead + p * kLine), _MM_HINT_T0);
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

constexpr int kGroup = 4;  // input rows a tile holds at most

// The tile of NT groups for mg (1 to kGroup) input rows.
template <int NT>
SPECLANE_BF16_TARGET inline void tile_rows(int mg, const uint16_t* x, const uint16_t* packed, const uint16_t* bias,
                                           uint16_t* y, int64_t in, int64_t out, int64_t block, int64_t group,
                                           const uint16_t* ahead) {
  switch (mg) {
    case 1: tile<NT, 1>(x, packed, bias, y, in, out, block, group, ahead); break;
    case 2: tile<NT, 2>(x, packed, bias, y, in, out, block, group, ahead); break;
    case 3: tile<NT, 3>(x, packed, bias, y, in, out, block, group, ahead); break;
    default: tile<NT, kGroup>(x, packed, bias, y, in, out, block, group, ahead); break;
  }
}

// Groups [first, last) of 16 outputs, NT at a time (one at a time in a thread's last, short run), against every
// input row.
template <int NT>
SPECLANE_BF16_TARGET void groups(const uint16_t* x, const uint16_t* packed, const uint16_t* bias, uint16_t* y,
                                 int64_t rows, int64_t in, int64_t out, int64_t block, int64_t ahead_rows,
                                 int64_t first, int64_t last) {
  // A group's first tile of rows reads its weights from memory and the later tiles from cache, so the memory would
  // wait while they compute. In passes of at least ahead_rows rows, the group's tile t fetches the next group's
  // t-th 16 outputs as it goes instead, a line per pair of inputs, about the rate the memory serves one core; the
  // next group's first tile then finds its weights in cache.
  const int64_t pairs = in / 2;
  const bool ahead = ahead_rows > 0 && rows >= ahead_rows;
  for (int64_t g = first; g < last; g += NT) {
    const int64_t n = std::min<int64_t>(NT, last - g), next = std::min<int64_t>(NT, last - g - n);
    for (int64_t m = 0; m < rows; m += kGroup) {
      const int mg = static_cast<int>(std::min<int64_t>(kGroup, rows - m));
      const int64_t t = m / kGroup;
      const uint16_t* fetch = ahead && t < next ? packed + ((g + n) + t) * pairs * kLine : nullptr;
      if (n == NT) {
        tile_rows<NT>(mg, x + m * in, packed, bias, y + m * out, in, out, block, g, fetch);
      } else {
        for (int64_t j = 0; j < n; ++j)
          tile_rows<1>(mg, x + m * in, packed, bias, y + m * out, in, out, block, g + j, nullptr);
      }
    }
  }
}

}  // namespace

bool bf16_linear_ready() { return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw"); }

void bf16_linear(uintptr_t x, uintptr_t packed, uintptr_t bias, uintptr_t y, int64_t rows, int64_t in_features,
                 int64_t out_features, int64_t block, int64_t ahead_rows, int threads) {
  // Groups of 16 outputs a tile holds: 4 was the fastest of 1, 2 and 4 at every row count to 16 (a pass of
  // Qwen2.5-0.5B's products at 16 rows: 31.5 ms against 37.7 with 2).
  constexpr int kTiles = 4;
  const int64_t count = out_features / kLanes;
  const int64_t tiles = (count + kTiles - 1) / kTiles;
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(threads, tiles)))
  {
    const int t = omp_get_thread_num(), team = omp_get_num_threads();
    const int64_t first = std::min(count, tiles * t / team * kTiles);
    const int64_t last = std::min(count, tiles * (t + 1) / team * kTiles);
    groups<kTiles>(reinterpret_cast<const uint16_t*>(x), reinterpret_cast<const uint16_t*>(packed),
                   bias ? reinterpret_cast<const uint16_t*>(bias) : nullptr, reinterpret_cast<uint16_t*>(y), rows,
                   in_features, out_features, block, ahead_rows, first, last);
  }
}

}  // namespace speclane

#else

namespace speclane {
bool bf16_linear_ready() { return false; }
void bf16_linear(uintptr_t, uintptr_t, uintptr_t, uintptr_t, int64_t, int64_t, int64_t, int64_t, int64_t, int) {}
}  // namespace speclane

#endif
