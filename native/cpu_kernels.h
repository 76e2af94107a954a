// Fused bfloat16 kernels for the CPU forward: RMSNorm, residual-add + RMSNorm, RoPE (+ the KV
// store), SiLU-and-mul.
//
// A CPU decode step of a small model at batch 8 spent about as long in ~1,300 tiny torch ops
// (each a dispatch, an allocation, a few hundred elements) as in its projection GEMMs. Each
// kernel here does one of those op chains in one pass over plain pointers.
//
// They reproduce the torch references (constrained_spec/kernels/reference.py) bit for bit: float32
// math, bfloat16 stored (round to nearest even) wherever the reference stores a bfloat16 tensor,
// and, where the result depends on how torch's own CPU kernels work, the same work:
// * the norm's mean is summed in the order of torch's vectorized cascade sum
//   (aten/src/ATen/native/cpu/SumKernel.cpp) at the width of the vectors torch sums with;
// * SiLU's exp is SLEEF's expf_u10 (torch's vectors call it; its scalar tails call std::exp, which
//   gives the same bfloat16 SiLU on every bfloat16 input: tests/test_cpu_kernels.py checks all).
// Built without torch headers: the caller passes pointers, sizes and strides, and validates them.
// Compiled without FMA contraction (setup.py): the float ops must round where the reference's do.
#pragma once

#include <cstdint>

namespace cspec {

// out[r] = bf16(weight * bf16(x[r] * rsqrt(mean(x[r]^2) + eps))); x, weight, out: bfloat16 bits,
// rows of `width` contiguous elements. sum_lanes: the float lanes of torch's sum kernel (4, 8, 16).
void rms_norm_bf16(const uint16_t* x, const uint16_t* weight, uint16_t* out, int64_t rows, int64_t width,
                   float eps, int sum_lanes);

// In place: residual = bf16(residual + x), then x = rms_norm(residual).
void add_rms_norm_bf16(uint16_t* x, uint16_t* residual, const uint16_t* weight, int64_t rows, int64_t width,
                       float eps, int sum_lanes);

// Rotate-half RoPE of q and k (bfloat16, heads of head_dim contiguous elements, tokens `*_row_stride`
// elements apart) with cos/sin from a float32 cache [max_position, head_dim] = cat(cos, sin).
// q is rotated in place. With k_cache (then v, v_cache and slots too) the rotated k and v are
// written to rows slots[t] of the caches [num_slots, num_kv_heads, head_dim] and k is left as it
// is; without, k is rotated in place. Positions and slots are checked before anything is written
// (std::out_of_range).
struct RopeArgs {
  int64_t tokens = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  uint16_t* q = nullptr;
  int64_t q_row_stride = 0;
  uint16_t* k = nullptr;
  int64_t k_row_stride = 0;
  const uint16_t* v = nullptr;
  int64_t v_row_stride = 0;
  const int64_t* positions = nullptr;
  const float* cos_sin_cache = nullptr;
  int64_t max_position = 0;
  uint16_t* k_cache = nullptr;
  uint16_t* v_cache = nullptr;
  const int64_t* slots = nullptr;
  int64_t num_slots = 0;
};
void rope_bf16(const RopeArgs& args);

// Decode attention: one query token per sequence against its context in the KV cache, read where
// it lies (no gather into a padded batch). Sequence b's context is the kv_lens[b] slots
// slot_table[b, :kv_lens[b]] of the caches [num_slots, num_kv_heads, head_dim]; query head h reads
// kv head h / (num_heads / num_kv_heads). softmax(scale * q.k) . v in float32 with the
// probabilities rounded to bfloat16 before they weigh v, as torch's CPU flash attention does:
// close to torch's SDPA, not bit for bit (its dot products run in oneDNN's order). Out: [batch,
// num_heads, head_dim] contiguous. Lengths and slots are checked before anything is written.
// Where the CPU has AVX512-BF16 (and head_dim is a multiple of 32), each (sequence, kv head) pair
// is a task for the OpenMP threads: q.k by `vdpbf16ps` (exact products, float32 sums), the
// softmax's exp on 16 lanes (Cephes' polynomial, ~1 ulp): 2.5 -> 1 ms a SmolLM2 step at batch 8
// and 64 tokens of context on the 2-core dev VM.
//
// CacheAttentionArgs: what decode and tree attention share (the shapes, the query rows, the
// caches and the table).
struct CacheAttentionArgs {
  int64_t batch = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  const uint16_t* q = nullptr;  // [tokens, num_heads, head_dim], heads contiguous within a row
  int64_t q_row_stride = 0;
  const uint16_t* k_cache = nullptr;
  const uint16_t* v_cache = nullptr;
  int64_t num_slots = 0;
  const int64_t* slot_table = nullptr;  // [batch, table_width], rows table_row_stride apart
  int64_t table_width = 0, table_row_stride = 0;
  const int32_t* kv_lens = nullptr;  // [batch], the new tokens included
  float scale = 1.0f;
  uint16_t* out = nullptr;  // [tokens, num_heads, head_dim] contiguous
};

struct DecodeAttentionArgs : CacheAttentionArgs {};  // tokens == batch
void decode_attention_bf16(const DecodeAttentionArgs& args);

// The same attention for sequences of several new tokens (a prefill chunk, or a verify step's
// draft tree): sequence b's new tokens are rows q_starts[b] .. q_starts[b + 1] - 1 of q and out
// and the last q_lens[b] of its kv_lens[b] table columns. Token i sees the columns before them
// and, of the new ones, j where tree_mask[b, i, j] (bool [batch, mask_width, mask_width]), or
// j <= i without a mask; in column order, so a token's output is bit for bit what decode
// attention gives it over the same slots, whatever batch or chunk it came in.
// (native/cpu_attention.cpp)
struct TreeAttentionArgs : CacheAttentionArgs {
  int64_t tokens = 0;
  const int32_t* q_starts = nullptr;  // [batch + 1]
  const int32_t* q_lens = nullptr;    // [batch]
  const uint8_t* tree_mask = nullptr;  // null: causal
  int64_t mask_width = 0;
};
void tree_attention_bf16(const TreeAttentionArgs& args);

// out[r, i] = bf16(bf16(silu(gate[r, i])) * up[r, i]), gate and up the two halves of each
// contiguous row of gate_up [rows, 2 * inter]; out: [rows, inter] contiguous.
void silu_and_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t inter);

}  // namespace cspec
