// Top-p's nucleus of each row of probabilities without sorting the row: the smallest set of its most likely tokens
// whose mass reaches top_p (a token is kept while the mass of the tokens before it, most likely first and equal ones
// by index, is under top_p), renormalised; a row with top_p >= 1 is copied. Sorting a row of SmolLM2's 49,152 took
// 3.5 ms on this repository's CPU host, and rows whose nucleus is wider than sampling.NUCLEUS_WIDTH tokens fell back
// to it.
//
// A non-negative float's bits order as the float does (the sign is dropped, so -0 counts as 0), so the row's mass is
// counted by the top 11 bits under the sign (2,048 buckets: an exponent and three mantissa bits) in one read; the
// bucket in which the mass from the top reaches top_p holds the last kept token. A second read takes that bucket's
// tokens, whose mass is counted again by the next 10 bits, and only the tokens of the sub-bucket where top_p is
// reached are sorted (by value, then index) to find the last kept token. A third read writes the tokens before it
// divided by their mass. Masses are summed in double.
//
// Layout: probs and out [rows, vocab], contiguous fp32; top_p [rows] fp32.

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels.h"

namespace speclane {
namespace {

constexpr int kShift = 20;  // a value's bucket is its bits above these, the sign's left out
constexpr int kBuckets = 1 << (31 - kShift);
constexpr int kSubShift = 10;  // and its sub-bucket the next bits above these
constexpr int kSubBuckets = 1 << (kShift - kSubShift);

uint32_t bits_of(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits & 0x7fffffffu;
}

// The highest bucket at which the mass from the top reaches top_p, adding the mass of the buckets above it to
// `above`; -1 where none does (a total rounded under top_p, or NaN).
int64_t reaching(const std::vector<double>& mass, double top_p, double& above) {
  int64_t bucket = static_cast<int64_t>(mass.size()) - 1;
  for (; bucket >= 0 && !(above + mass[bucket] >= top_p); --bucket) above += mass[bucket];
  return bucket;
}

struct Scratch {
  std::vector<double> mass = std::vector<double>(kBuckets);
  std::vector<double> sub_mass = std::vector<double>(kSubBuckets);
  std::vector<std::pair<float, int64_t>> near;  // the tokens around the cut
};

SPECLANE_CLONES void nucleus_row(const float* row, float* out, int64_t vocab, double top_p, Scratch& s) {
  std::fill(s.mass.begin(), s.mass.end(), 0.0);
  for (int64_t i = 0; i < vocab; ++i) s.mass[bits_of(row[i]) >> kShift] += row[i];
  double above = 0.0;
  const int64_t bucket = reaching(s.mass, top_p, above);
  if (bucket < 0) {  // every token kept
    const float scale = static_cast<float>(1.0 / above);
    for (int64_t i = 0; i < vocab; ++i) out[i] = row[i] * scale;
    return;
  }
  s.near.clear();
  std::fill(s.sub_mass.begin(), s.sub_mass.end(), 0.0);
  for (int64_t i = 0; i < vocab; ++i) {
    const uint32_t bits = bits_of(row[i]);
    if ((bits >> kShift) == static_cast<uint32_t>(bucket)) {
      s.near.emplace_back(row[i], i);
      s.sub_mass[(bits >> kSubShift) & (kSubBuckets - 1)] += row[i];
    }
  }
  double sub_above = above;
  const int64_t sub = reaching(s.sub_mass, top_p, sub_above);
  if (sub >= 0) {  // else the bucket's mass, summed again, rounded under top_p: all of it is sorted
    above = sub_above;
    s.near.erase(std::remove_if(s.near.begin(), s.near.end(), [sub](const auto& token) {
                   return ((bits_of(token.first) >> kSubShift) & (kSubBuckets - 1)) != static_cast<uint32_t>(sub);
                 }),
                 s.near.end());
  }
  std::sort(s.near.begin(), s.near.end(),
            [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
  double kept = above;
  float last_value = s.near.front().first;  // the last kept token: a token is kept if it comes before it or is it
  int64_t last_index = s.near.front().second;
  for (const auto& [value, index] : s.near) {
    if (kept >= top_p) break;
    kept += value;
    last_value = value;
    last_index = index;
  }
  const float scale = static_cast<float>(1.0 / kept);
  for (int64_t i = 0; i < vocab; ++i) {
    const float x = row[i];
    out[i] = x > last_value || (x == last_value && i <= last_index) ? x * scale : 0.0f;
  }
}

}  // namespace

void nucleus(uintptr_t probs, uintptr_t top_p, uintptr_t out, int64_t rows, int64_t vocab, int threads) {
  const float* in = reinterpret_cast<const float*>(probs);
  const float* cut = reinterpret_cast<const float*>(top_p);
  float* result = reinterpret_cast<float*>(out);
#pragma omp parallel num_threads(threads) if (rows > 1)
  {
    Scratch scratch;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      if (cut[r] < 1.0f)
        nucleus_row(in + r * vocab, result + r * vocab, vocab, cut[r], scratch);
      else
        std::memcpy(result + r * vocab, in + r * vocab, vocab * sizeof(float));
    }
  }
}

}  // namespace speclane
