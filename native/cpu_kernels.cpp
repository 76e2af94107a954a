// Fused bfloat16 CPU kernels (see cpu_kernels.h for what each does and why they match torch).
//
// Plain loops over lanes and rows that the compiler vectorizes; the entry points are compiled for
// AVX512 and AVX2 (+FMA) besides the baseline and pick one at load time (GCC target_clones). No
// float op is reassociated or contracted (-ffp-contract=off): vectorizing lanes that are already
// independent keeps every rounding where the scalar code has it. The decode attention's AVX-512
// path is written in intrinsics: it matches no torch kernel bit for bit anyway (cpu_kernels.h).
#include "cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define CSPEC_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CSPEC_VECTOR_CLONES
#endif

namespace cspec {
namespace {

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, NaN to a quiet NaN: c10::BFloat16's conversion.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return f != f ? uint16_t(0x7FC0) : uint16_t(rounded);
}

inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

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

void check_indices(const int64_t* index, int64_t n, int64_t bound, const char* what) {
  for (int64_t t = 0; t < n; ++t)
    if (index[t] < 0 || index[t] >= bound)
      throw std::out_of_range(std::string(what) + " " + std::to_string(index[t]) + " out of range [0, " +
                              std::to_string(bound) + ")");
}

// ---------------------------------------------------------------------------------------------
// SiLU
// ---------------------------------------------------------------------------------------------

// SLEEF's expf_u10 (sleefsimdsp.c, xexpf, FMA builds), lane for lane: torch's Vectorized<float>::exp
// on AVX2 and AVX512; unlike std::exp it vectorizes here. Arguments are clamped first (NaN too) so
// that the float -> int conversion stays defined; the clamped ones get SLEEF's 0 / inf / NaN at the
// end.
inline float sleef_expf_u10(float d) {
  const float r_ln2 = 1.442695040888963407359924681001892137426645954152985934135449406931f;
  const float l2u = 0.693145751953125f, l2l = 1.428606765330187045e-06f;
  const float dc = d > -105.0f ? (d < 101.0f ? d : 101.0f) : -105.0f;
  const int32_t q = int32_t(std::rint(dc * r_ln2));
  const float qf = float(q);
  float s = std::fma(qf, -l2u, dc);
  s = std::fma(qf, -l2l, s);
  float u = 0.000198527617612853646278381f;
  u = std::fma(u, s, 0.00139304355252534151077271f);
  u = std::fma(u, s, 0.00833336077630519866943359f);
  u = std::fma(u, s, 0.0416664853692054748535156f);
  u = std::fma(u, s, 0.166666671633720397949219f);
  u = std::fma(u, s, 0.5f);
  u = 1.0f + std::fma(s * s, u, s);
  // u * 2^q as SLEEF's vldexp2: two factors 2^(q/2) and 2^(q - q/2), each a valid float exponent
  const int32_t q1 = q >> 1, q2 = q - q1;
  const uint32_t p1 = uint32_t(q1 + 0x7f) << 23, p2 = uint32_t(q2 + 0x7f) << 23;
  float f1, f2;
  std::memcpy(&f1, &p1, sizeof f1);
  std::memcpy(&f2, &p2, sizeof f2);
  u = u * f1 * f2;
  if (d < -104.0f) u = 0.0f;
  if (d > 100.0f) u = INFINITY;
  if (d != d) u = d;
  return u;
}

// bf16(bf16(x / (1 + exp(-x))) * up) over one row.
CSPEC_VECTOR_CLONES
void silu_mul_row(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = bf16_to_float(gate[i]);
    const float silu = round_bf16(g / (1.0f + sleef_expf_u10(-g)));
    out[i] = float_to_bf16(silu * bf16_to_float(up[i]));
  }
}

// ---------------------------------------------------------------------------------------------
// Decode attention
// ---------------------------------------------------------------------------------------------

// A dot product of float rows: 16 lanes of products summed, folded in halves (GCC vector types,
// so that the fold stays in registers). Its additions are not torch's: there is no reference to
// match bit for bit here.
typedef float Floats16 __attribute__((vector_size(64)));
typedef float Floats8 __attribute__((vector_size(32)));
typedef float Floats4 __attribute__((vector_size(16)));

inline float dot(const float* a, const float* b, int64_t n) {
  Floats16 acc = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    Floats16 x, y;
    std::memcpy(&x, a + i, sizeof x);
    std::memcpy(&y, b + i, sizeof y);
    acc += x * y;
  }
  const Floats8 h8 = __builtin_shufflevector(acc, acc, 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15);
  const Floats4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  float s = (h4[0] + h4[2]) + (h4[1] + h4[3]);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void to_float(const uint16_t* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(x[i]);
}

// In place: p = exp(p - max(p)) over n scores, rounded to bfloat16 (the probabilities torch's
// flash attention multiplies v by); returns 1 / their float sum.
inline float softmax_bf16_weights(float* p, int64_t n) {
  float max = p[0];
#pragma omp simd reduction(max : max)
  for (int64_t j = 1; j < n; ++j) max = p[j] > max ? p[j] : max;
  for (int64_t j = 0; j < n; ++j) p[j] = sleef_expf_u10(p[j] - max);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) sum += p[j];
  for (int64_t j = 0; j < n; ++j) p[j] = round_bf16(p[j]);
  return 1.0f / sum;
}

// Scratch of one sequence: its query heads, their scores over the context, one cache row (all kv
// heads) in float, the weighted sums of v.
struct SequenceScratch {
  std::vector<float> q, scores, row, acc;
  std::vector<int64_t> kv_offset;  // of head h's kv head in a cache row: (h / group) * head_dim
  SequenceScratch(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t max_len)
      : q(heads * head_dim), scores(heads * max_len), row(kv_heads * head_dim), acc(heads * head_dim),
        kv_offset(heads) {
    for (int64_t h = 0; h < heads; ++h) kv_offset[h] = h / (heads / kv_heads) * head_dim;
  }
};

// All query heads of sequence b over its slots: each cache row is read once, for every head.
CSPEC_VECTOR_CLONES
void attend_sequence(const DecodeAttentionArgs& a, int64_t b, SequenceScratch& s) {
  const int64_t d = a.head_dim, len = a.kv_lens[b], heads = a.num_heads, kv_row = a.num_kv_heads * d;
  const int64_t* slots = a.slot_table + b * a.table_row_stride;
  to_float(a.q + b * a.q_row_stride, s.q.data(), heads * d);
  for (int64_t j = 0; j < len; ++j) {
    to_float(a.k_cache + slots[j] * kv_row, s.row.data(), kv_row);
    for (int64_t h = 0; h < heads; ++h)
      s.scores[h * len + j] = dot(s.q.data() + h * d, s.row.data() + s.kv_offset[h], d) * a.scale;
  }
  float inv_sum[1024];  // heads <= 1024 (checked)
  for (int64_t h = 0; h < heads; ++h) inv_sum[h] = softmax_bf16_weights(s.scores.data() + h * len, len);
  std::fill(s.acc.begin(), s.acc.end(), 0.0f);
  for (int64_t j = 0; j < len; ++j) {
    to_float(a.v_cache + slots[j] * kv_row, s.row.data(), kv_row);
    for (int64_t h = 0; h < heads; ++h) {
      const float p = s.scores[h * len + j];
      const float* v = s.row.data() + s.kv_offset[h];
      float* acc = s.acc.data() + h * d;
      for (int64_t i = 0; i < d; ++i) acc[i] = std::fma(p, v[i], acc[i]);
    }
  }
  uint16_t* out = a.out + b * heads * d;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < d; ++i) out[h * d + i] = float_to_bf16(s.acc[h * d + i] * inv_sum[h]);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define CSPEC_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

bool avx512_bf16_here() {
  __builtin_cpu_init();
  static const bool ok = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512dq");
  return ok;
}

CSPEC_AVX512_BF16 inline __m512 load_bf16_as_float(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// exp on 16 floats (Cephes' expf: 2^n * e^r, |r| <= ln2 / 2, a degree-6 polynomial; ~1 ulp).
CSPEC_AVX512_BF16 inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

// The same as softmax_bf16_weights on 16 lanes at a time (n padded to 16 in p's buffer).
CSPEC_AVX512_BF16 float softmax_bf16_weights16(float* p, int64_t n) {
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_loadu_ps(p + j));
  }
  const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p + j), max));
    vsum = _mm512_mask_add_ps(vsum, m, vsum, e);
    const __m512 rounded = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e)), 16));
    _mm512_mask_storeu_ps(p + j, m, rounded);
  }
  return 1.0f / _mm512_reduce_add_ps(vsum);
}

// Query heads [h0, h0 + group) of sequence b, all reading kv head g, over the sequence's slots.
// head_dim a multiple of 32 (<= 256); `scores` holds group rows of the length rounded up to 16.
CSPEC_AVX512_BF16 void attend_kv_head(const DecodeAttentionArgs& a, int64_t b, int64_t g, float* scores,
                                      float* acc) {
  const int64_t d = a.head_dim, len = a.kv_lens[b], group = a.num_heads / a.num_kv_heads, h0 = g * group;
  const int64_t kv_row = a.num_kv_heads * d, stride = (len + 15) / 16 * 16, chunks = d / 32;
  const int64_t* slots = a.slot_table + b * a.table_row_stride;
  const uint16_t* q = a.q + b * a.q_row_stride + h0 * d;
  __m512bh qv[8][8];  // [head in group][32-wide chunk]; group <= 8 and d <= 256 (checked)
  for (int64_t h = 0; h < group; ++h)
    for (int64_t c = 0; c < chunks; ++c) qv[h][c] = (__m512bh)_mm512_loadu_si512(q + h * d + c * 32);
  for (int64_t j = 0; j < len; ++j) {
    const uint16_t* k = a.k_cache + slots[j] * kv_row + g * d;
    __m512bh kv[8];
    for (int64_t c = 0; c < chunks; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(k + c * 32);
    for (int64_t h = 0; h < group; ++h) {
      __m512 s = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) s = _mm512_dpbf16_ps(s, qv[h][c], kv[c]);
      scores[h * stride + j] = _mm512_reduce_add_ps(s) * a.scale;
    }
  }
  float inv_sum[8];
  for (int64_t h = 0; h < group; ++h) inv_sum[h] = softmax_bf16_weights16(scores + h * stride, len);
  for (int64_t i = 0; i < group * d; i += 16) _mm512_storeu_ps(acc + i, _mm512_setzero_ps());
  for (int64_t j = 0; j < len; ++j) {
    const uint16_t* v = a.v_cache + slots[j] * kv_row + g * d;
    for (int64_t c = 0; c < d; c += 16) {
      const __m512 vc = load_bf16_as_float(v + c);
      for (int64_t h = 0; h < group; ++h) {
        float* out = acc + h * d + c;
        _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_set1_ps(scores[h * stride + j]), vc, _mm512_loadu_ps(out)));
      }
    }
  }
  uint16_t* out = a.out + (b * a.num_heads + h0) * d;
  for (int64_t h = 0; h < group; ++h) {
    const __m512 inv = _mm512_set1_ps(inv_sum[h]);
    for (int64_t c = 0; c < d; c += 16)
      _mm256_storeu_si256((__m256i*)(out + h * d + c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + h * d + c), inv)));
  }
}

// Every (sequence, kv head) pair is a task for the OpenMP threads.
void decode_attention_avx512(const DecodeAttentionArgs& a, int64_t max_len) {
  const int64_t tasks = a.batch * a.num_kv_heads, group = a.num_heads / a.num_kv_heads;
  const int64_t stride = (max_len + 15) / 16 * 16;
#pragma omp parallel
  {
    std::vector<float> scores(group * stride), acc(group * a.head_dim);
#pragma omp for schedule(dynamic)
    for (int64_t t = 0; t < tasks; ++t)
      attend_kv_head(a, t / a.num_kv_heads, t % a.num_kv_heads, scores.data(), acc.data());
  }
}

bool avx512_attention_fits(const DecodeAttentionArgs& a) {
  const int64_t group = a.num_heads / a.num_kv_heads;
  return avx512_bf16_here() && a.head_dim % 32 == 0 && a.head_dim <= 256 && group <= 8;
}
#else
bool avx512_attention_fits(const DecodeAttentionArgs&) { return false; }
void decode_attention_avx512(const DecodeAttentionArgs&, int64_t) {}
#endif

}  // namespace

void decode_attention_bf16(const DecodeAttentionArgs& a) {
  if (a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads != 0 || a.num_heads > 1024)
    throw std::invalid_argument("num_heads must be a multiple of num_kv_heads, and at most 1024");
  int64_t max_len = 0;
  for (int64_t b = 0; b < a.batch; ++b) {
    const int64_t len = a.kv_lens[b];
    if (len < 1 || len > a.table_width)
      throw std::out_of_range("kv_len " + std::to_string(len) + " out of range [1, " + std::to_string(a.table_width) +
                              "]");
    check_indices(a.slot_table + b * a.table_row_stride, len, a.num_slots, "slot");
    max_len = std::max(max_len, len);
  }
  if (avx512_attention_fits(a)) return decode_attention_avx512(a, max_len);
  SequenceScratch scratch(a.num_heads, a.num_kv_heads, a.head_dim, max_len);
  for (int64_t b = 0; b < a.batch; ++b) attend_sequence(a, b, scratch);
}

void rms_norm_bf16(const uint16_t* x, const uint16_t* weight, uint16_t* out, int64_t rows, int64_t width,
                   float eps, int sum_lanes) {
  std::vector<float> squares(width);
  for (int64_t r = 0; r < rows; ++r)
    norm_row(x + r * width, weight, out + r * width, width, eps, sum_lanes, squares.data());
}

void add_rms_norm_bf16(uint16_t* x, uint16_t* residual, const uint16_t* weight, int64_t rows, int64_t width,
                       float eps, int sum_lanes) {
  std::vector<float> squares(width);
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* res = residual + r * width;
    uint16_t* xr = x + r * width;
    add_row(res, xr, width);
    norm_row(res, weight, xr, width, eps, sum_lanes, squares.data());
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
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* gate = gate_up + r * 2 * inter;
    silu_mul_row(gate, gate + inter, out + r * inter, inter);
  }
}

}  // namespace cspec
