// Fused bfloat16 CPU kernels (see cpu_kernels.h for what each does and why they match torch).
//
// Plain loops over lanes and rows that the compiler vectorizes; the entry points are compiled for
// AVX512 and AVX2 (+FMA) besides the baseline and pick one at load time (GCC target_clones). No
// float op is reassociated or contracted (-ffp-contract=off): vectorizing lanes that are already
// independent keeps every rounding where the scalar code has it. (The attention is in
// cpu_attention.cpp.)
#include "cpu_kernels.h"

#include "bf16_util.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>



namespace cspec {
namespace {

using namespace bf16;

// ---------------------------------------------------------------------------------------------
// torch's float sum, addition for addition
// ---------------------------------------------------------------------------------------------

inline int64_t ceil_log2(int64_t x) {  // at::native::utils::CeilLog2
  if (x <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t v = uint64_t(x - 1); v; v >>= 1) ++bits;
  return bits;
}

// SumKernel.cpp's multi_row_sum with its 4 columns: the `size` rows of 4 consecutive groups of W
// lanes are summed column-wise into chunks of level_step rows, whose sums are summed into chunks
// of chunks (4 levels), so that only sums of similar size meet.
template <int W>
void multi_row_sum4(const float* x, int64_t size, float (&out)[4][W]) {
  constexpr int levels = 4;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size) / levels);
  const int64_t level_step = int64_t(1) << level_power;
  const int64_t level_mask = level_step - 1;
  float acc[levels][4][W] = {};
  auto add_row = [&](int64_t i) {
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < W; ++l) acc[0][k][l] += x[(i * 4 + k) * W + l];
  };
  int64_t i = 0;
  while (i + level_step <= size) {
    for (int64_t j = 0; j < level_step; ++j, ++i) add_row(i);
    for (int j = 1; j < levels; ++j) {
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < W; ++l) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0.0f;
        }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i) add_row(i);
  for (int j = 1; j < levels; ++j)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < W; ++l) acc[0][k][l] += acc[j][k][l];
  std::memcpy(out, acc[0], sizeof out);
}

// SumKernel.cpp's row_sum: `count` groups of W lanes as rows of 4 groups (its ilp factor), the
// groups left over added to the first column, then the columns folded into it.
template <int W>
void row_sum(const float* x, int64_t count, float (&out)[W]) {
  const int64_t rows = count / 4;
  float partial[4][W];
  multi_row_sum4<W>(x, rows, partial);
  for (int64_t g = rows * 4; g < count; ++g)
    for (int l = 0; l < W; ++l) partial[0][l] += x[g * W + l];
  for (int k = 1; k < 4; ++k)
    for (int l = 0; l < W; ++l) partial[0][l] += partial[k][l];
  std::memcpy(out, partial[0], sizeof out);
}

// The sum of a contiguous float row as torch's CPU sum computes it (cascade_sum): rows of at least
// W elements go through W-lane vectors (vectorized_inner_sum: the vector sum's lanes are added
// after the scalar tail), shorter ones through the scalar row_sum.
template <int W>
float torch_row_sum(const float* x, int64_t n) {
  if (n < W) {
    float s[1];
    row_sum<1>(x, n, s);
    return s[0];
  }
  const int64_t groups = n / W;
  float lanes[W];
  row_sum<W>(x, groups, lanes);
  float total = 0.0f;
  for (int64_t i = groups * W; i < n; ++i) total += x[i];
  for (int l = 0; l < W; ++l) total += lanes[l];
  return total;
}

float torch_sum(const float* x, int64_t n, int lanes) {
  switch (lanes) {
    case 16: return torch_row_sum<16>(x, n);
    case 8: return torch_row_sum<8>(x, n);
    case 4: return torch_row_sum<4>(x, n);
    default: throw std::invalid_argument("sum_lanes must be 4, 8 or 16, not " + std::to_string(lanes));
  }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm
// ---------------------------------------------------------------------------------------------

// x^2 row by row (float, like x.float().pow(2)), then bf16(weight * bf16(x * rsqrt(mean + eps))).
// `squares` holds one row.
CSPEC_VECTOR_CLONES
void norm_row(const uint16_t* x, const uint16_t* weight, uint16_t* out, int64_t n, float eps, int lanes,
              float* squares) {
  for (int64_t i = 0; i < n; ++i) {
    const float f = bf16_to_float(x[i]);
    squares[i] = f * f;
  }
  const float mean = torch_sum(squares, n, lanes) / float(n);
  const float inv_rms = 1.0f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < n; ++i) {
    const float y = round_bf16(bf16_to_float(x[i]) * inv_rms);
    out[i] = float_to_bf16(bf16_to_float(weight[i]) * y);
  }
}

CSPEC_VECTOR_CLONES
void add_row(uint16_t* residual, const uint16_t* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) residual[i] = float_to_bf16(bf16_to_float(residual[i]) + bf16_to_float(x[i]));
}

// ---------------------------------------------------------------------------------------------
// RoPE
// ---------------------------------------------------------------------------------------------

// One head: out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), rotate_half(x) = cat(-x2, x1);
// cos/sin are the bf16 values of one half (both halves use the same). `out` may be `x`.
CSPEC_VECTOR_CLONES
void rotate_head(const uint16_t* x, uint16_t* out, const float* cos, const float* sin, int64_t half) {
  float first[256], second[256];  // head_dim <= 512 (checked by the caller)
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = bf16_to_float(x[i]), x2 = bf16_to_float(x[i + half]);
    first[i] = round_bf16(x1 * cos[i]) + round_bf16(-x2 * sin[i]);
    second[i] = round_bf16(x2 * cos[i]) + round_bf16(x1 * sin[i]);
  }
  for (int64_t i = 0; i < half; ++i) {
    out[i] = float_to_bf16(first[i]);
    out[i + half] = float_to_bf16(second[i]);
  }
}

// ---------------------------------------------------------------------------------------------
// SiLU
// ---------------------------------------------------------------------------------------------

// bf16(bf16(x / (1 + exp(-x))) * up) over one row.
CSPEC_VECTOR_CLONES
void silu_mul_row(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = bf16_to_float(gate[i]);
    const float silu = round_bf16(g / (1.0f + sleef_expf_u10(-g)));
    out[i] = float_to_bf16(silu * bf16_to_float(up[i]));
  }
}

}  // namespace

// Rows are independent: a prefill's many split between the OpenMP threads (the same bits), a
// decode step's few stay on the calling thread.
constexpr int64_t kParallelRows = 32;

void rms_norm_bf16(const uint16_t* x, const uint16_t* weight, uint16_t* out, int64_t rows, int64_t width,
                   float eps, int sum_lanes) {
#pragma omp parallel if (rows >= kParallelRows)
  {
    std::vector<float> squares(width);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      norm_row(x + r * width, weight, out + r * width, width, eps, sum_lanes, squares.data());
  }
}

void add_rms_norm_bf16(uint16_t* x, uint16_t* residual, const uint16_t* weight, int64_t rows, int64_t width,
                       float eps, int sum_lanes) {
#pragma omp parallel if (rows >= kParallelRows)
  {
    std::vector<float> squares(width);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      uint16_t* res = residual + r * width;
      uint16_t* xr = x + r * width;
      add_row(res, xr, width);
      norm_row(res, weight, xr, width, eps, sum_lanes, squares.data());
    }
  }
}

void rope_bf16(const RopeArgs& a) {
  const int64_t half = a.head_dim / 2;
  if (a.head_dim % 2 != 0 || half > 256) throw std::invalid_argument("head_dim must be even and at most 512");
  check_indices(a.positions, a.tokens, a.max_position, "position");
  if (a.k_cache) check_indices(a.slots, a.tokens, a.num_slots, "slot");
  const int64_t kv_row = a.num_kv_heads * a.head_dim;
  float cos[256], sin[256];
  for (int64_t t = 0; t < a.tokens; ++t) {
    const float* cs = a.cos_sin_cache + a.positions[t] * a.head_dim;
    for (int64_t i = 0; i < half; ++i) {  // the reference casts cos/sin to the activations' dtype
      cos[i] = round_bf16(cs[i]);
      sin[i] = round_bf16(cs[half + i]);
    }
    uint16_t* q = a.q + t * a.q_row_stride;
    for (int64_t h = 0; h < a.num_heads; ++h) rotate_head(q + h * a.head_dim, q + h * a.head_dim, cos, sin, half);
    uint16_t* k = a.k + t * a.k_row_stride;
    if (!a.k_cache) {
      for (int64_t h = 0; h < a.num_kv_heads; ++h)
        rotate_head(k + h * a.head_dim, k + h * a.head_dim, cos, sin, half);
      continue;
    }
    uint16_t* k_out = a.k_cache + a.slots[t] * kv_row;
    for (int64_t h = 0; h < a.num_kv_heads; ++h)
      rotate_head(k + h * a.head_dim, k_out + h * a.head_dim, cos, sin, half);
    std::memcpy(a.v_cache + a.slots[t] * kv_row, a.v + t * a.v_row_stride, kv_row * sizeof(uint16_t));
  }
}

void silu_and_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows >= kParallelRows)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* gate = gate_up + r * 2 * inter;
    silu_mul_row(gate, gate + inter, out + r * inter, inter);
  }
}

}  // namespace cspec
