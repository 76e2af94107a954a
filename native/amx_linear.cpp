#include "amx_linear.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <omp.h>
#include <unistd.h>
#define CSPEC_X86 1
#define CSPEC_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#else
#define CSPEC_X86 0
#endif

namespace cspec {

int64_t amx_packed_size(int64_t n, int64_t k) {
  const int64_t blocks = (n + kPackBlock - 1) / kPackBlock;
  return blocks * kPackBlock * (k + (k & 1));
}

void amx_pack_weight_bf16(const uint16_t* weight, int64_t n, int64_t k, uint16_t* packed) {
  const int64_t pairs = (k + 1) / 2, blocks = (n + kPackBlock - 1) / kPackBlock;
  std::memset(packed, 0, sizeof(uint16_t) * amx_packed_size(n, k));
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t i = 0; i < kPackBlock && b * kPackBlock + i < n; ++i) {
      const uint16_t* row = weight + (b * kPackBlock + i) * k;
      uint16_t* dst = packed + b * pairs * kPackBlock * 2 + i * 2;
      for (int64_t c = 0; c < k; ++c) dst[(c / 2) * kPackBlock * 2 + (c & 1)] = row[c];
    }
}

#if CSPEC_X86
namespace {

// ---- AMX: 16-row tiles; tmm0-3 accumulate four blocks of 16 columns, tmm4 holds x's 32-column
// slice, tmm5-7 the blocks' weights (16 pairs of k by 16 columns each).

constexpr int64_t kTileK = 32;  // bfloat16 columns of x per tile

// GCC does not see the tile instructions touch memory (it dropped the config's stores as dead, and
// may read a stored tile before the store): a compiler barrier on the buffer.
inline void memory_used(void* p) { asm volatile("" : : "r"(p) : "memory"); }

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool request_amx() {
  // Linux hands out AMX's tile state per process on request (arch_prctl ARCH_REQ_XCOMP_PERM, 18 = XTILEDATA).
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

__attribute__((target("amx-tile"))) void configure_tiles(int rows) {
  TileConfig c;
  for (int t = 0; t < 4; ++t) c.rows[t] = rows, c.colsb[t] = 64;  // C: rows x 16 float
  c.rows[4] = rows, c.colsb[4] = 64;                                // A: rows x 32 bf16
  for (int t = 5; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;     // B: 16 pairs x 16 columns x 2
  memory_used(&c);
  _tile_loadconfig(&c);
}

__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

// Where a call's rows go: bfloat16 (rounded once) or float32 (the sum as it is), rows `stride` apart.
struct Output {
  void* data;
  int64_t stride;
  bool float32;
  Output rows_from(int64_t m) const {
    return {static_cast<char*>(data) + m * stride * (float32 ? 4 : 2), stride, float32};
  }
};

// C tile j (of NB) -> out's rows with bias, rounded to bfloat16; `acc` is 16 x 16 floats of scratch.
CSPEC_BF16_TARGET void store_block(const float* acc, int rows, int64_t c0, int64_t n, const uint16_t* bias,
                                   const Output& out) {
  const int64_t valid = std::min<int64_t>(kPackBlock, n - c0);
  const __mmask16 mask = valid >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  __m512 b = _mm512_setzero_ps();
  if (bias)  // bfloat16 -> float32 is a 16-bit shift
    b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + c0)), 16));
  for (int m = 0; m < rows; ++m) {
    const __m512 sum = _mm512_add_ps(_mm512_loadu_ps(acc + m * 16), b);
    if (out.float32)
      _mm512_mask_storeu_ps(static_cast<float*>(out.data) + m * out.stride + c0, mask, sum);
    else
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out.data) + m * out.stride + c0, mask,
                               (__m256i)_mm512_cvtneps_pbh(sum));
  }
}

// Rows [0, rows) of x against NB consecutive packed blocks starting at column `col` (tiles configured for `rows`).
template <int NB>
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16"))) void group_kernel(
    const uint16_t* x, int rows, int64_t x_stride, int64_t k, const uint16_t* blocks, int64_t block_elems,
    int64_t col, int64_t n, const uint16_t* bias, const Output& out) {
  _tile_zero(0);
  if (NB > 1) _tile_zero(1);
  if (NB > 2) _tile_zero(2);
  if (NB > 3) _tile_zero(3);
  const int64_t xs = x_stride * 2;
  for (int64_t k0 = 0; k0 < k; k0 += kTileK) {
    const uint16_t* w = blocks + (k0 / 2) * kPackBlock * 2;
    _tile_loadd(4, x + k0, xs);
    _tile_loadd(5, w, 64);
    if (NB > 1) _tile_loadd(6, w + block_elems, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (NB > 1) _tile_dpbf16ps(1, 4, 6);
    if (NB > 2) {
      _tile_loadd(7, w + 2 * block_elems, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if (NB > 3) {
      _tile_loadd(5, w + 3 * block_elems, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  alignas(64) float acc[16 * 16];
  _tile_stored(0, acc, 64);
  memory_used(acc);
  store_block(acc, rows, col, n, bias, out);
  if (NB > 1) {
    _tile_stored(1, acc, 64);
  memory_used(acc);
    store_block(acc, rows, col + kPackBlock, n, bias, out);
  }
  if (NB > 2) {
    _tile_stored(2, acc, 64);
  memory_used(acc);
    store_block(acc, rows, col + 2 * kPackBlock, n, bias, out);
  }
  if (NB > 3) {
    _tile_stored(3, acc, 64);
  memory_used(acc);
    store_block(acc, rows, col + 3 * kPackBlock, n, bias, out);
  }
}

constexpr int kMaxRows = 16;

// Blocks per column group (at most 4, the accumulator tiles): the largest whose groups split evenly
// between the threads, or leave each thread many (576 columns: 18 groups of 2, not 9 of 4).
int64_t group_blocks(int64_t blocks, int threads) {
  for (int64_t size = 4; size > 1; --size) {
    const int64_t groups = (blocks + size - 1) / size;
    if (groups % threads == 0 || groups >= 16 * threads) return size;
  }
  return 1;
}

}  // namespace

bool amx_linear_supported() {
  __builtin_cpu_init();
  static const bool ok = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("amx-tile") && request_amx();
  return ok;
}

void amx_linear_bf16(const uint16_t* x, int64_t rows, int64_t k, int64_t x_stride, const uint16_t* packed,
                     int64_t n, const uint16_t* bias, void* out, int64_t out_stride, bool out_float32) {
  if (!amx_linear_supported()) throw std::runtime_error("amx_linear_bf16 needs AMX-BF16 (amx_linear_supported)");
  if (k % kTileK != 0) throw std::invalid_argument("amx_linear_bf16: k must be a multiple of 32");
  const int64_t blocks = (n + kPackBlock - 1) / kPackBlock;
  const int64_t per_group = group_blocks(blocks, omp_get_max_threads());
  const int64_t groups = (blocks + per_group - 1) / per_group;
  const int64_t block_elems = (k / 2) * kPackBlock * 2;
  // Column groups split between the threads; a group's weights stay in cache while the rows pass
  // over them 16 at a time. Tile state is per thread: each configures its own and releases it.
#pragma omp parallel
  {
    int configured = 0;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t b = g * per_group;
      const int nb = int(std::min<int64_t>(per_group, blocks - b));
      for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
        const int mr = int(std::min<int64_t>(kMaxRows, rows - m0));
        if (mr != configured) configure_tiles(configured = mr);
        const uint16_t* xm = x + m0 * x_stride;
        const Output om = Output{out, out_stride, out_float32}.rows_from(m0);
        const uint16_t* w = packed + b * block_elems;
        const int64_t col = b * kPackBlock;
        switch (nb) {
          case 4: group_kernel<4>(xm, mr, x_stride, k, w, block_elems, col, n, bias, om); break;
          case 3: group_kernel<3>(xm, mr, x_stride, k, w, block_elems, col, n, bias, om); break;
          case 2: group_kernel<2>(xm, mr, x_stride, k, w, block_elems, col, n, bias, om); break;
          default: group_kernel<1>(xm, mr, x_stride, k, w, block_elems, col, n, bias, om);
        }
      }
    }
    if (configured) release_tiles();
  }
}
#else
bool amx_linear_supported() { return false; }

void amx_linear_bf16(const uint16_t* x, int64_t rows, int64_t k, int64_t x_stride, const uint16_t* packed,
                     int64_t n, const uint16_t* bias, void* out, int64_t out_stride, bool out_float32) {
  (void)x, (void)rows, (void)k, (void)x_stride, (void)packed, (void)n, (void)bias, (void)out, (void)out_stride,
      (void)out_float32;
  throw std::runtime_error("amx_linear_bf16 needs an x86-64 CPU with AMX-BF16");
}
#endif

}  // namespace cspec
