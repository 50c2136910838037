// Integer dot products for GGUF block weights: y[M, N] = q8(x)[M, K] @ W, llama.cpp's arithmetic.
//
// Why: the exact kernel (skinny_matmul.cc) dequantizes every weight to float32 and multiplies
// in float, ~13 vector instructions per 32 weights and row; on a 2-core host that keeps a decode
// step compute-bound at ~5 GB/s of 4-bit weights (benchmarks/RESULTS.md). llama.cpp instead
// quantizes each matmul's input row to 8 bits per 32 values (Q8_0 / Q8_1: one float scale per
// block) and multiplies the 4-/8-bit weights with integer dot-product instructions, ~10
// instructions per 128 weights and row. This file does the same, as an opt-in mode
// (``sj.load_model(..., activations="int8")``): the outputs differ from the float32 path by the
// activation rounding (~0.4% of a block's largest input), so greedy text can differ from the
// exact path; decode and verify still see bit-identical rows (a row's result never depends on
// the other rows in the call), so speculative decoding stays lossless w.r.t. this arithmetic.
//
// Weights (``specjax.native.q8_layout``): the GGUF blocks of a row rearranged, same bytes, as
//   Q4_0: [nibbles B*16][d B*2]   Q4_1: [nibbles B*16][d B*2][m B*2]   Q8_0: [int8 B*32][d B*2]
//   Q5_0: [nibbles B*16][d B*2][qh B*4]   Q4_K, Q6_K: the file's 256-weight super-blocks as
//   they are (OutputsK says how they are read)
// for B = K / 32 blocks (nibble byte j of a block holds weights j (low) and j + 16 (high)).
// Inputs: each row's 32-value block b is quantized as llama.cpp's quantize_row_q8_0 / q8_1 do:
// dx = max|x| / 127, q = round-to-nearest-even(x / dx) (0 where dx = 0), plus sx = dx * sum(q)
// for Q4_1 / Q4_K; then per block  y += (d * dx) * sum_j w_j q_j  (+ m * sx for Q4_1), the
// integer sums exact; the K-quants the same per sub-block (sub-block scale d * sc, Q4_K's min
// - dmin * m * sx; 32-value input blocks, where llama.cpp's Q8_K uses 256). Blocks go in groups
// of 4 (128 weights: one 512-bit register of nibbles), super-blocks one at a time.
//
// Paths: AVX-512 VNNI (vpdpbusd: u8 x s8 -> s32), AVX2 (vpmaddubsw + vpmaddwd; Q5_0 and the
// K-quants take the portable loops there), portable C++.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "common.h"

namespace ffi = xla::ffi;

namespace {

enum Q8Type { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2, kQ5_0 = 3, kQ4_K = 4, kQ6_K = 5 };
// kQs: weight bytes per 32-weight block (32-weight types); kBytes: bytes per block with its
// scales; kW: weights per block along K (32, or 256 for the K-quant super-blocks)
template <int Q> struct Q8Info;
template <> struct Q8Info<kQ4_0> { static constexpr int kQs = 16, kBytes = 18, kW = 32; };
template <> struct Q8Info<kQ4_1> { static constexpr int kQs = 16, kBytes = 20, kW = 32; };
template <> struct Q8Info<kQ8_0> { static constexpr int kQs = 32, kBytes = 34, kW = 32; };
template <> struct Q8Info<kQ5_0> { static constexpr int kQs = 16, kBytes = 22, kW = 32; };
template <> struct Q8Info<kQ4_K> { static constexpr int kQs = 128, kBytes = 144, kW = 256; };
template <> struct Q8Info<kQ6_K> { static constexpr int kQs = 192, kBytes = 210, kW = 256; };
constexpr bool IsK(int q) { return q == kQ4_K || q == kQ6_K; }
constexpr int kGroup = 4;                // blocks per group (128 weights)
constexpr int kRows = 8;                 // input rows per register block
constexpr int kLanes = 32;               // int32 lanes of per-lane corrections per group

// (-DSPECJAX_Q8_PORTABLE forces the portable path: tests check it on any host)
#if defined(SPECJAX_Q8_PORTABLE)
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define SPECJAX_Q8_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPECJAX_Q8_AVX2 1
#endif

inline float Half(const uint8_t* p) {  // a little-endian IEEE half at p -> float (exact)
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return specjax::HalfToFloat(h);
}

// One input row, quantized and laid out for group g of 4 blocks:
//   xq[g*128 ..]: Q4 types: [low-nibble partners: block i values 0..15 at 16i][high: 16..31];
//                 Q8_0: the 4 blocks' 32 values in order.
//   dx[g*4 + i]: block scales (0 past the last block); sx[b]: dx_b * sum(q_b) (Q4_1's min term,
//   padded to a multiple of 16 with 0); corr[g*32 + l]: the integer offsets that turn the
//   unsigned-weight dot of lane l into the signed one (-8 * lane sum for Q4_0, -128 * lane sum
//   for Q8_0's sign-flipped weights; lanes 0..15 the first register of the group, 16..31 the
//   second).
struct XRow {
  const int8_t* xq;
  const float* dx;
  const float* sx;
  const int32_t* corr;
};

template <int Q>
void QuantizeRow(const float* x, int64_t K, int8_t* xq, float* dx, float* sx, int32_t* corr) {
  const int64_t B = K / 32, G = (B + kGroup - 1) / kGroup;
  std::memset(xq, 0, G * 128);
  std::memset(dx, 0, G * kGroup * sizeof(float));
  std::memset(corr, 0, G * kLanes * sizeof(int32_t));
  for (int64_t b = 0; b < B; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    int8_t q[32];
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      q[j] = static_cast<int8_t>(std::nearbyint(xb[j] * id));
      sum += q[j];
    }
    const int64_t g = b / kGroup, i = b % kGroup;
    dx[b] = d;
    sx[b] = d * static_cast<float>(sum);
    int8_t* out = xq + g * 128;
    if (Q == kQ8_0 || Q == kQ6_K) {  // natural order
      std::memcpy(out + 32 * i, q, 32);
      const int off = Q == kQ8_0 ? 128 : 32;  // sign flip of Q8_0's weights; Q6_K's q - 32
      for (int j = 0; j < 32; ++j) corr[g * kLanes + (32 * i + j) / 4] -= off * q[j];
    } else if (Q == kQ4_K) {
      // super-block s = b / 8, sub-block j = b % 8 goes to slot (j & 4) + 2 (j & 1) + (j >> 1 & 1)
      // of the super-block's 256 values: [0 2][1 3][4 6][5 7], the sub-blocks under the low and
      // high nibbles of each 64-byte half of the weights' qs
      const int64_t j = b % 8;
      std::memcpy(xq + (b - j) * 32 + 32 * ((j & 4) + 2 * (j & 1) + ((j >> 1) & 1)), q, 32);
    } else {
      std::memcpy(out + 16 * i, q, 16);
      std::memcpy(out + 64 + 16 * i, q + 16, 16);
      if (Q == kQ4_0 || Q == kQ5_0)
        for (int j = 0; j < 16; ++j)
          corr[g * kLanes + (16 * i + j) / 4] -= (Q == kQ4_0 ? 8 : 16) * (q[j] + q[16 + j]);
    }
  }
  for (int64_t b = B; b < (B + 15) / 16 * 16; ++b) sx[b] = 0.f;
}

// The 6-bit scales and mins of a Q4_K super-block (12 bytes) -> sc[0..7], m[0..7] as bytes of
// u[0..1] and u[2..3] (llama.cpp's get_scale_min_k4, four words at a time).
inline void Q4KScales(const uint8_t* p, uint32_t u[4]) {
  constexpr uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
  std::memcpy(u, p, 12);
  u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
  const uint32_t m03 = u[1] & k1;
  u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
  u[2] = m03;
  u[0] &= k1;
}

#if defined(SPECJAX_Q8_AVX512)
inline float Reduce(__m512 v) { return _mm512_reduce_add_ps(v); }

// Outputs n .. n + NR - 1 for M rows.
template <int Q, int M, int NR>
inline void Outputs(const uint8_t* __restrict wq, const XRow* xr, float* __restrict y,
                    int64_t K, int64_t N, int64_t n) {
  constexpr int kQs = Q8Info<Q>::kQs, kB = Q8Info<Q>::kBytes;
  const int64_t B = K / 32, G = (B + kGroup - 1) / kGroup, rb = B * kB;
  const __m512i low = _mm512_set1_epi8(15), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  // lane l of a register -> block l / 4 (Q4: one register per group) or l / 8 (Q8_0: two)
  const __m512i by4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i by8a = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i by8b = _mm512_add_epi32(by8a, _mm512_set1_epi32(2));
  __m512 acc[NR][M];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int nb = static_cast<int>(std::min<int64_t>(kGroup, B - g * kGroup));
    for (int r = 0; r < NR; ++r) {
      const uint8_t* row = wq + (n + r) * rb;
      const uint8_t* qs = row + g * kGroup * kQs;
      const __m128 dw = _mm_cvtph_ps(_mm_maskz_loadu_epi16(
          static_cast<__mmask8>((1u << nb) - 1), row + B * kQs + g * kGroup * 2));
      if (Q == kQ8_0) {
        const int n0 = std::min(nb, 2) * 32, n1 = std::max(nb - 2, 0) * 32;
        const __m512i w0 = _mm512_xor_si512(
            _mm512_maskz_loadu_epi8(n0 == 64 ? ~0ull : (1ull << n0) - 1, qs), flip);
        const __m512i w1 = _mm512_xor_si512(
            _mm512_maskz_loadu_epi8(n1 == 64 ? ~0ull : (1ull << n1) - 1, qs + 64), flip);
        for (int m = 0; m < M; ++m) {
          const int8_t* xq = xr[m].xq + g * 128;
          const int32_t* c = xr[m].corr + g * kLanes;
          const __m512i i0 = _mm512_dpbusd_epi32(_mm512_loadu_si512(c), w0, _mm512_loadu_si512(xq));
          const __m512i i1 =
              _mm512_dpbusd_epi32(_mm512_loadu_si512(c + 16), w1, _mm512_loadu_si512(xq + 64));
          const __m512 sc = _mm512_castps128_ps512(_mm_mul_ps(dw, _mm_loadu_ps(xr[m].dx + g * 4)));
          acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_permutexvar_ps(by8a, sc), acc[r][m]);
          acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_permutexvar_ps(by8b, sc), acc[r][m]);
        }
      } else {
        const int nq = nb * 16;
        const __m512i q = _mm512_maskz_loadu_epi8(nq == 64 ? ~0ull : (1ull << nq) - 1, qs);
        __m512i lo = _mm512_and_si512(q, low);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
        if (Q == kQ5_0) {  // the fifth bits: qh bit j of block i -> byte 16 i + j of lo / hi
          uint32_t h[kGroup] = {0, 0, 0, 0};
          std::memcpy(h, row + B * (kQs + 2) + g * kGroup * 4, 4 * nb);
          uint64_t mlo = 0, mhi = 0;
          for (int i = 0; i < kGroup; ++i) {
            mlo |= static_cast<uint64_t>(h[i] & 0xffffu) << (16 * i);
            mhi |= static_cast<uint64_t>(h[i] >> 16) << (16 * i);
          }
          const __m512i bit4 = _mm512_set1_epi8(16);
          lo = _mm512_mask_blend_epi8(mlo, lo, _mm512_or_si512(lo, bit4));
          hi = _mm512_mask_blend_epi8(mhi, hi, _mm512_or_si512(hi, bit4));
        }
        for (int m = 0; m < M; ++m) {
          const int8_t* xq = xr[m].xq + g * 128;
          const __m512i init = Q != kQ4_1 ? _mm512_loadu_si512(xr[m].corr + g * kLanes)
                                          : _mm512_setzero_si512();
          __m512i i = _mm512_dpbusd_epi32(init, lo, _mm512_loadu_si512(xq));
          i = _mm512_dpbusd_epi32(i, hi, _mm512_loadu_si512(xq + 64));
          const __m512 sc = _mm512_castps128_ps512(_mm_mul_ps(dw, _mm_loadu_ps(xr[m].dx + g * 4)));
          acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_permutexvar_ps(by4, sc), acc[r][m]);
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    __m512 mins[M];
    for (int m = 0; m < M; ++m) mins[m] = _mm512_setzero_ps();
    if (Q == kQ4_1) {  // + sum_b m_b * sx_b, 16 blocks at a time
      const uint8_t* mw = wq + (n + r) * rb + B * (kQs + 2);
      for (int64_t b = 0; b < B; b += 16) {
        const int k = static_cast<int>(std::min<int64_t>(16, B - b));
        const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
            static_cast<__mmask16>((1u << k) - 1), mw + 2 * b));
        for (int m = 0; m < M; ++m) mins[m] = _mm512_fmadd_ps(mv, _mm512_loadu_ps(xr[m].sx + b), mins[m]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * N + n + r] = Reduce(acc[r][m]) + Reduce(mins[m]);
  }
}

// Q4_K / Q6_K: outputs n .. n + NR - 1 for M rows, one 256-weight super-block at a time.
//   Q4_K [d][dmin][scales 12][qs 128]: w = d sc_j q - dmin m_j over sub-blocks j of 32; the
//     low / high nibbles of qs bytes 0..63 are sub-blocks 0, 2 / 1, 3 (the inputs were laid out
//     to match, QuantizeRow), bytes 64..127 sub-blocks 4, 6 / 5, 7.
//   Q6_K [ql 128][qh 64][scales 16 int8][d]: w = d sc_i (q - 32) over sub-blocks i of 16; per
//     half h of 128 weights, q = nibble of ql[64 h ..] | 2 bits of qh[32 h ..] << 4, the low
//     nibbles weights 0..63 of the half and the high ones 64..127, inputs in natural order.
template <int Q, int M, int NR>
inline void OutputsK(const uint8_t* __restrict wq, const XRow* xr, float* __restrict y,
                     int64_t K, int64_t N, int64_t n) {
  constexpr int kB = Q8Info<Q>::kBytes;
  const int64_t S = K / 256, rb = S * kB;
  const __m512i low = _mm512_set1_epi8(15), three = _mm512_set1_epi8(3);
  // lane l of a register -> its scale: Q4_K sub-blocks of the four registers (8 lanes each)
  const __m512i k4[4] = {
      _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2),
      _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3),
      _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6),
      _mm512_setr_epi32(5, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7)};
  const __m512i dx16 = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i by4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i k6[4] = {by4, _mm512_add_epi32(by4, _mm512_set1_epi32(4)),  // Q6_K register t:
                         _mm512_add_epi32(by4, _mm512_set1_epi32(8)),       // sub-blocks 4 t ..
                         _mm512_add_epi32(by4, _mm512_set1_epi32(12))};
  const __m512i sh_lo = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);  // Q6_K: qh bit pairs
  const __m512i sh_hi = _mm512_setr_epi64(4, 4, 4, 4, 6, 6, 6, 6);
  __m512 acc[NR][M];
  __m256 mins[NR][M];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps(), mins[r][m] = _mm256_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    for (int r = 0; r < NR; ++r) {
      const uint8_t* blk = wq + (n + r) * rb + s * kB;
      if (Q == kQ4_K) {
        uint32_t u[4];
        Q4KScales(blk + 4, u);
        const __m256 d = _mm256_set1_ps(Half(blk)), dmin = _mm256_set1_ps(Half(blk + 2));
        const __m256 sc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(u)))));
        const __m256 mn = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(u + 2)))));
        const __m512i q0 = _mm512_loadu_si512(blk + 16), q1 = _mm512_loadu_si512(blk + 80);
        const __m512i w[4] = {_mm512_and_si512(q0, low),
                              _mm512_and_si512(_mm512_srli_epi16(q0, 4), low),
                              _mm512_and_si512(q1, low),
                              _mm512_and_si512(_mm512_srli_epi16(q1, 4), low)};
        for (int m = 0; m < M; ++m) {
          const int8_t* xq = xr[m].xq + s * 256;
          const __m512 p = _mm512_castps256_ps512(_mm256_mul_ps(sc, _mm256_loadu_ps(xr[m].dx + 8 * s)));
          for (int t = 0; t < 4; ++t) {
            const __m512i i = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[t],
                                                  _mm512_loadu_si512(xq + 64 * t));
            acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_permutexvar_ps(k4[t], p),
                                        acc[r][m]);
          }
          mins[r][m] = _mm256_fmadd_ps(mn, _mm256_loadu_ps(xr[m].sx + 8 * s), mins[r][m]);
        }
      } else {  // Q6_K
        const __m512 sc = _mm512_mul_ps(_mm512_set1_ps(Half(blk + 208)), _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)))));
        __m512i w[4];
        for (int h = 0; h < 2; ++h) {
          const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
          const __m512i qh = _mm512_broadcast_i64x4(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h)));
          const __m512i hl = _mm512_and_si512(_mm512_srlv_epi64(qh, sh_lo), three);
          const __m512i hh = _mm512_and_si512(_mm512_srlv_epi64(qh, sh_hi), three);
          w[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low), _mm512_slli_epi16(hl, 4));
          w[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low),
                                         _mm512_slli_epi16(hh, 4));
        }
        for (int m = 0; m < M; ++m) {
          const int8_t* xq = xr[m].xq + s * 256;
          const int32_t* c = xr[m].corr + s * 64;
          const __m512 p = _mm512_mul_ps(sc, _mm512_permutexvar_ps(
              dx16, _mm512_castps256_ps512(_mm256_loadu_ps(xr[m].dx + 8 * s))));
          for (int t = 0; t < 4; ++t) {  // register t: weights 64 t .. 64 t + 63
            const __m512i i = _mm512_dpbusd_epi32(_mm512_loadu_si512(c + 16 * t), w[t],
                                                  _mm512_loadu_si512(xq + 64 * t));
            acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_permutexvar_ps(k6[t], p),
                                        acc[r][m]);
          }
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < M; ++m) {
      const __m256 v = mins[r][m];
      const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
      y[m * N + n + r] = Reduce(acc[r][m]) - _mm_cvtss_f32(_mm_hadd_ps(_mm_hadd_ps(h, h), _mm_hadd_ps(h, h)));
    }
}

#else  // AVX2 or portable: one block at a time, the same integer sums

#if defined(SPECJAX_Q8_AVX2)
inline int32_t HSum8(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1)));
}
#endif

// sum_j w_j q_j of block b of a row (the signed weights: nibble - 8 for Q4_0, nibble for Q4_1)
template <int Q>
inline int32_t BlockDot(const uint8_t* qs, const int8_t* xlo, const int8_t* xhi) {
#if defined(SPECJAX_Q8_AVX2)
  const __m256i ones = _mm256_set1_epi16(1);
  if (Q == kQ8_0) {  // |w| x sign(q, w): vpmaddubsw takes unsigned x signed
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xlo));
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(q, w));
    return HSum8(_mm256_madd_epi16(p, ones));
  }
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i nib = _mm256_and_si256(
      _mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(15));
  const __m256i x = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xhi)),
                                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(xlo)));
  int32_t s = HSum8(_mm256_madd_epi16(_mm256_maddubs_epi16(nib, x), ones));
  if (Q == kQ4_0) {
    const __m256i sx = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), x), ones);
    s -= 8 * HSum8(sx);
  }
  return s;
#else
  int32_t s = 0;
  if (Q == kQ8_0) {
    const int8_t* w = reinterpret_cast<const int8_t*>(qs);
    for (int j = 0; j < 32; ++j) s += w[j] * xlo[j];
    return s;
  }
  const int off = Q == kQ4_0 ? 8 : 0;
  for (int j = 0; j < 16; ++j)
    s += ((qs[j] & 15) - off) * xlo[j] + ((qs[j] >> 4) - off) * xhi[j];
  return s;
#endif
}

// sum_j w_j q_j of a Q5_0 block: w = (nibble | qh bit j << 4) - 16
inline int32_t Q5Dot(const uint8_t* qs, const uint8_t* qh, const int8_t* xlo, const int8_t* xhi) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  int32_t s = 0;
  for (int j = 0; j < 16; ++j)
    s += ((qs[j] & 15) + static_cast<int>((h >> j) & 1) * 16 - 16) * xlo[j] +
         ((qs[j] >> 4) + static_cast<int>((h >> (16 + j)) & 1) * 16 - 16) * xhi[j];
  return s;
}

// Q4_K / Q6_K (layouts as in the AVX-512 OutputsK), one sub-block at a time.
template <int Q, int M, int NR>
inline void OutputsK(const uint8_t* __restrict wq, const XRow* xr, float* __restrict y,
                     int64_t K, int64_t N, int64_t n) {
  constexpr int kB = Q8Info<Q>::kBytes;
  const int64_t S = K / 256, rb = S * kB;
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < M; ++m) {
      float acc = 0.f, mins = 0.f;
      for (int64_t s = 0; s < S; ++s) {
        const uint8_t* blk = wq + (n + r) * rb + s * kB;
        const int8_t* xq = xr[m].xq + s * 256;
        const float* dx = xr[m].dx + 8 * s;
        if (Q == kQ4_K) {
          uint32_t u[4];
          Q4KScales(blk + 4, u);
          const uint8_t* sc = reinterpret_cast<const uint8_t*>(u);
          const float d = Half(blk), dmin = Half(blk + 2);
          for (int j = 0; j < 8; ++j) {  // sub-block j: nibbles of qs bytes 32 (j / 2) ..
            const uint8_t* qs = blk + 16 + 32 * (j / 2);
            const int8_t* x = xq + 32 * ((j & 4) + 2 * (j & 1) + ((j >> 1) & 1));
            int32_t t = 0;
            for (int l = 0; l < 32; ++l) t += ((j & 1) ? qs[l] >> 4 : qs[l] & 15) * x[l];
            acc += d * static_cast<float>(sc[j]) * dx[j] * static_cast<float>(t);
            mins += dmin * static_cast<float>(sc[8 + j]) * xr[m].sx[8 * s + j];
          }
        } else {  // Q6_K
          const float d = Half(blk + 208);
          const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
          for (int i = 0; i < 16; ++i) {  // sub-block i: weights 16 i .. 16 i + 15
            int32_t t = 0;
            for (int l = 0; l < 16; ++l) {
              const int w = 16 * i + l, h = w / 128, b = w % 128;  // half, byte in the half
              const uint8_t ql = blk[64 * h + b % 64], qh = blk[128 + 32 * h + b % 32];
              const int q = (b < 64 ? ql & 15 : ql >> 4) | (((qh >> (2 * (b / 32))) & 3) << 4);
              t += (q - 32) * xq[w];
            }
            acc += d * static_cast<float>(sc[i]) * dx[i / 2] * static_cast<float>(t);
          }
        }
      }
      y[m * N + n + r] = acc - mins;
    }
}

template <int Q, int M, int NR>
inline void Outputs(const uint8_t* __restrict wq, const XRow* xr, float* __restrict y,
                    int64_t K, int64_t N, int64_t n) {
  constexpr int kQs = Q8Info<Q>::kQs, kB = Q8Info<Q>::kBytes;
  const int64_t B = K / 32, rb = B * kB;
  for (int r = 0; r < NR; ++r) {
    const uint8_t* row = wq + (n + r) * rb;
    for (int m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < B; ++b) {
        const int8_t* xq = xr[m].xq + (b / kGroup) * 128;
        const int i = static_cast<int>(b % kGroup);
        const int32_t s =
            Q == kQ8_0   ? BlockDot<Q>(row + b * 32, xq + 32 * i, nullptr)
            : Q == kQ5_0 ? Q5Dot(row + b * 16, row + B * (kQs + 2) + 4 * b, xq + 16 * i,
                                 xq + 64 + 16 * i)
                         : BlockDot<Q>(row + b * 16, xq + 16 * i, xq + 64 + 16 * i);
        acc += Half(row + B * kQs + 2 * b) * xr[m].dx[b] * static_cast<float>(s);
        if (Q == kQ4_1) acc += Half(row + B * (kQs + 2) + 2 * b) * xr[m].sx[b];
      }
      y[m * N + n + r] = acc;
    }
  }
}
#endif

template <int Q, int M, int NR>
inline void Out(const uint8_t* wq, const XRow* xr, float* y, int64_t K, int64_t N, int64_t n) {
  if constexpr (IsK(Q)) OutputsK<Q, M, NR>(wq, xr, y, K, N, n);
  else Outputs<Q, M, NR>(wq, xr, y, K, N, n);
}

template <int Q>
void Group(int rows, const uint8_t* wq, const XRow* xr, float* y, int64_t K, int64_t N,
           int64_t n0, int64_t n1) {
#define SPECJAX_Q8GROUP(M)                                                 \
  case M:                                                                  \
    for (n = n0; n + 2 <= n1; n += 2) Out<Q, M, 2>(wq, xr, y, K, N, n);     \
    if (n < n1) Out<Q, M, 1>(wq, xr, y, K, N, n);                          \
    return;
  int64_t n;
  switch (rows) {
    SPECJAX_Q8GROUP(1)
    SPECJAX_Q8GROUP(2)
    SPECJAX_Q8GROUP(3)
    SPECJAX_Q8GROUP(4)
    SPECJAX_Q8GROUP(5)
    SPECJAX_Q8GROUP(6)
    SPECJAX_Q8GROUP(7)
    SPECJAX_Q8GROUP(8)
  }
#undef SPECJAX_Q8GROUP
}

template <int Q>
struct Work {
  const uint8_t* wq;
  std::vector<XRow> xr;
  float* y;
  int64_t M, K, N, chunk, num_chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Run() {
    for (;;) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= num_chunks) return;
      const int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk);
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m0));
        Group<Q>(rows, wq, xr.data() + m0, y + m0 * N, K, N, n0, n1);
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <int Q>
ffi::Error Q8DotImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> wq,
                     ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = wq.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("q8_dot: x [M, K], wq [N, bytes], y [M, N]");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  constexpr int kW = Q8Info<Q>::kW;
  if (K % kW != 0 || wd[0] != N || wd[1] != K / kW * Q8Info<Q>::kBytes || yd[0] != M)
    return ffi::Error::InvalidArgument("q8_dot: shapes do not agree");
  const int64_t B = K / 32, G = (B + kGroup - 1) / kGroup, SB = (B + 15) / 16 * 16;
  // one scratch allocation per call: the quantized rows (the caller's thread, before the pool)
  const int64_t xq_b = G * 128, f_b = (G * kGroup + SB) * 4, c_b = G * kLanes * 4;
  const int64_t per_row = (xq_b + f_b + c_b + 63) / 64 * 64;
  std::unique_ptr<uint8_t[]> scratch(new uint8_t[M * per_row + 64]);
  uint8_t* base = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(scratch.get()) + 63) & ~static_cast<uintptr_t>(63));
  auto work = std::make_shared<Work<Q>>();
  work->xr.resize(M);
  for (int64_t m = 0; m < M; ++m) {
    uint8_t* p = base + m * per_row;
    int8_t* xq = reinterpret_cast<int8_t*>(p);
    float* dx = reinterpret_cast<float*>(p + xq_b);
    float* sx = dx + G * kGroup;
    int32_t* corr = reinterpret_cast<int32_t*>(p + xq_b + f_b);
    QuantizeRow<Q>(x.typed_data() + m * K, K, xq, dx, sx, corr);
    work->xr[m] = XRow{xq, dx, sx, corr};
  }
  work->wq = wq.typed_data();
  work->y = y->typed_data();
  work->M = M;
  work->K = K;
  work->N = N;
  const int64_t threads = pool.num_threads();
  const int64_t helpers = (N * wd[1] < (128 << 10) || threads <= 1) ? 0 : threads;
  int64_t chunk = std::max<int64_t>(8, N / std::max<int64_t>(1, 4 * (helpers + 1)));
  chunk += chunk % 2;
  work->chunk = chunk;
  work->num_chunks = (N + chunk - 1) / chunk;
  specjax::RunOnPool(pool, std::min(helpers, work->num_chunks - 1), work, work->num_chunks);
  return ffi::Error::Success();  // the scratch outlives every helper: all chunks are done
}

}  // namespace

#define SPECJAX_Q8HANDLER(NAME, Q)                                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, Q8DotImpl<Q>, ffi::Ffi::Bind()                  \
                                                        .Ctx<ffi::ThreadPool>()       \
                                                        .Arg<ffi::Buffer<ffi::F32>>() \
                                                        .Arg<ffi::Buffer<ffi::U8>>()  \
                                                        .Ret<ffi::Buffer<ffi::F32>>());
SPECJAX_Q8HANDLER(SpecjaxQ8DotQ4_0, kQ4_0)
SPECJAX_Q8HANDLER(SpecjaxQ8DotQ4_1, kQ4_1)
SPECJAX_Q8HANDLER(SpecjaxQ8DotQ8_0, kQ8_0)
SPECJAX_Q8HANDLER(SpecjaxQ8DotQ5_0, kQ5_0)
SPECJAX_Q8HANDLER(SpecjaxQ8DotQ4_K, kQ4_K)
SPECJAX_Q8HANDLER(SpecjaxQ8DotQ6_K, kQ6_K)
#undef SPECJAX_Q8HANDLER
