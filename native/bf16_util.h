// bfloat16 helpers shared by the native CPU kernels (internal: not part of any API).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define CSPEC_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CSPEC_VECTOR_CLONES
#endif

namespace cspec {
namespace bf16 {

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

inline void check_indices(const int64_t* index, int64_t n, int64_t bound, const char* what) {
  for (int64_t t = 0; t < n; ++t)
    if (index[t] < 0 || index[t] >= bound)
      throw std::out_of_range(std::string(what) + " " + std::to_string(index[t]) + " out of range [0, " +
                              std::to_string(bound) + ")");
}

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

}  // namespace bf16
}  // namespace cspec
