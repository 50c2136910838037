// Pieces every native kernel shares (specjax/csrc/*.cc): IEEE half -> float without F16C, and
// running a chunked job on XLA's intra-op thread pool.
#ifndef SPECJAX_CSRC_COMMON_H_
#define SPECJAX_CSRC_COMMON_H_

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace specjax {

// IEEE half -> float (exact: every half is a float).
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0x1fu) {
    u = sign | 0x7f800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;  // +-0
  } else {  // subnormal: normalise
    int e = -1;
    do { man <<= 1; ++e; } while (!(man & 0x400u));
    u = sign | ((112u - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Runs ``work`` (a W with Run(): claims chunks from an atomic counter until none is left,
// bumping ``done`` per chunk) on the calling thread and ``helpers`` pool threads; returns when
// all ``num_chunks`` chunks are done. Helpers that start late find no work and exit, so nothing
// waits on a busy pool.
template <typename W>
void RunOnPool(xla::ffi::ThreadPool& pool, int64_t helpers, const std::shared_ptr<W>& work,
               int64_t num_chunks) {
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < num_chunks) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
}

}  // namespace specjax

#endif  // SPECJAX_CSRC_COMMON_H_
