// bfloat16 projections (x @ weight.T + bias) on the CPU's AMX tile units.
//
// A CPU decode step of a small model at batch 8 is its projection GEMMs: every weight read once
// per step for 8 multiply-adds each, so the step runs at the speed weights stream from memory.
// oneDNN's prepacked matmul (models/cpu_linear.py) streamed ~19 GB/s of the dev VM's ~27-30 and
// ~15 inside a step; AVX512-BF16's `vdpbf16ps` is compute-bound at 8 rows on it (one per cycle
// per core). This kernel keeps the weight in AMX's pair layout and streams it through
// `tdpbf16ps`, columns split between the process's OpenMP threads (torch's: setup.py says why),
// each thread's column group passed over by the rows 16 at a time while it is in cache.
// On the dev VM (benchmarks/bench_cpu_gemm.py, results/cpu_gemm_floor.md): SmolLM2-135M's 121
// matmuls of a step at 8 rows in 9.7 ms against 14.2 on oneDNN's prepacked weights; in a loop of
// the 120 layer shapes, faster than oneDNN up to ~128 rows and ~7% slower at 320.
//
// Numerics: float32 accumulation, the bias added in float32, one round to bfloat16 (nearest
// even). Each output row depends on its own input row only: a token's projection is the same
// whatever batch it is in. oneDNN gives the same bits for some shapes, not for others (its
// kernels and k order change with the row count).
#pragma once

#include <cstdint>

namespace cspec {

// True where the CPU and the OS run AMX-BF16 (the OS's permission is requested here, once).
bool amx_linear_supported();

// Columns per packed block: one tile of float32 accumulators is 16 wide.
constexpr int64_t kPackBlock = 16;

// Elements (uint16) of the packed form of an [n, k] weight: n rounded up to kPackBlock, k to even.
int64_t amx_packed_size(int64_t n, int64_t k);

// weight [n, k] row-major bfloat16 -> packed[n / 16][k / 2][16][2]: block b, pair p holds
// weight[b*16 + i][2p], weight[b*16 + i][2p + 1] for i < 16 (zeros past n and k).
void amx_pack_weight_bf16(const uint16_t* weight, int64_t n, int64_t k, uint16_t* packed);

// out[m, :n] = bf16(x[m, :k] . weight[:n, :k]^T + bias) for m < rows; x rows x_stride elements
// apart, out rows out_stride apart, bias [n] or null. With out_float32, out is float32 and takes
// the sum unrounded (the logits head: bfloat16 logits tie often, and greedy picks among ties).
// k must be a multiple of 32 (std::invalid_argument); std::runtime_error where
// amx_linear_supported() is false.
void amx_linear_bf16(const uint16_t* x, int64_t rows, int64_t k, int64_t x_stride, const uint16_t* packed,
                     int64_t n, const uint16_t* bias, void* out, int64_t out_stride, bool out_float32 = false);

}  // namespace cspec
