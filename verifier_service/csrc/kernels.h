// The verifier's CPU kernels (fp32 and bf16), bound to Python in module.cc. They take raw pointers to contiguous tensors (the
// checkpoint's weights, the cache, activations the callers make contiguous), so they build without torch's headers. Their threads are PyTorch's own OpenMP team:
// the module links libgomp.so.1 by that name, which the dynamic loader resolves to the copy torch has loaded (a pool
// of their own measured a 32-sequence decode step 1.4x slower: torch's workers spin between its operators, on the
// cores such a pool needs).
#pragma once

#include <cstdint>

#if defined(__x86_64__)
// Wheels built here run on older x86 CPUs too: each kernel is compiled per level and picked at load.
#define SPECLANE_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SPECLANE_CLONES
#endif

namespace speclane {

// Attention of short query segments over the paged KV cache (paged_attention.cc documents the layouts), for the
// head dimensions where `attends` holds.
bool attends(int64_t key_dim, int64_t value_dim);
void attend(uintptr_t query, uintptr_t out, uintptr_t cache, uintptr_t tables, uintptr_t segments,
            int64_t num_segments, int64_t heads, int64_t kv_heads, int64_t key_dim, int64_t value_dim,
            int64_t block_size, int64_t max_blocks, int64_t window, double scale, int threads);

// y [rows, out] = x [rows, in] times weight [out, in] transposed: a pass of a few rows (linear.cc).
void linear(uintptr_t x, uintptr_t weight, uintptr_t y, int64_t rows, int64_t in_features, int64_t out_features,
            int threads);

// Attention of any segments (prompt chunks, chains, trees) in which each query's result depends on its own keys
// and values alone, fp32 or bf16 (invariant_attention.cc documents the layouts).
bool attends_invariantly(int64_t head_dim);
void attend_invariant(uintptr_t query, uintptr_t out, uintptr_t cache, uintptr_t tables, uintptr_t segments,
                      uintptr_t previous, int64_t num_segments, int64_t heads, int64_t kv_heads, int64_t head_dim,
                      int64_t block_size, int64_t max_blocks, double scale, bool bf16, int threads);

// Llama's RMSNorm of each row, fp32 or bf16 (rms_norm.cc).
void rms_norm(uintptr_t x, uintptr_t weight, uintptr_t y, int64_t rows, int64_t hidden, double eps, bool bf16,
              int threads);

// A Llama-form layer's elementwise steps, fp32 or bf16 (fused_layer.cc): the rotary embedding of the queries (in
// place) and keys, stored with the values into the cache; SwiGLU's activation.
void rope_store(uintptr_t query, int64_t query_stride, int64_t heads, uintptr_t key, int64_t key_stride,
                uintptr_t value, int64_t value_stride, int64_t kv_heads, int64_t head_dim, uintptr_t cos,
                uintptr_t sin, uintptr_t cache, uintptr_t slots, int64_t rows, bool bf16, int threads);
void silu_mul(uintptr_t gate_up, uintptr_t out, int64_t rows, int64_t width, bool bf16, int threads);

// Adds x into residual (in place), then y = the RMSNorm of residual, fp32 or bf16 (rms_norm.cc).
void add_rms_norm(uintptr_t x, uintptr_t residual, uintptr_t weight, uintptr_t y, int64_t rows, int64_t hidden,
                  double eps, bool bf16, int threads);

// Each row's argmax as torch.argmax picks it (the first maximum; the first NaN where one is), fp32 or bf16
// (greedy.cc).
void row_argmax(uintptr_t logits, uintptr_t out, int64_t rows, int64_t vocab, int64_t row_stride, bool bf16,
                int threads);

// Top-p's nucleus of each fp32 row of probabilities where top_p < 1, renormalised, found without sorting the row
// (nucleus.cc); rows with top_p >= 1 copied.
void nucleus(uintptr_t probs, uintptr_t top_p, uintptr_t out, int64_t rows, int64_t vocab, int threads);

// A token from each fp32 row of probabilities at the row's uniform, by inverting its cumulative sum (draw.cc).
void draw(uintptr_t probs, int64_t row_stride, uintptr_t uniforms, uintptr_t out, int64_t rows, int64_t vocab,
          int threads);

// bf16 products on Intel AMX that give a row the same bits in any batch, plain or a SwiGLU MLP's gated pair
// (amx_linear.cc: layouts); amx_ready says whether this CPU and kernel let the process use them.
bool amx_ready();
void amx_linear(uintptr_t x, uintptr_t packed, uintptr_t y, int64_t rows, int64_t in_features, int64_t out_features,
                bool gated, int threads);

// bf16 products on CPUs with AVX512-BF16, one order of sums for any rows (bf16_linear.cc: layout, order);
// bf16_linear_ready says whether this CPU has the instructions. bias: 0 for none. wide_rows: the most rows of a
// pass that go in one tile (at most 16; 0 for never); ahead_rows: the rows of a longer pass from which it fetches
// weights ahead into cache, 0 for never. Neither changes the bits.
bool bf16_linear_ready();
void bf16_linear(uintptr_t x, uintptr_t packed, uintptr_t bias, uintptr_t y, int64_t rows, int64_t in_features,
                 int64_t out_features, int64_t block, int64_t wide_rows, int64_t ahead_rows, int threads);

}  // namespace speclane
