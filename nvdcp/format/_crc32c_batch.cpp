// CRC32C (Castagnoli) of many byte ranges of one buffer, on several threads, in one call.
//
// nvdcp checksums every stored chunk (64 KiB or less): ~16k chunks per GB. The `crc32c` Python
// package computes one buffer per call and holds the GIL between calls, so a thread pool over it
// ran slower than one thread on the 16-core H200 host (5-6 GB/s vs 8.4 GB/s). Here one ctypes call
// (ctypes releases the GIL) spreads the ranges over threads, each using the SSE4.2 crc32
// instruction, or a table where the CPU lacks it. Results equal crc32c.crc32c(range).
//
// Plain C ABI, no Python headers: nvdcp/format/crc.py loads it with ctypes. Built by setup.py as
// an optional extension; when it is missing, crc.py falls back to the crc32c package.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define NVDCP_X86 1
#endif

namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // CRC32C, reflected

struct Table {
  uint32_t t[256];
  Table() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[i] = c;
    }
  }
};

const Table& table() {
  static const Table tab;
  return tab;
}

uint32_t crc_table(const uint8_t* p, size_t n, uint32_t crc) {
  const uint32_t* t = table().t;
  for (size_t i = 0; i < n; ++i) crc = t[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return crc;
}

#ifdef NVDCP_X86
__attribute__((target("sse4.2"))) uint32_t crc_sse42(const uint8_t* p, size_t n, uint32_t crc) {
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}

bool has_sse42() { return __builtin_cpu_supports("sse4.2"); }
#else
bool has_sse42() { return false; }
#endif

uint32_t crc32c(const uint8_t* p, size_t n) {
#ifdef NVDCP_X86
  static const bool hw = has_sse42();
  if (hw) return ~crc_sse42(p, n, ~0u);
#endif
  return ~crc_table(p, n, ~0u);
}

}  // namespace

extern "C" int nvdcp_crc32c_hardware() noexcept { return has_sse42() ? 1 : 0; }

// out[i] = CRC32C of base[offsets[i] .. offsets[i] + lengths[i]), for i < n, on up to `threads`
// threads (ranges split so each thread gets about the same number of bytes).
extern "C" int nvdcp_crc32c_ranges(const uint8_t* base, const int64_t* offsets, const int64_t* lengths,
                                   int64_t n, uint32_t* out, int threads) noexcept {
  if (n <= 0) return 0;
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) total += lengths[i];
  int workers = threads < 1 ? 1 : threads;
  if (total < (int64_t{1} << 20)) workers = 1;  // not worth a thread
  auto run = [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) out[i] = crc32c(base + offsets[i], static_cast<size_t>(lengths[i]));
  };
  if (workers == 1) {
    run(0, n);
    return 0;
  }
  std::vector<int64_t> bounds{0};
  int64_t acc = 0, next = total / workers;
  for (int64_t i = 0; i < n && static_cast<int>(bounds.size()) < workers; ++i) {
    acc += lengths[i];
    if (acc >= next) {
      bounds.push_back(i + 1);
      next = total / workers * static_cast<int64_t>(bounds.size());
    }
  }
  if (bounds.back() != n) bounds.push_back(n);
  std::vector<std::thread> pool;
  pool.reserve(bounds.size());
  for (size_t k = 1; k + 1 < bounds.size(); ++k) {
    try {
      pool.emplace_back(run, bounds[k], bounds[k + 1]);
    } catch (...) {
      run(bounds[k], bounds[k + 1]);  // no thread to be had: do this share here
    }
  }
  run(bounds[0], bounds[1]);
  for (auto& t : pool) t.join();
  return 0;
}
