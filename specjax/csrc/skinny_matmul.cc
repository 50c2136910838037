// Skinny matmul for CPU decode and verify: y[M, N] = x[M, K] @ W for a handful of rows.
//
// Why: XLA:CPU runs M = 1 as a streaming GEMV but M = 2..16 (a speculative verify) as a packed
// GEMM whose cost is ~1.4-2x the GEMV on a 2-core machine, which is what made verification dear
// on CPU (benchmarks/RESULTS.md, "Native few-row matmul"). This kernel streams each weight from
// memory once for all M rows (register blocks of 6 rows, the panel pair re-read from L2 for the
// next 6), so a verify over a few tokens costs about what one decode step costs.
//
// Layout: W arrives pre-packed as column panels wp[P, K, NB] (panel p holds columns
// p*NB .. p*NB+NB-1 of the [K, N] weight, contiguous in k; the last panel zero-padded), so each
// panel is one contiguous stream. The panels are float32, or float16 / bfloat16 for weights that
// are exactly representable in half precision (a bf16 checkpoint loaded as float32, a head
// stored in float16): half the bytes to stream, converted to float32 in registers (exact), so
// the products are the same as from float32 panels of the same values. Every output row is accumulated in the same k order whatever
// M is, so a row's result does not depend on the other rows in the call (decode and verify give
// bit-identical projections for the same input row).
//
// Threads: the panels are shared out through XLA's intra-op thread pool (the FFI ThreadPool
// context): the calling thread and up to num_threads helpers claim chunks of panels from an
// atomic counter; the caller returns when every chunk is done. Helpers that start late find no
// work and exit, so nothing waits on a busy pool.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "common.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kNB = 32;  // panel width (columns)
// Rows per register block: 6 rows x 2 panels x 2 vectors = 24 accumulators (+ 4 weight
// vectors) fit AVX-512's 32 registers. More rows run as further groups over the same panel
// pair while it is still in L2, so the weights stream from memory once whatever M is.
constexpr int kRowGroup = 6;

// One SIMD register of floats: AVX-512, AVX2 + FMA, or a plain float (portable, slow).
#if defined(__AVX512F__)
typedef __m512 Vec;
constexpr int kVec = 16;
inline Vec VLoad(const float* p) { return _mm512_loadu_ps(p); }
inline void VStore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec VZero() { return _mm512_setzero_ps(); }
inline Vec VFma(float a, Vec b, Vec c) { return _mm512_fmadd_ps(_mm512_set1_ps(a), b, c); }
inline Vec VLoadF16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline Vec VLoadBF16(const uint16_t* p) {  // bf16 -> f32 is a 16-bit shift
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 Vec;
constexpr int kVec = 8;
inline Vec VLoad(const float* p) { return _mm256_loadu_ps(p); }
inline void VStore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec VZero() { return _mm256_setzero_ps(); }
inline Vec VFma(float a, Vec b, Vec c) { return _mm256_fmadd_ps(_mm256_set1_ps(a), b, c); }
inline Vec VLoadBF16(const uint16_t* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
#if defined(__F16C__)
inline Vec VLoadF16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#else
#define SPECJAX_SCALAR_F16 1
#endif
#else
typedef float Vec;
constexpr int kVec = 1;
inline Vec VLoad(const float* p) { return *p; }
inline void VStore(float* p, Vec v) { *p = v; }
inline Vec VZero() { return 0.0f; }
inline Vec VFma(float a, Vec b, Vec c) { return __builtin_fmaf(a, b, c); }
inline Vec VLoadBF16(const uint16_t* p) {
  const uint32_t u = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
#define SPECJAX_SCALAR_F16 1
#endif

using specjax::HalfToFloat;

#if defined(SPECJAX_SCALAR_F16)
inline Vec VLoadF16(const uint16_t* p) {
  alignas(64) float buf[kVec];
  for (int i = 0; i < kVec; ++i) buf[i] = HalfToFloat(p[i]);
  return VLoad(buf);
}
#endif

// Panel element types: float32, IEEE float16, bfloat16 (tags for the two 16-bit ones).
struct F16Tag {};
struct BF16Tag {};
template <typename T> struct Elem { typedef float type; };
template <> struct Elem<F16Tag> { typedef uint16_t type; };
template <> struct Elem<BF16Tag> { typedef uint16_t type; };
inline Vec VLoadW(const float* p, float*) { return VLoad(p); }
inline Vec VLoadW(const uint16_t* p, F16Tag*) { return VLoadF16(p); }
inline Vec VLoadW(const uint16_t* p, BF16Tag*) { return VLoadBF16(p); }
constexpr int kV = kNB / kVec;  // registers per panel row

// y[m, p*NB + j] for m < M over NP adjacent panels (NP = 2 gives more independent
// accumulators when few rows share each weight load). Accumulators stay in registers: every
// loop below has constant bounds and is unrolled.
// T: the panel element type (float, F16Tag, BF16Tag).
template <int M, int NP, typename T>
inline void PanelKernel(const typename Elem<T>::type* __restrict wp, const float* __restrict x,
                        float* __restrict y, int64_t K, int64_t N, int64_t p) {
  Vec acc[M][NP][kV];
#pragma GCC unroll 64
  for (int i = 0; i < M * NP * kV; ++i) (&acc[0][0][0])[i] = VZero();
  const typename Elem<T>::type* w = wp + p * K * kNB;
  for (int64_t k = 0; k < K; ++k) {
    Vec wv[NP][kV];
#pragma GCC unroll 8
    for (int q = 0; q < NP; ++q)
#pragma GCC unroll 32
      for (int v = 0; v < kV; ++v) wv[q][v] = VLoadW(w + q * K * kNB + k * kNB + v * kVec, static_cast<T*>(nullptr));
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const float xs = x[m * K + k];
#pragma GCC unroll 8
      for (int q = 0; q < NP; ++q)
#pragma GCC unroll 32
        for (int v = 0; v < kV; ++v) acc[m][q][v] = VFma(xs, wv[q][v], acc[m][q][v]);
    }
  }
  for (int q = 0; q < NP; ++q) {
    const int64_t col = (p + q) * kNB;
    const int64_t width = std::min<int64_t>(kNB, N - col);
    for (int m = 0; m < M; ++m) {
      if (width == kNB) {
        for (int v = 0; v < kV; ++v) VStore(y + m * N + col + v * kVec, acc[m][q][v]);
      } else if (width > 0) {  // the zero-padded last panel: write only the real columns
        alignas(64) float tail[kNB];
        for (int v = 0; v < kV; ++v) VStore(tail + v * kVec, acc[m][q][v]);
        std::memcpy(y + m * N + col, tail, width * sizeof(float));
      }
    }
  }
}

// x's first `rows` rows (<= kRowGroup) over panels [p, p + np), np = 1 or 2.
template <typename T>
void Group(int rows, int np, const typename Elem<T>::type* wp, const float* x, float* y, int64_t K,
           int64_t N, int64_t p) {
#define SPECJAX_GROUP(M)                                        \
  case M:                                                       \
    return np == 2 ? PanelKernel<M, 2, T>(wp, x, y, K, N, p)    \
                   : PanelKernel<M, 1, T>(wp, x, y, K, N, p);
  switch (rows) {
    SPECJAX_GROUP(1)
    SPECJAX_GROUP(2)
    SPECJAX_GROUP(3)
    SPECJAX_GROUP(4)
    SPECJAX_GROUP(5)
    SPECJAX_GROUP(6)
  }
#undef SPECJAX_GROUP
}

// Shared by the caller and its helpers; helpers hold it by shared_ptr, so a late helper can
// still read the counter after the caller has returned.
template <typename T>
struct Work {
  const typename Elem<T>::type* wp;
  const float* x;
  float* y;
  int64_t M, K, N, P, chunk, num_chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Run() {
    for (;;) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= num_chunks) return;
      const int64_t p1 = std::min(P, (c + 1) * chunk);
      for (int64_t p = c * chunk; p < p1; p += 2) {
        const int np = static_cast<int>(std::min<int64_t>(2, p1 - p));
        for (int64_t m0 = 0; m0 < M; m0 += kRowGroup) {
          const int rows = static_cast<int>(std::min<int64_t>(kRowGroup, M - m0));
          Group<T>(rows, np, wp, x + m0 * K, y + m0 * N, K, N, p);
        }
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// y = x @ (the weight in wp); T names wp's element type, D its XLA dtype.
template <typename T, ffi::DataType D>
ffi::Error SkinnyMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<D> wp,
                            ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = wp.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("skinny_matmul: x [M, K], wp [P, K, NB], y [M, N]");
  const int64_t M = xd[0], K = xd[1], P = wd[0], N = yd[1];
  if (wd[1] != K || wd[2] != kNB || yd[0] != M || N > P * kNB || N <= (P - 1) * kNB)
    return ffi::Error::InvalidArgument("skinny_matmul: shapes do not agree");
  auto work = std::make_shared<Work<T>>();
  work->wp = reinterpret_cast<const typename Elem<T>::type*>(wp.typed_data());
  work->x = x.typed_data();
  work->y = y->typed_data();
  work->M = M;
  work->K = K;
  work->N = N;
  work->P = P;
  // ~4 chunks per worker (even panel counts keep the two-panel kernel busy). The caller may
  // sit outside the pool, so up to num_threads helpers join it; small weights (< 256 KiB) and
  // a one-thread pool run on the caller alone.
  const int64_t threads = pool.num_threads();
  const int64_t bytes = P * K * kNB * static_cast<int64_t>(sizeof(typename Elem<T>::type));
  const int64_t helpers = (bytes < (256 << 10) || threads <= 1) ? 0 : threads;
  int64_t chunk = std::max<int64_t>(2, P / std::max<int64_t>(1, 4 * (helpers + 1)));
  chunk += chunk % 2;
  work->chunk = chunk;
  work->num_chunks = (P + chunk - 1) / chunk;
  specjax::RunOnPool(pool, std::min(helpers, work->num_chunks - 1), work, work->num_chunks);
  return ffi::Error::Success();
}


// ------------------------------------------------------------------ GGUF block-quantized weights
//
// y[M, N] = x[M, K] @ W where W's column n is GGUF row n, kept as the file's own blocks
// (wq[N, K / kBlock * kBytes] bytes): Q4_0 (f16 d, 16 bytes of nibbles), Q4_1 (f16 d, f16 m,
// nibbles), Q5_0 (f16 d, 32 high bits, nibbles), Q8_0 (f16 d, 32 int8) over 32 weights, and the
// 256-weight K-quant super-blocks Q4_K (f16 d, f16 dmin, 12 bytes of 6-bit scales and mins,
// 128 bytes of nibbles) and Q6_K (128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales,
// f16 d), read as 8 sub-blocks of 32. Each 32 weights are dequantized once per call (for up to
// kQRows rows; more rows redo it from cache, the bytes stream from memory once) with exactly
// gguf.quants' float32 arithmetic (d * q, d * q + m, (d * sc) * q - dmin * m: every product
// and sum rounded on its own, never fused; the library is built with -ffp-contract=off), so
// every weight equals the float32 value the loader's dequantization gives. A row's sum runs
// over k in the same order whatever M is.
constexpr int kQK = 32;     // weights per (sub-)block: the unit dequantized into registers
constexpr int kQRows = 8;   // rows per register block
enum QType { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2, kQ5_0 = 3, kQ4_K = 4, kQ6_K = 5 };
// kBytes per block of kSub * 32 weights
template <int Q> struct QInfo;
template <> struct QInfo<kQ4_0> { static constexpr int kBytes = 18, kSub = 1; };
template <> struct QInfo<kQ4_1> { static constexpr int kBytes = 20, kSub = 1; };
template <> struct QInfo<kQ8_0> { static constexpr int kBytes = 34, kSub = 1; };
template <> struct QInfo<kQ5_0> { static constexpr int kBytes = 22, kSub = 1; };
template <> struct QInfo<kQ4_K> { static constexpr int kBytes = 144, kSub = 8; };
template <> struct QInfo<kQ6_K> { static constexpr int kBytes = 210, kSub = 8; };

inline float LoadHalf(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return HalfToFloat(h);
#endif
}

// Q4_K's 6-bit scale and min of sub-block j from its 12 scale bytes (llama.cpp's
// get_scale_min_k4, gguf.quants.Q4_K.get_scale_min).
inline void ScaleMinK4(const uint8_t* q, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// out[32] = weights s * 32 .. s * 32 + 31 of one block (gguf.quants.<type>.dequantize_blocks;
// s = 0 for the 32-weight types).
template <int Q> inline void Dequant(const uint8_t* __restrict b, int s, float* __restrict out);
template <> inline void Dequant<kQ4_0>(const uint8_t* __restrict b, int, float* __restrict out) {
  const float d = LoadHalf(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    out[j] = d * static_cast<float>(static_cast<int>(qs[j] & 15) - 8);
    out[j + 16] = d * static_cast<float>(static_cast<int>(qs[j] >> 4) - 8);
  }
}
template <> inline void Dequant<kQ4_1>(const uint8_t* __restrict b, int, float* __restrict out) {
  const float d = LoadHalf(b), m = LoadHalf(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    out[j] = d * static_cast<float>(qs[j] & 15) + m;
    out[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
  }
}
template <> inline void Dequant<kQ8_0>(const uint8_t* __restrict b, int, float* __restrict out) {
  const float d = LoadHalf(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(qs[j]) * d;
}
template <> inline void Dequant<kQ5_0>(const uint8_t* __restrict b, int, float* __restrict out) {
  const float d = LoadHalf(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, sizeof qh);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 15) | (((qh >> j) & 1) << 4);
    const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    out[j] = d * static_cast<float>(lo - 16);
    out[j + 16] = d * static_cast<float>(hi - 16);
  }
}
template <> inline void Dequant<kQ4_K>(const uint8_t* __restrict b, int s, float* __restrict out) {
  int sc, mn;
  ScaleMinK4(b + 4, s, &sc, &mn);
  const float dl = LoadHalf(b) * static_cast<float>(sc);
  const float ml = LoadHalf(b + 2) * static_cast<float>(mn);
  const uint8_t* qs = b + 16 + (s >> 1) * 32;
  const int shift = 4 * (s & 1);
  for (int l = 0; l < 32; ++l) out[l] = dl * static_cast<float>((qs[l] >> shift) & 15) - ml;
}
// Q6_K weight e = 128 h + 32 t + l: low nibble (t >> 1) of ql[64 h + 32 (t & 1) + l], high
// bits 2 t of qh[32 h + l], scale e / 16.
template <> inline void Dequant<kQ6_K>(const uint8_t* __restrict b, int s, float* __restrict out) {
  const int h = s >> 2, t = s & 3;
  const uint8_t* ql = b + 64 * h + 32 * (t & 1);
  const uint8_t* qh = b + 128 + 32 * h;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 2 * s;
  const float d = LoadHalf(b + 208);
  const int lshift = 4 * (t >> 1), hshift = 2 * t;
  for (int l = 0; l < 32; ++l) {
    const int q = (((ql[l] >> lshift) & 15) | (((qh[l] >> hshift) & 3) << 4)) - 32;
    out[l] = (d * static_cast<float>(sc[l >> 4])) * static_cast<float>(q);
  }
}

#if defined(__AVX512F__)
inline Vec VFmaV(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float HSum(Vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
inline Vec VFmaV(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float HSum(Vec v) {
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  return ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]));
}
#else
inline Vec VFmaV(Vec a, Vec b, Vec c) { return __builtin_fmaf(a, b, c); }
inline float HSum(Vec v) { return v; }
#endif

// One block as kQK / kVec registers: the scalar Dequant through a buffer, or (AVX-512) the
// same arithmetic on vectors (the products and sums round exactly as the scalar ones do).
constexpr int kQV = kQK / kVec;
template <int Q> inline void DequantV(const uint8_t* __restrict b, int s, Vec* out) {
  alignas(64) float buf[kQK];
  Dequant<Q>(b, s, buf);
#pragma GCC unroll 32
  for (int v = 0; v < kQV; ++v) out[v] = VLoad(buf + v * kVec);
}
#if defined(__AVX512F__)
inline __m512i Bytes16(const uint8_t* p) {  // 16 bytes -> 16 int32 lanes
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void Nibbles(const uint8_t* qs, __m512i* lo, __m512i* hi) {  // elements 0..15, 16..31
  const __m512i q = Bytes16(qs);
  *lo = _mm512_and_si512(q, _mm512_set1_epi32(15));
  *hi = _mm512_srli_epi32(q, 4);
}
template <> inline void DequantV<kQ4_0>(const uint8_t* __restrict b, int, Vec* out) {
  const __m512 d = _mm512_set1_ps(LoadHalf(b));
  __m512i lo, hi;
  Nibbles(b + 2, &lo, &hi);
  const __m512i eight = _mm512_set1_epi32(8);
  out[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, eight)));
  out[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, eight)));
}
template <> inline void DequantV<kQ4_1>(const uint8_t* __restrict b, int, Vec* out) {
  const __m512 d = _mm512_set1_ps(LoadHalf(b)), m = _mm512_set1_ps(LoadHalf(b + 2));
  __m512i lo, hi;
  Nibbles(b + 4, &lo, &hi);
  out[0] = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)), m);
  out[1] = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)), m);
}
template <> inline void DequantV<kQ8_0>(const uint8_t* __restrict b, int, Vec* out) {
  const __m512 d = _mm512_set1_ps(LoadHalf(b));
  const __m128i* qs = reinterpret_cast<const __m128i*>(b + 2);
  out[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qs))), d);
  out[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qs + 1))), d);
}
template <> inline void DequantV<kQ5_0>(const uint8_t* __restrict b, int, Vec* out) {
  const __m512 d = _mm512_set1_ps(LoadHalf(b));
  uint32_t bits;
  std::memcpy(&bits, b + 2, sizeof bits);
  const __m512i qh = _mm512_set1_epi32(static_cast<int>(bits)), one = _mm512_set1_epi32(1);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i h0 = _mm512_and_si512(_mm512_srlv_epi32(qh, lane), one);
  const __m512i lane16 = _mm512_add_epi32(lane, _mm512_set1_epi32(16));
  const __m512i h1 = _mm512_and_si512(_mm512_srlv_epi32(qh, lane16), one);
  __m512i lo, hi;
  Nibbles(b + 6, &lo, &hi);
  const __m512i sixteen = _mm512_set1_epi32(16);
  lo = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(h0, 4)), sixteen);
  hi = _mm512_sub_epi32(_mm512_or_si512(hi, _mm512_slli_epi32(h1, 4)), sixteen);
  out[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo));
  out[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi));
}
template <> inline void DequantV<kQ4_K>(const uint8_t* __restrict b, int s, Vec* out) {
  int sc, mn;
  ScaleMinK4(b + 4, s, &sc, &mn);
  const __m512 dl = _mm512_set1_ps(LoadHalf(b) * static_cast<float>(sc));
  const __m512 ml = _mm512_set1_ps(LoadHalf(b + 2) * static_cast<float>(mn));
  const uint8_t* qs = b + 16 + (s >> 1) * 32;
  const __m128i shift = _mm_cvtsi32_si128(4 * (s & 1));
  for (int v = 0; v < 2; ++v) {
    const __m512i q = _mm512_and_si512(_mm512_srl_epi32(Bytes16(qs + 16 * v), shift),
                                       _mm512_set1_epi32(15));
    out[v] = _mm512_sub_ps(_mm512_mul_ps(dl, _mm512_cvtepi32_ps(q)), ml);
  }
}
template <> inline void DequantV<kQ6_K>(const uint8_t* __restrict b, int s, Vec* out) {
  const int h = s >> 2, t = s & 3;
  const uint8_t* ql = b + 64 * h + 32 * (t & 1);
  const uint8_t* qh = b + 128 + 32 * h;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 2 * s;
  const float d = LoadHalf(b + 208);
  const __m128i ls = _mm_cvtsi32_si128(4 * (t >> 1)), hs = _mm_cvtsi32_si128(2 * t);
  for (int v = 0; v < 2; ++v) {
    const __m512i lo = _mm512_and_si512(_mm512_srl_epi32(Bytes16(ql + 16 * v), ls),
                                        _mm512_set1_epi32(15));
    const __m512i hi = _mm512_and_si512(_mm512_srl_epi32(Bytes16(qh + 16 * v), hs),
                                        _mm512_set1_epi32(3));
    const __m512i q = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)),
                                       _mm512_set1_epi32(32));
    out[v] = _mm512_mul_ps(_mm512_set1_ps(d * static_cast<float>(sc[v])), _mm512_cvtepi32_ps(q));
  }
}
#endif

// Outputs [n0, n1) for M (<= kQRows) rows of x, NR adjacent outputs at a time.
template <int Q, int M, int NR>
inline void QuantOutputs(const uint8_t* __restrict wq, const float* __restrict x,
                         float* __restrict y, int64_t K, int64_t N, int64_t n) {
  constexpr int kB = QInfo<Q>::kBytes, kS = QInfo<Q>::kSub;
  const int64_t nb = K / (kQK * kS), rb = nb * kB;
  Vec acc[NR][M];
#pragma GCC unroll 16
  for (int i = 0; i < NR * M; ++i) (&acc[0][0])[i] = VZero();
  for (int64_t b = 0; b < nb; ++b) {
#pragma GCC unroll 8
    for (int s = 0; s < kS; ++s) {
      Vec w[NR][kQV];
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) DequantV<Q>(wq + (n + r) * rb + b * kB, s, w[r]);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const float* xm = x + m * K + (b * kS + s) * kQK;
#pragma GCC unroll 4
        for (int r = 0; r < NR; ++r)
#pragma GCC unroll 32
          for (int v = 0; v < kQV; ++v)
            acc[r][m] = VFmaV(w[r][v], VLoad(xm + v * kVec), acc[r][m]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < M; ++m) y[m * N + n + r] = HSum(acc[r][m]);
}

template <int Q>
void QuantGroup(int rows, const uint8_t* wq, const float* x, float* y, int64_t K, int64_t N,
                int64_t n0, int64_t n1) {
#define SPECJAX_QGROUP(M)                                                       \
  case M:                                                                       \
    for (n = n0; n + 2 <= n1; n += 2) QuantOutputs<Q, M, 2>(wq, x, y, K, N, n); \
    if (n < n1) QuantOutputs<Q, M, 1>(wq, x, y, K, N, n);                       \
    return;
  int64_t n;
  switch (rows) {
    SPECJAX_QGROUP(1)
    SPECJAX_QGROUP(2)
    SPECJAX_QGROUP(3)
    SPECJAX_QGROUP(4)
    SPECJAX_QGROUP(5)
    SPECJAX_QGROUP(6)
    SPECJAX_QGROUP(7)
    SPECJAX_QGROUP(8)
  }
#undef SPECJAX_QGROUP
}

template <int Q>
struct QuantWork {
  const uint8_t* wq;
  const float* x;
  float* y;
  int64_t M, K, N, chunk, num_chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Run() {
    for (;;) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= num_chunks) return;
      const int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk);
      for (int64_t m0 = 0; m0 < M; m0 += kQRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kQRows, M - m0));
        QuantGroup<Q>(rows, wq, x + m0 * K, y + m0 * N, K, N, n0, n1);
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <int Q>
ffi::Error QuantMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> wq,
                           ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = wq.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("quant_matmul: x [M, K], wq [N, bytes], y [M, N]");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  constexpr int64_t kBlock = kQK * QInfo<Q>::kSub;
  if (K % kBlock != 0 || wd[0] != N || wd[1] != K / kBlock * QInfo<Q>::kBytes || yd[0] != M)
    return ffi::Error::InvalidArgument("quant_matmul: shapes do not agree");
  auto work = std::make_shared<QuantWork<Q>>();
  work->wq = wq.typed_data();
  work->x = x.typed_data();
  work->y = y->typed_data();
  work->M = M;
  work->K = K;
  work->N = N;
  const int64_t threads = pool.num_threads();
  const int64_t bytes = N * wd[1];
  const int64_t helpers = (bytes < (128 << 10) || threads <= 1) ? 0 : threads;
  int64_t chunk = std::max<int64_t>(8, N / std::max<int64_t>(1, 4 * (helpers + 1)));
  chunk += chunk % 2;
  work->chunk = chunk;
  work->num_chunks = (N + chunk - 1) / chunk;
  specjax::RunOnPool(pool, std::min(helpers, work->num_chunks - 1), work, work->num_chunks);
  return ffi::Error::Success();
}

}  // namespace

#define SPECJAX_HANDLER(NAME, T, D)                                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, (SkinnyMatmulImpl<T, D>), ffi::Ffi::Bind()        \
                                                                    .Ctx<ffi::ThreadPool>() \
                                                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                                                    .Arg<ffi::Buffer<D>>()  \
                                                                    .Ret<ffi::Buffer<ffi::F32>>());
SPECJAX_HANDLER(SpecjaxSkinnyMatmul, float, ffi::F32)
SPECJAX_HANDLER(SpecjaxSkinnyMatmulF16, F16Tag, ffi::F16)
SPECJAX_HANDLER(SpecjaxSkinnyMatmulBF16, BF16Tag, ffi::BF16)

#define SPECJAX_QHANDLER(NAME, Q)                                                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, QuantMatmulImpl<Q>, ffi::Ffi::Bind()                \
                                                             .Ctx<ffi::ThreadPool>()      \
                                                             .Arg<ffi::Buffer<ffi::F32>>() \
                                                             .Arg<ffi::Buffer<ffi::U8>>()  \
                                                             .Ret<ffi::Buffer<ffi::F32>>());
SPECJAX_QHANDLER(SpecjaxQuantMatmulQ4_0, kQ4_0)
SPECJAX_QHANDLER(SpecjaxQuantMatmulQ4_1, kQ4_1)
SPECJAX_QHANDLER(SpecjaxQuantMatmulQ8_0, kQ8_0)
SPECJAX_QHANDLER(SpecjaxQuantMatmulQ5_0, kQ5_0)
SPECJAX_QHANDLER(SpecjaxQuantMatmulQ4_K, kQ4_K)
SPECJAX_QHANDLER(SpecjaxQuantMatmulQ6_K, kQ6_K)
#undef SPECJAX_QHANDLER
#undef SPECJAX_HANDLER
