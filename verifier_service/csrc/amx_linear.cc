// bf16 linear layers on Intel AMX (Sapphire Rapids and later) that give every row the same bits whatever the other
// rows: the batch-invariant products that make a bf16 target's speculation lossless (batch_invariant.py).
//
// oneDNN's bf16 products on AMX pick their kernel and their split of the input dimension by the number of rows,
// so a token's values depend on its batch, and no padding fixed that for every shape (docs/benchmarks/bf16).
// Here the order is fixed: each output sums its input dimension in blocks of 32, in order, each block by one tile
// product (TDPBF16PS, whose sum over a block's 16 pairs is fixed by the instruction), and a row is one row of an
// A tile, computed from its own values alone.
//
// Layouts. The weight [out, in] is packed once at load (amx_linear.py) into tiles of 16 outputs by 32 inputs in
// AMX's pair-interleaved form: [out / 16][in / 32][16 input pairs][16 outputs][2], zero-padded. x is [rows, in] bf16
// with `in` a multiple of 32 (the caller pads other widths); y [rows, out] bf16, rounded to nearest even.
//
// Gated (a SwiGLU MLP's gate and up projections in one product): the packed weight alternates the gate's output
// blocks with the up projection's, so a tile product of two output blocks holds both halves of 16 outputs, and y
// [rows, out] gets silu(gate) * up from their fp32 sums, rounded once.

#include "kernels.h"

#if defined(__x86_64__) && defined(__GNUC__) && __GNUC__ >= 11
#define SPECLANE_AMX 1
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "vec.h"
#endif

namespace speclane {

#ifdef SPECLANE_AMX
namespace {

#define SPECLANE_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16,avx512bw,avx512vl")))

constexpr int kTileRows = 16;      // rows of x, and outputs, per tile
constexpr int kBlock = 32;         // inputs per tile: 16 pairs
constexpr int kTileElems = 512;    // bf16 values of one packed weight tile

struct TileConfig {  // the 64-byte operand of LDTILECFG, palette 1
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: the sums of two row blocks by two output blocks (fp32); 4 and 5: the row blocks of x; 6 and 7: the
// output blocks' weights.
SPECLANE_AMX_TARGET void configure() {
  TileConfig config = {};
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTileRows;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

using Sums = float[2][2][kTileRows][kTileRows];  // [row block][output block][row][output]

// The sums of kM row blocks at a by one or two (kPair) output blocks at w0, w1, over all the input blocks in order:
// tile products of 2 x 2 blocks load two tiles per product rather than three.
template <int kM, bool kPair>
SPECLANE_AMX_TARGET void tile_sums(const uint16_t* a0, const uint16_t* a1, int64_t x_stride, const uint16_t* w0,
                                   const uint16_t* w1, int64_t k_blocks, Sums& sums) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    _tile_loadd(6, w0 + kb * kTileElems, 64);
    if (kPair) _tile_loadd(7, w1 + kb * kTileElems, 64);
    _tile_loadd(4, a0 + kb * kBlock, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    if (kPair) _tile_dpbf16ps(1, 4, 7);
    if (kM == 2) {
      _tile_loadd(5, a1 + kb * kBlock, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      if (kPair) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums[0][0], 64);
  if (kPair) _tile_stored(1, sums[0][1], 64);
  if (kM == 2) {
    _tile_stored(2, sums[1][0], 64);
    if (kPair) _tile_stored(3, sums[1][1], 64);
  }
}

// Rows [m, m + count) of the sums (row block i: sums[i]) of output blocks nb (and nb + 1 where `pair`) into y,
// rounded to bf16.
SPECLANE_AMX_TARGET void store_rows(const Sums& sums, uint16_t* y, int64_t m, int64_t count, int64_t nb, bool pair,
                                    int64_t out) {
  for (int j = 0; j < 1 + pair; ++j) {
    const int64_t first = (nb + j) * kTileRows;
    const __mmask16 columns = static_cast<__mmask16>((1u << std::min<int64_t>(kTileRows, out - first)) - 1);
    for (int64_t r = 0; r < count; ++r) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_loadu_ps(sums[r / kTileRows][j][r % kTileRows]));
      _mm256_mask_storeu_epi16(y + (m + r) * out + first, columns, reinterpret_cast<const __m256i&>(rounded));
    }
  }
}

// silu(gate) * up of rows [m, m + count) for outputs [16 g, 16 g + 16): the gate's sums are output block 0 of
// `sums`, the up projection's block 1. silu(x) = x sigmoid(x), with e^-|x| so that the exponential cannot overflow.
SPECLANE_AMX_TARGET void store_gated(const Sums& sums, uint16_t* y, int64_t m, int64_t count, int64_t g,
                                     int64_t out) {
  const int64_t first = g * kTileRows;
  const __mmask16 columns = static_cast<__mmask16>((1u << std::min<int64_t>(kTileRows, out - first)) - 1);
  for (int64_t r = 0; r < count; ++r) {
    const v16 gate = load(sums[r / kTileRows][0][r % kTileRows]), up = load(sums[r / kTileRows][1][r % kTileRows]);
    const v16 negative = gate < splat(0.0f) ? gate : -gate;
    const v16 e = exp_nonpositive(negative);
    const v16 sigmoid = (gate < splat(0.0f) ? e : splat(1.0f)) / (e + 1.0f);
    const __m256bh rounded = _mm512_cvtneps_pbh((__m512)(gate * sigmoid * up));
    _mm256_mask_storeu_epi16(y + (m + r) * out + first, columns, reinterpret_cast<const __m256i&>(rounded));
  }
}

// x's row blocks: the first `full` rows in place, the last partial block from a zero-padded copy, so that no tile
// load reads past x.
struct RowBlocks {
  const uint16_t* x;
  const uint16_t* tail;
  int64_t full, width;
  const uint16_t* at(int64_t m) const { return m < full ? x + m * width : tail; }
};

// A thread keeps this much of x in its L2 cache while it sweeps its output blocks over it, rather than reading all
// of x from memory once per output block pair.
constexpr int64_t kChunkBytes = 1 << 20;

// Output blocks [first, last) for every row: two output blocks by two row blocks at a time, chunk by chunk of rows.
SPECLANE_AMX_TARGET void output_blocks(const RowBlocks& x, const uint16_t* packed, uint16_t* y, int64_t rows,
                                       int64_t k_blocks, int64_t out, bool gated, int64_t first, int64_t last) {
  configure();
  alignas(64) Sums sums;
  const int64_t x_stride = x.width * 2;  // bytes per row
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / (x_stride * 2 * kTileRows)) * 2 * kTileRows;
  for (int64_t m0 = 0; m0 < rows; m0 += chunk) {
    const int64_t m1 = std::min(rows, m0 + chunk);
    for (int64_t nb = first; nb < last; nb += 2) {
      const bool pair = nb + 1 < last;
      const uint16_t* w0 = packed + nb * k_blocks * kTileElems;
      const uint16_t* w1 = w0 + k_blocks * kTileElems;
      for (int64_t m = m0; m < m1; m += 2 * kTileRows) {
        const uint16_t* a0 = x.at(m);
        const uint16_t* a1 = x.at(m + kTileRows);
        const bool two = m + kTileRows < m1;
        if (two && pair) tile_sums<2, true>(a0, a1, x_stride, w0, w1, k_blocks, sums);
        else if (two) tile_sums<2, false>(a0, a1, x_stride, w0, w1, k_blocks, sums);
        else if (pair) tile_sums<1, true>(a0, a1, x_stride, w0, w1, k_blocks, sums);
        else tile_sums<1, false>(a0, a1, x_stride, w0, w1, k_blocks, sums);
        const int64_t count = std::min<int64_t>(2 * kTileRows, m1 - m);
        if (gated) store_gated(sums, y, m, count, nb / 2, out);
        else store_rows(sums, y, m, count, nb, pair, out);
      }
    }
  }
  _tile_release();
}

}  // namespace

bool amx_ready() {
  if (!__builtin_cpu_supports("amx-bf16")) return false;
  // Linux hands out AMX's 8 KB of tile state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM for
  // XTILEDATA); oneDNN asks the same way, and asking twice is harmless.
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

void amx_linear(uintptr_t x, uintptr_t packed, uintptr_t y, int64_t rows, int64_t in_features,
                int64_t out_features, bool gated, int threads) {
  const int64_t k_blocks = in_features / kBlock;
  const int64_t n_blocks = (gated ? 2 : 1) * ((out_features + kTileRows - 1) / kTileRows);
  const int64_t pairs = (n_blocks + 1) / 2;
  const int64_t full = rows / kTileRows * kTileRows;
  std::vector<uint16_t> tail(full < rows ? kTileRows * in_features : 0);
  std::copy_n(reinterpret_cast<const uint16_t*>(x) + full * in_features, (rows - full) * in_features, tail.data());
  const RowBlocks blocks{reinterpret_cast<const uint16_t*>(x), tail.data(), full, in_features};
  // Each thread takes a contiguous run of output block pairs (a gate block with its up block when gated); a row's
  // sums do not depend on the split.
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(threads, pairs)))
  {
    const int t = omp_get_thread_num(), team = omp_get_num_threads();
    const int64_t first = std::min(n_blocks, pairs * t / team * 2);
    const int64_t last = std::min(n_blocks, pairs * (t + 1) / team * 2);
    if (first < last)
      output_blocks(blocks, reinterpret_cast<const uint16_t*>(packed), reinterpret_cast<uint16_t*>(y), rows,
                    k_blocks, out_features, gated, first, last);
  }
}

#else

bool amx_ready() { return false; }

void amx_linear(uintptr_t, uintptr_t, uintptr_t, int64_t, int64_t, int64_t, bool, int) {}

#endif

}  // namespace speclane
