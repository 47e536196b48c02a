// 16-float vectors for the CPU kernels: one AVX-512 register, two AVX2 ones, four NEON ones. GCC's vector extensions
// lower them for each target that SPECLANE_CLONES compiles, so the kernels hold no intrinsics.
#pragma once

#include <cstdint>

namespace speclane {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

#define SPECLANE_INLINE __attribute__((always_inline)) inline

SPECLANE_INLINE v16 load(const float* p) {
  v16 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

SPECLANE_INLINE void store(float* p, v16 v) { __builtin_memcpy(p, &v, sizeof v); }

SPECLANE_INLINE v16 splat(float x) { return v16{} + x; }

// Sums in a fixed order (halves, then quarters, ...), whatever the target.
SPECLANE_INLINE float lanes_sum(v16 v) {
  const v8 half = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 quarter = __builtin_shufflevector(half, half, 0, 1, 2, 3) + __builtin_shufflevector(half, half, 4, 5, 6, 7);
  return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

SPECLANE_INLINE float lanes_max(v16 v) {
  float most = v[0];
  for (int i = 1; i < 16; ++i) most = most > v[i] ? most : v[i];
  return most;
}

// e^x for x <= 0 (scores minus their maximum): 2^n times Cephes' degree-6 polynomial of the remainder (relative
// error about 2e-7; SDPA's own vectorized exp is of this order).
SPECLANE_INLINE v16 exp_nonpositive(v16 x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  const v16 t = x * 1.44269504f;
  const v16 n = (t + 12582912.0f) - 12582912.0f;  // t rounded to the nearest integer (1.5 x 2^23)
  const v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v16 p = splat(1.9875691e-4f);
  p = p * r + 1.3981999e-3f;
  p = p * r + 8.3334519e-3f;
  p = p * r + 4.1665795e-2f;
  p = p * r + 1.6666665e-1f;
  p = p * r + 5.0000001e-1f;
  p = p * r * r + r + 1.0f;
  const v16i power = (__builtin_convertvector(n, v16i) + 127) << 23;
  v16 two_n;
  __builtin_memcpy(&two_n, &power, sizeof two_n);
  return p * two_n;
}

typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

SPECLANE_INLINE v16 load16(const float* p) { return load(p); }

// bf16 values as uint16_t (the upper half of an fp32) and fp32 ones, read and written alike.
SPECLANE_INLINE v16 load16(const uint16_t* p) {
  u16x16 half;
  __builtin_memcpy(&half, p, sizeof half);
  const u32x16 wide = __builtin_convertvector(half, u32x16) << 16;
  v16 v;
  __builtin_memcpy(&v, &wide, sizeof v);
  return v;
}

SPECLANE_INLINE float to_float(float x) { return x; }

SPECLANE_INLINE float to_float(uint16_t x) {
  const uint32_t wide = static_cast<uint32_t>(x) << 16;
  float f;
  __builtin_memcpy(&f, &wide, sizeof f);
  return f;
}

SPECLANE_INLINE void from_float(float x, float* out) { *out = x; }

SPECLANE_INLINE void from_float(float x, uint16_t* out) {  // rounded to nearest even, as PyTorch rounds
  uint32_t bits;
  __builtin_memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
    *out = static_cast<uint16_t>((bits >> 16) | 0x40);
    return;
  }
  *out = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

SPECLANE_INLINE void store16(float* p, v16 v) { store(p, v); }

SPECLANE_INLINE void store16(uint16_t* p, v16 v) {  // from_float's rounding, 16 at a time
  u32x16 bits;
  __builtin_memcpy(&bits, &v, sizeof bits);
  const u32x16 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const u32x16 kept = (bits & 0x7fffffffu) > 0x7f800000u ? (bits >> 16) | 0x40u : rounded;
  const u16x16 half = __builtin_convertvector(kept, u16x16);
  __builtin_memcpy(p, &half, sizeof half);
}

// Calls f with a value of the element type a kernel's `bf16` flag names (bf16 as uint16_t, else float), so one
// generic body serves both: f reads the type as decltype of its argument.
template <typename F>
SPECLANE_INLINE void by_element_type(bool bf16, F&& f) {
  if (bf16)
    f(uint16_t{});
  else
    f(float{});
}

// Swaps the off-diagonal blocks of every 2 x 2 block of B x B blocks of 16 rows of 16 (two-source shuffles).
template <int B>
SPECLANE_INLINE void swap_blocks(v16 rows[16]) {
#define SPECLANE_LO(j) (((j) & B) ? 16 + (j) - B : (j))
#define SPECLANE_HI(j) (((j) & B) ? 16 + (j) : (j) + B)
#define SPECLANE_LANES(F) F(0), F(1), F(2), F(3), F(4), F(5), F(6), F(7), F(8), F(9), F(10), F(11), F(12), F(13), \
                          F(14), F(15)
  for (int i = 0; i < 16; ++i)
    if (!(i & B)) {
      const v16 top = rows[i], bottom = rows[i + B];
      rows[i] = __builtin_shufflevector(top, bottom, SPECLANE_LANES(SPECLANE_LO));
      rows[i + B] = __builtin_shufflevector(top, bottom, SPECLANE_LANES(SPECLANE_HI));
    }
#undef SPECLANE_LANES
#undef SPECLANE_HI
#undef SPECLANE_LO
}

// After it, rows[j][i] is what rows[i][j] was: four rounds of block swaps, 64 shuffles.
SPECLANE_INLINE void transpose16(v16 rows[16]) {
  swap_blocks<8>(rows);
  swap_blocks<4>(rows);
  swap_blocks<2>(rows);
  swap_blocks<1>(rows);
}

}  // namespace speclane
