// Attention of query tokens over their context in the paged KV cache (cpu_kernels.h): decode (one
// token per sequence) and tree / causal (a sequence's several new tokens, each seeing the context
// and its ancestors). Both reduce to one core per query token: the slots it sees, in position
// order, read where they lie. So a verified draft token gets exactly the bits decoding it would
// have: in bfloat16 a speculative engine's greedy text is the plain engine's.
#include <algorithm>
#include <vector>

#include "bf16_util.h"
#include "cpu_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define CSPEC_AVX512 1
#define CSPEC_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#else
#define CSPEC_AVX512 0
#endif

namespace cspec {
namespace {

using namespace bf16;

// What every query token shares: the shapes and the caches.
struct Heads {
  int64_t heads, kv_heads, head_dim;
  const uint16_t* k_cache;
  const uint16_t* v_cache;
  float scale;
  int64_t kv_row() const { return kv_heads * head_dim; }
  int64_t group() const { return heads / kv_heads; }
};

// One query token: its heads, the slots it sees (in position order) and where its output goes.
struct TokenView {
  const uint16_t* q;
  const int64_t* slots;
  int64_t len;
  uint16_t* out;
};

// ---------------------------------------------------------------------------------------------
// Portable path: all heads of a token, each cache row converted to float once.
// ---------------------------------------------------------------------------------------------

// A dot product of float rows: 16 lanes of products summed, folded in halves (GCC vector types,
// so that the fold stays in registers).
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

struct PortableScratch {
  std::vector<float> q, scores, row, acc;
  PortableScratch(const Heads& h, int64_t max_len)
      : q(h.heads * h.head_dim), scores(h.heads * max_len), row(h.kv_row()), acc(h.heads * h.head_dim) {}
};

CSPEC_VECTOR_CLONES
void attend_portable(const Heads& h, const TokenView& t, PortableScratch& s) {
  const int64_t d = h.head_dim, len = t.len, kv_row = h.kv_row(), group = h.group();
  to_float(t.q, s.q.data(), h.heads * d);
  for (int64_t j = 0; j < len; ++j) {
    to_float(h.k_cache + t.slots[j] * kv_row, s.row.data(), kv_row);
    for (int64_t i = 0; i < h.heads; ++i)
      s.scores[i * len + j] = dot(s.q.data() + i * d, s.row.data() + (i / group) * d, d) * h.scale;
  }
  float inv_sum[1024];  // heads <= 1024 (checked)
  for (int64_t i = 0; i < h.heads; ++i) inv_sum[i] = softmax_bf16_weights(s.scores.data() + i * len, len);
  std::fill(s.acc.begin(), s.acc.end(), 0.0f);
  for (int64_t j = 0; j < len; ++j) {
    to_float(h.v_cache + t.slots[j] * kv_row, s.row.data(), kv_row);
    for (int64_t i = 0; i < h.heads; ++i) {
      const float p = s.scores[i * len + j];
      const float* v = s.row.data() + (i / group) * d;
      float* acc = s.acc.data() + i * d;
      for (int64_t e = 0; e < d; ++e) acc[e] = std::fma(p, v[e], acc[e]);
    }
  }
  for (int64_t i = 0; i < h.heads; ++i)
    for (int64_t e = 0; e < d; ++e) t.out[i * d + e] = float_to_bf16(s.acc[i * d + e] * inv_sum[i]);
}

// ---------------------------------------------------------------------------------------------
// AVX512-BF16 path: one kv head's query heads of a token per task, on the OpenMP threads.
// ---------------------------------------------------------------------------------------------

#if CSPEC_AVX512
bool avx512_bf16_here() {
  __builtin_cpu_init();
  static const bool ok = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512dq");
  return ok;
}

CSPEC_AVX512_BF16 inline __m512 load_bf16_as_float(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

CSPEC_AVX512_BF16 inline __mmask16 lanes_left(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
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

// softmax_bf16_weights on 16 lanes at a time.
CSPEC_AVX512_BF16 float softmax_bf16_weights16(float* p, int64_t n) {
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; j += 16) vmax = _mm512_mask_max_ps(vmax, lanes_left(n - j), vmax, _mm512_loadu_ps(p + j));
  const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = lanes_left(n - j);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p + j), max));
    vsum = _mm512_mask_add_ps(vsum, m, vsum, e);
    const __m512 rounded =
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e)), 16));
    _mm512_mask_storeu_ps(p + j, m, rounded);
  }
  return 1.0f / _mm512_reduce_add_ps(vsum);
}

// Query heads [g * group, (g + 1) * group) of token t, all reading kv head g. head_dim a multiple
// of 32 (<= 256), group <= 8 (avx512_fits); scores: group rows of max_len rounded up to 16.
CSPEC_AVX512_BF16 void attend_kv_head(const Heads& h, const TokenView& t, int64_t g, int64_t stride, float* scores,
                                      float* acc) {
  const int64_t d = h.head_dim, len = t.len, group = h.group(), kv_row = h.kv_row(), chunks = d / 32;
  const uint16_t* q = t.q + g * group * d;
  __m512bh qv[8][8];  // [head in group][32-wide chunk]
  for (int64_t i = 0; i < group; ++i)
    for (int64_t c = 0; c < chunks; ++c) qv[i][c] = (__m512bh)_mm512_loadu_si512(q + i * d + c * 32);
  for (int64_t j = 0; j < len; ++j) {
    const uint16_t* k = h.k_cache + t.slots[j] * kv_row + g * d;
    __m512bh kv[8];
    for (int64_t c = 0; c < chunks; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(k + c * 32);
    for (int64_t i = 0; i < group; ++i) {
      __m512 s = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) s = _mm512_dpbf16_ps(s, qv[i][c], kv[c]);
      scores[i * stride + j] = _mm512_reduce_add_ps(s) * h.scale;
    }
  }
  float inv_sum[8];
  for (int64_t i = 0; i < group; ++i) inv_sum[i] = softmax_bf16_weights16(scores + i * stride, len);
  for (int64_t e = 0; e < group * d; e += 16) _mm512_storeu_ps(acc + e, _mm512_setzero_ps());
  for (int64_t j = 0; j < len; ++j) {
    const uint16_t* v = h.v_cache + t.slots[j] * kv_row + g * d;
    for (int64_t c = 0; c < d; c += 16) {
      const __m512 vc = load_bf16_as_float(v + c);
      for (int64_t i = 0; i < group; ++i) {
        float* out = acc + i * d + c;
        _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_set1_ps(scores[i * stride + j]), vc, _mm512_loadu_ps(out)));
      }
    }
  }
  uint16_t* out = t.out + g * group * d;
  for (int64_t i = 0; i < group; ++i) {
    const __m512 inv = _mm512_set1_ps(inv_sum[i]);
    for (int64_t c = 0; c < d; c += 16)
      _mm256_storeu_si256((__m256i*)(out + i * d + c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + i * d + c), inv)));
  }
}

bool avx512_fits(const Heads& h) {
  return avx512_bf16_here() && h.head_dim % 32 == 0 && h.head_dim <= 256 && h.group() <= 8;
}

// Every (token, kv head) pair is a task for the OpenMP threads.
void attend_all_avx512(const Heads& h, const std::vector<TokenView>& views, int64_t max_len) {
  const int64_t tasks = int64_t(views.size()) * h.kv_heads, stride = (max_len + 15) / 16 * 16;
#pragma omp parallel
  {
    std::vector<float> scores(h.group() * stride), acc(h.group() * h.head_dim);
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < tasks; ++task)
      attend_kv_head(h, views[task / h.kv_heads], task % h.kv_heads, stride, scores.data(), acc.data());
  }
}
#else
bool avx512_fits(const Heads&) { return false; }
void attend_all_avx512(const Heads&, const std::vector<TokenView>&, int64_t) {}
#endif

void attend_all(const Heads& h, const std::vector<TokenView>& views) {
  int64_t max_len = 1;
  for (const TokenView& t : views) max_len = std::max(max_len, t.len);
  if (avx512_fits(h)) return attend_all_avx512(h, views, max_len);
  PortableScratch scratch(h, max_len);
  for (const TokenView& t : views) attend_portable(h, t, scratch);
}

void check_heads(int64_t heads, int64_t kv_heads) {
  if (kv_heads <= 0 || heads % kv_heads != 0 || heads > 1024)
    throw std::invalid_argument("num_heads must be a multiple of num_kv_heads, and at most 1024");
}

int64_t checked_len(int64_t len, int64_t table_width) {
  if (len < 1 || len > table_width)
    throw std::out_of_range("kv_len " + std::to_string(len) + " out of range [1, " + std::to_string(table_width) + "]");
  return len;
}

}  // namespace

void decode_attention_bf16(const DecodeAttentionArgs& a) {
  check_heads(a.num_heads, a.num_kv_heads);
  const Heads h{a.num_heads, a.num_kv_heads, a.head_dim, a.k_cache, a.v_cache, a.scale};
  std::vector<TokenView> views(a.batch);
  for (int64_t b = 0; b < a.batch; ++b) {
    const int64_t* slots = a.slot_table + b * a.table_row_stride;
    const int64_t len = checked_len(a.kv_lens[b], a.table_width);
    check_indices(slots, len, a.num_slots, "slot");
    views[b] = {a.q + b * a.q_row_stride, slots, len, a.out + b * a.num_heads * a.head_dim};
  }
  attend_all(h, views);
}

void tree_attention_bf16(const TreeAttentionArgs& a) {
  check_heads(a.num_heads, a.num_kv_heads);
  const Heads h{a.num_heads, a.num_kv_heads, a.head_dim, a.k_cache, a.v_cache, a.scale};
  // Each token's visible slots, gathered once: its sequence's context, then its ancestors (or,
  // without a tree, the new tokens up to itself), in column (position) order.
  std::vector<int64_t> offsets, tokens, visible;
  for (int64_t b = 0; b < a.batch; ++b) {
    const int64_t q_len = a.q_lens[b], kv_len = checked_len(a.kv_lens[b], a.table_width);
    if (q_len < 1 || q_len > kv_len || (a.tree_mask && q_len > a.mask_width) || a.q_starts[b] < 0 ||
        a.q_starts[b + 1] - a.q_starts[b] != q_len || a.q_starts[b + 1] > a.tokens)
      throw std::out_of_range("q_len " + std::to_string(q_len) + " does not fit its sequence");
    const int64_t* row = a.slot_table + b * a.table_row_stride;
    check_indices(row, kv_len, a.num_slots, "slot");
    const int64_t prefix = kv_len - q_len;
    for (int64_t i = 0; i < q_len; ++i) {
      tokens.push_back(a.q_starts[b] + i);
      offsets.push_back(int64_t(visible.size()));
      visible.insert(visible.end(), row, row + prefix);
      const uint8_t* sees = a.tree_mask ? a.tree_mask + (b * a.mask_width + i) * a.mask_width : nullptr;
      for (int64_t j = 0; j < q_len; ++j)
        if (sees ? sees[j] != 0 : j <= i) visible.push_back(row[prefix + j]);
    }
  }
  offsets.push_back(int64_t(visible.size()));
  std::vector<TokenView> views(offsets.size() - 1);
  for (size_t t = 0; t < views.size(); ++t)
    views[t] = {a.q + tokens[t] * a.q_row_stride, visible.data() + offsets[t], offsets[t + 1] - offsets[t],
                a.out + tokens[t] * a.num_heads * a.head_dim};
  for (const TokenView& t : views)
    if (t.len < 1) throw std::out_of_range("a query token sees no slot (its tree mask row is empty)");
  attend_all(h, views);
}

}  // namespace cspec
