// A linear layer's product for a pass of a few rows on a CPU: y [rows, out] = x [rows, in] W^T, W [out, in] as the
// checkpoint holds it.
//
// With one to a few rows the product is a read of the weight: SmolLM2's 540 MB a pass. GEMM libraries pack the
// weight into panels first (in a decode step, 40% of MKL's sgemm samples were those copies), or keep a second,
// reordered copy (oneDNN's). Here each weight row is read once, in place, and multiplied with every input row while
// it is in registers: a pass's 211 products took 0.80-0.92x the time of the fastest other way at one to three rows,
// one row about as fast as the machine streams memory (docs/benchmarks/verifier-engine). A tile of NB weight rows
// by MG input rows is held in vector accumulators; more input rows than MG reuse the tile's weight rows from L1.
//
// y[r, o] is the same sum, in the same order, whatever the other rows: a token's product does not depend on its
// batch.

#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "kernels.h"
#include "vec.h"

namespace speclane {
namespace {

// Where a tile asks for weight lines ahead of its loads. With one input row the hardware prefetcher alone streams
// the weight at the machine's bandwidth. With more, a tile's products hold the core's schedulers, and the loads
// behind them wait: the read and the products then take their sum, not the longer of the two, unless lines are
// asked for ahead. 1 KB ahead in the same row pays at two and three rows; from four, asking for the next tile's
// line at the same offset made SmolLM2's products 0.62-0.87x the time at 4-10 rows, where at 2 and 3 it was
// within the noise (docs/benchmarks/verifier-engine).
enum class Ahead { kNone, kSameRow, kNextTile };

// y[m, j] for the NB weight rows at w and the MG input rows at x (row strides: in for both, out for y).
template <int NB, int MG, Ahead A>
SPECLANE_INLINE void tile(const float* x, const float* w, float* y, int64_t in, int64_t out) {
  const int64_t whole = in / 16 * 16;
  v16 acc[NB][MG] = {};
  for (int64_t k = 0; k < whole; k += 16) {
    v16 xv[MG];
    for (int m = 0; m < MG; ++m) xv[m] = load(x + m * in + k);
    for (int j = 0; j < NB; ++j) {
      if (A == Ahead::kSameRow) __builtin_prefetch(w + j * in + k + 256);
      if (A == Ahead::kNextTile) __builtin_prefetch(w + (NB + j) * in + k);
      const v16 wv = load(w + j * in + k);
      for (int m = 0; m < MG; ++m) acc[j][m] += wv * xv[m];
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MG; ++m) {
      float sum = lanes_sum(acc[j][m]);
      for (int64_t k = whole; k < in; ++k) sum += x[m * in + k] * w[j * in + k];
      y[m * out + j] = sum;
    }
}

constexpr int kGroup = 4;  // input rows a tile holds at most

// The NB weight rows at w against every input row, kGroup rows a tile.
template <int NB, Ahead A>
SPECLANE_INLINE void weight_rows(const float* x, const float* w, float* y, int64_t rows, int64_t in, int64_t out) {
  int64_t m = 0;
  for (; m + kGroup <= rows; m += kGroup) tile<NB, kGroup, A>(x + m * in, w, y + m * out, in, out);
  switch (rows - m) {
    case 1: tile<NB, 1, A>(x + m * in, w, y + m * out, in, out); break;
    case 2: tile<NB, 2, A>(x + m * in, w, y + m * out, in, out); break;
    case 3: tile<NB, 3, A>(x + m * in, w, y + m * out, in, out); break;
    default: break;
  }
}

// Outputs [first, last), NB weight rows at a time.
template <int NB, Ahead A>
SPECLANE_CLONES void outputs(const float* x, const float* w, float* y, int64_t rows, int64_t in, int64_t out,
                             int64_t first, int64_t last) {
  int64_t o = first;
  for (; o + NB <= last; o += NB) weight_rows<NB, A>(x, w + o * in, y + o, rows, in, out);
  for (; o < last; ++o) weight_rows<1, A>(x, w + o * in, y + o, rows, in, out);
}

using OutputsFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);

// Weight rows a tile takes, by the input rows it holds: as many accumulators as leave registers for the operands
// (the fastest on the model's whole set of products, one to eight rows).
struct Plan {
  int weight_rows;
  OutputsFn fn;
};

Plan plan(int64_t rows) {
  if (rows == 1) return {8, outputs<8, Ahead::kNone>};
  if (rows == 2) return {8, outputs<8, Ahead::kSameRow>};
  if (rows == 3) return {6, outputs<6, Ahead::kSameRow>};
  return {5, outputs<5, Ahead::kNextTile>};
}

}  // namespace

void linear(uintptr_t x, uintptr_t weight, uintptr_t y, int64_t rows, int64_t in_features, int64_t out_features,
            int threads) {
  const Plan p = plan(rows);
  // Each thread takes a contiguous run of outputs, whole tiles.
  const int64_t tiles = (out_features + p.weight_rows - 1) / p.weight_rows;
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(threads, tiles)))
  {
    const int t = omp_get_thread_num(), team = omp_get_num_threads();
    const int64_t first = std::min(out_features, tiles * t / team * p.weight_rows);
    const int64_t last = std::min(out_features, tiles * (t + 1) / team * p.weight_rows);
    p.fn(reinterpret_cast<const float*>(x), reinterpret_cast<const float*>(weight), reinterpret_cast<float*>(y),
         rows, in_features, out_features, first, last);
  }
}

}  // namespace speclane
