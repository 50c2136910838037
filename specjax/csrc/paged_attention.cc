// Paged attention for a few query rows on CPU: decode (T = 1) and verify (T = k + 1 or a tree).
//
// Why: XLA runs the blockwise jnp attention (specjax/attention.py) as ~20 small ops per layer
// (a scan and a cond over key blocks, gathers, masks, two dots, an online softmax): ~0.1 ms a
// layer at a hundred keys, a quarter of a decode step once the weights stream as 4-bit blocks.
// Here one custom call per layer reads each (sequence, KV head)'s keys and values once for all
// its G * T query rows.
//
// Semantics: exactly specjax.attention's (the module docstring): query t of sequence b attends
// to every prefix slot j < cache_start[b] and to new slot cache_start[b] + t' (t' < num_new[b])
// where new_mask[b, t, t'] holds; with a window W > 0 also only where q_pos[b, t] - j < W. A slot
// whose page-table entry is outside [0, P) is never read. A row that may read nothing gives 0.
// Softmax in float32: scores, their max, exp, sum; the output is sum_j p_j v_j / sum_j p_j, every
// row computed on its own (a row's result never depends on the other rows or on T).
//
// Shapes: q, out [B, T, H, D]; k_pages, v_pages [Hkv, P, S, D]; page_table [B, Pmax] int32;
// cache_start, num_new [B] int32; new_mask [B, T, T] bool; q_pos [B, T] int32.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "common.h"

namespace ffi = xla::ffi;

namespace {

inline float Dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  s = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  s = _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
#endif
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

struct Attn {
  const float *q, *k, *v;
  const int32_t *table, *start, *num_new, *q_pos;
  const bool* mask;
  float* out;
  int64_t B, T, H, D, Hkv, P, S, Pmax;
  float scale;
  int64_t window;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // One (sequence b, KV head kh): its G * T rows over keys [first, live).
  void Task(int64_t b, int64_t kh) const {
    const int64_t G = H / Hkv, R = G * T;
    const int64_t st = std::max<int64_t>(0, start[b]);
    const int64_t nn = std::clamp<int64_t>(num_new[b], 0, T);
    const int64_t live = std::min(st + nn, Pmax * S);
    int64_t first = 0;
    if (window > 0) {
      int64_t qmin = std::numeric_limits<int64_t>::max();
      for (int64_t t = 0; t < T; ++t) qmin = std::min<int64_t>(qmin, q_pos[b * T + t]);
      first = std::max<int64_t>(0, qmin - window + 1);
    }
    const int64_t n = std::max<int64_t>(0, live - first);
    const float neg = -std::numeric_limits<float>::infinity();
    std::vector<float> sc(static_cast<size_t>(R * std::max<int64_t>(n, 1)));
    std::vector<const float*> vrow(static_cast<size_t>(std::max<int64_t>(n, 1)));
    for (int64_t jj = 0; jj < n; ++jj) {
      const int64_t j = first + jj;
      const int64_t page = table[b * Pmax + j / S];
      const bool mapped = page >= 0 && page < P;
      const int64_t off = ((kh * P + page) * S + j % S) * D;
      vrow[jj] = mapped ? v + off : nullptr;
      for (int64_t t = 0; t < T; ++t) {
        bool ok = mapped && (j < st || mask[(b * T + t) * T + (j - st)]);
        if (window > 0) ok = ok && (q_pos[b * T + t] - j < window);
        for (int64_t g = 0; g < G; ++g) {
          const float* qr = q + ((b * T + t) * H + kh * G + g) * D;
          sc[(g * T + t) * n + jj] = ok ? Dot(qr, k + off, D) * scale : neg;
        }
      }
    }
    std::vector<float> acc(static_cast<size_t>(D));
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t t = 0; t < T; ++t) {
        float* s = sc.data() + (g * T + t) * n;
        float* o = out + ((b * T + t) * H + kh * G + g) * D;
        float mx = neg;
        for (int64_t jj = 0; jj < n; ++jj) mx = std::max(mx, s[jj]);
        std::fill(acc.begin(), acc.end(), 0.f);
        if (mx == neg) {  // nothing readable: 0
          std::memcpy(o, acc.data(), D * sizeof(float));
          continue;
        }
        float l = 0.f;
        for (int64_t jj = 0; jj < n; ++jj) {
          if (s[jj] == neg) continue;
          const float p = std::exp(s[jj] - mx);
          l += p;
          const float* vr = vrow[jj];
          for (int64_t e = 0; e < D; ++e) acc[e] += p * vr[e];
        }
        const float inv = 1.f / l;
        for (int64_t e = 0; e < D; ++e) o[e] = acc[e] * inv;
      }
    }
  }

  void Run() {
    const int64_t tasks = B * Hkv;
    for (;;) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= tasks) return;
      Task(c / Hkv, c % Hkv);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                              ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> cache_start,
                              ffi::Buffer<ffi::S32> num_new, ffi::Buffer<ffi::PRED> new_mask,
                              ffi::Buffer<ffi::S32> q_pos, float scale, int64_t window,
                              ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), td = page_table.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("paged_attention: q [B,T,H,D], pools [Hkv,P,S,D], table [B,Pmax]");
  auto work = std::make_shared<Attn>();
  work->B = qd[0], work->T = qd[1], work->H = qd[2], work->D = qd[3];
  work->Hkv = kd[0], work->P = kd[1], work->S = kd[2], work->Pmax = td[1];
  if (kd[3] != qd[3] || work->H % work->Hkv != 0 || td[0] != qd[0] ||
      v_pages.element_count() != k_pages.element_count() || cache_start.element_count() != qd[0] ||
      num_new.element_count() != qd[0] || new_mask.element_count() != qd[0] * qd[1] * qd[1] ||
      q_pos.element_count() != qd[0] * qd[1])
    return ffi::Error::InvalidArgument("paged_attention: shapes do not agree");
  work->q = q.typed_data();
  work->k = k_pages.typed_data();
  work->v = v_pages.typed_data();
  work->table = page_table.typed_data();
  work->start = cache_start.typed_data();
  work->num_new = num_new.typed_data();
  work->q_pos = q_pos.typed_data();
  work->mask = new_mask.typed_data();
  work->out = out->typed_data();
  work->scale = scale;
  work->window = window;
  // Small calls (a decode step over a short context) run on the caller alone.
  const int64_t tasks = work->B * work->Hkv;
  const int64_t keys = work->Pmax * work->S;
  const int64_t helpers =
      (tasks < 2 || work->B * work->H * work->T * keys < (1 << 16)) ? 0
                                                                     : std::min<int64_t>(pool.num_threads(), tasks - 1);
  specjax::RunOnPool(pool, helpers, work, tasks);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Ret<ffi::Buffer<ffi::F32>>());
