// CRC32C (Castagnoli) of many byte ranges of one buffer, on several threads, in one call.
//
// nvdcp checksums every stored chunk (64 KiB or less): ~16k chunks per GB. The `crc32c` Python
// package computes one buffer per call and holds the GIL between calls, so a thread pool over it
// ran slower than one thread on the 16-core H200 host (5-6 GB/s vs 8.4 GB/s). Here one ctypes call
// (ctypes releases the GIL) spreads the ranges over threads, each using the SSE4.2 crc32
// instruction, or a table where the CPU lacks it. Results equal crc32c.crc32c(range).
//
// One range is checksummed three lanes at a time (three independent crc32 instructions in flight:
// the instruction has a latency of 3 cycles and a throughput of 1), the lanes joined with
// precomputed "append N zero bytes" tables (Mark Adler's crc32c_hw, the zlib crc32_combine
// method): 19-21 GB/s a thread on 64 KiB-1 MiB ranges against 5.7 GB/s for one dependent chain
// and ~12 GB/s for the crc32c package (CPU machine, Xeon @ 2.8 GHz, 2026-12-01).
//
// The same library splits elements into byte planes and merges them back (docs/FORMAT.md,
// TRANSFORM_BYTEPLANES) for nvdcp/pipeline/cpu.py: SSE2/SSSE3 shuffles where the CPU has them,
// plain loops otherwise; the same bytes as the numpy fallback (nvdcp/transform/byteplanes.py).
// And it takes and applies deltas (nvdcp/transform/delta.py), the same bytes as its numpy code.
//
// Plain C ABI, no Python headers: nvdcp/format/crc.py and nvdcp/transform/byteplanes.py load it
// with ctypes (which releases the GIL during a call). Built by setup.py as an optional
// extension; when it is missing, they fall back to the crc32c package and numpy.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#include <nmmintrin.h>
#include <tmmintrin.h>
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

// --- shifting a CRC over zero bytes (for joining lanes) -------------------------------------
// A CRC register advanced over `len` zero bytes is a linear map of GF(2)^32: a 32x32 bit matrix,
// applied a byte of the register at a time through four 256-entry tables.
uint32_t gf2_times(const uint32_t* mat, uint32_t vec) {
  uint32_t sum = 0;
  while (vec) {
    if (vec & 1) sum ^= *mat;
    vec >>= 1;
    ++mat;
  }
  return sum;
}

void gf2_square(uint32_t* square, const uint32_t* mat) {
  for (int n = 0; n < 32; ++n) square[n] = gf2_times(mat, mat[n]);
}

// The operator for `len` zero bytes (`len` a power of two).
void zeros_op(uint32_t* even, size_t len) {
  uint32_t odd[32];
  odd[0] = kPoly;  // one zero bit
  uint32_t row = 1;
  for (int n = 1; n < 32; ++n) {
    odd[n] = row;
    row <<= 1;
  }
  gf2_square(even, odd);  // two zero bits
  gf2_square(odd, even);  // four
  do {                    // eight (one byte), then doubling while len halves
    gf2_square(even, odd);
    len >>= 1;
    if (len == 0) return;
    gf2_square(odd, even);
    len >>= 1;
  } while (len);
  std::memcpy(even, odd, sizeof(odd));
}

struct ZeroShift {
  uint32_t t[4][256];
  explicit ZeroShift(size_t len) {
    uint32_t op[32];
    zeros_op(op, len);
    for (uint32_t n = 0; n < 256; ++n) {
      t[0][n] = gf2_times(op, n);
      t[1][n] = gf2_times(op, n << 8);
      t[2][n] = gf2_times(op, n << 16);
      t[3][n] = gf2_times(op, n << 24);
    }
  }
  uint32_t operator()(uint32_t crc) const {
    return t[0][crc & 0xFF] ^ t[1][(crc >> 8) & 0xFF] ^ t[2][(crc >> 16) & 0xFF] ^ t[3][crc >> 24];
  }
};

constexpr size_t kLong = 8192;  // lane lengths (bytes); powers of two
constexpr size_t kShort = 256;

const ZeroShift& shift_long() {
  static const ZeroShift z(kLong);
  return z;
}
const ZeroShift& shift_short() {
  static const ZeroShift z(kShort);
  return z;
}

#ifdef NVDCP_X86
inline uint64_t load64(const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  return w;
}

// Three lanes of `lane` bytes each, per round, while at least 3 * lane bytes are left.
__attribute__((target("sse4.2"))) inline uint64_t crc_lanes(const uint8_t*& p, size_t& n, uint64_t c0, size_t lane,
                                                           const ZeroShift& shift) {
  while (n >= 3 * lane) {
    uint64_t c1 = 0, c2 = 0;
    const uint8_t* end = p + lane;
    do {
      c0 = _mm_crc32_u64(c0, load64(p));
      c1 = _mm_crc32_u64(c1, load64(p + lane));
      c2 = _mm_crc32_u64(c2, load64(p + 2 * lane));
      p += 8;
    } while (p < end);
    c0 = shift(static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
    c0 = shift(static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c2);
    p += 2 * lane;
    n -= 3 * lane;
  }
  return c0;
}

__attribute__((target("sse4.2"))) uint32_t crc_sse42(const uint8_t* p, size_t n, uint32_t crc) {
  uint64_t c = crc;
  c = crc_lanes(p, n, c, kLong, shift_long());
  c = crc_lanes(p, n, c, kShort, shift_short());
  while (n >= 8) {
    c = _mm_crc32_u64(c, load64(p));
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

// --- byte planes ---------------------------------------------------------------------------
// split: dst + p * stride receives byte p of each of the n elements of src (e bytes each).
// merge: the inverse, from one pointer per plane.
template <int E>
void split_loop(const uint8_t* src, size_t lo, size_t n, uint8_t* dst, size_t stride) {
  for (size_t i = lo; i < n; ++i)
    for (int p = 0; p < E; ++p) dst[p * stride + i] = src[i * E + p];
}

void split_any(const uint8_t* src, size_t lo, size_t n, int e, uint8_t* dst, size_t stride) {
  for (size_t i = lo; i < n; ++i)
    for (int p = 0; p < e; ++p) dst[p * stride + i] = src[i * e + p];
}

template <int E>
void merge_loop(const uint8_t* const* planes, size_t lo, size_t n, uint8_t* dst) {
  for (size_t i = lo; i < n; ++i)
    for (int p = 0; p < E; ++p) dst[i * E + p] = planes[p][i];
}

void merge_any(const uint8_t* const* planes, size_t lo, size_t n, int e, uint8_t* dst) {
  for (size_t i = lo; i < n; ++i)
    for (int p = 0; p < e; ++p) dst[i * e + p] = planes[p][i];
}

#ifdef NVDCP_X86
inline __m128i ld(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline void st(uint8_t* p, __m128i v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v); }

// 16 elements a round. Bytes of each 16-byte load grouped by position (pshufb), then the 4-byte
// groups transposed (unpack).
__attribute__((target("ssse3"))) size_t split4_ssse3(const uint8_t* src, size_t n, uint8_t* dst, size_t stride) {
  const __m128i m = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const uint8_t* s = src + 4 * i;
    __m128i a = _mm_shuffle_epi8(ld(s), m), b = _mm_shuffle_epi8(ld(s + 16), m);
    __m128i c = _mm_shuffle_epi8(ld(s + 32), m), d = _mm_shuffle_epi8(ld(s + 48), m);
    __m128i t0 = _mm_unpacklo_epi32(a, b), t1 = _mm_unpacklo_epi32(c, d);
    __m128i t2 = _mm_unpackhi_epi32(a, b), t3 = _mm_unpackhi_epi32(c, d);
    st(dst + i, _mm_unpacklo_epi64(t0, t1));
    st(dst + stride + i, _mm_unpackhi_epi64(t0, t1));
    st(dst + 2 * stride + i, _mm_unpacklo_epi64(t2, t3));
    st(dst + 3 * stride + i, _mm_unpackhi_epi64(t2, t3));
  }
  return i;
}

__attribute__((target("ssse3"))) size_t split8_ssse3(const uint8_t* src, size_t n, uint8_t* dst, size_t stride) {
  // 16 elements a round: each 16-byte load (2 elements) grouped by position into 8 byte pairs,
  // then pairs of 8 loads transposed as 16-bit words.
  const __m128i m = _mm_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const uint8_t* s = src + 8 * i;
    __m128i v[8];
    for (int k = 0; k < 8; ++k) v[k] = _mm_shuffle_epi8(ld(s + 16 * k), m);  // words: planes 0..7 of 2 elements
    // transpose the 8x8 matrix of 16-bit words
    __m128i a0 = _mm_unpacklo_epi16(v[0], v[1]), a1 = _mm_unpackhi_epi16(v[0], v[1]);
    __m128i a2 = _mm_unpacklo_epi16(v[2], v[3]), a3 = _mm_unpackhi_epi16(v[2], v[3]);
    __m128i a4 = _mm_unpacklo_epi16(v[4], v[5]), a5 = _mm_unpackhi_epi16(v[4], v[5]);
    __m128i a6 = _mm_unpacklo_epi16(v[6], v[7]), a7 = _mm_unpackhi_epi16(v[6], v[7]);
    __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
    __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
    __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
    __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
    st(dst + i, _mm_unpacklo_epi64(b0, b4));
    st(dst + stride + i, _mm_unpackhi_epi64(b0, b4));
    st(dst + 2 * stride + i, _mm_unpacklo_epi64(b1, b5));
    st(dst + 3 * stride + i, _mm_unpackhi_epi64(b1, b5));
    st(dst + 4 * stride + i, _mm_unpacklo_epi64(b2, b6));
    st(dst + 5 * stride + i, _mm_unpackhi_epi64(b2, b6));
    st(dst + 6 * stride + i, _mm_unpacklo_epi64(b3, b7));
    st(dst + 7 * stride + i, _mm_unpackhi_epi64(b3, b7));
  }
  return i;
}

// SSE2 (every x86-64): even and odd bytes of 16-bit words, packed.
size_t split2_sse2(const uint8_t* src, size_t n, uint8_t* dst, size_t stride) {
  const __m128i lo = _mm_set1_epi16(0x00FF);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m128i a = ld(src + 2 * i), b = ld(src + 2 * i + 16);
    st(dst + i, _mm_packus_epi16(_mm_and_si128(a, lo), _mm_and_si128(b, lo)));
    st(dst + stride + i, _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8)));
  }
  return i;
}

// Merges by unpacking (SSE2): 16 elements a round.
size_t merge2_sse2(const uint8_t* const* pl, size_t n, uint8_t* dst) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m128i a = ld(pl[0] + i), b = ld(pl[1] + i);
    st(dst + 2 * i, _mm_unpacklo_epi8(a, b));
    st(dst + 2 * i + 16, _mm_unpackhi_epi8(a, b));
  }
  return i;
}

size_t merge4_sse2(const uint8_t* const* pl, size_t n, uint8_t* dst) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m128i p0 = ld(pl[0] + i), p1 = ld(pl[1] + i), p2 = ld(pl[2] + i), p3 = ld(pl[3] + i);
    __m128i x0 = _mm_unpacklo_epi8(p0, p1), x1 = _mm_unpackhi_epi8(p0, p1);
    __m128i y0 = _mm_unpacklo_epi8(p2, p3), y1 = _mm_unpackhi_epi8(p2, p3);
    uint8_t* d = dst + 4 * i;
    st(d, _mm_unpacklo_epi16(x0, y0));
    st(d + 16, _mm_unpackhi_epi16(x0, y0));
    st(d + 32, _mm_unpacklo_epi16(x1, y1));
    st(d + 48, _mm_unpackhi_epi16(x1, y1));
  }
  return i;
}

size_t merge8_sse2(const uint8_t* const* pl, size_t n, uint8_t* dst) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m128i p[8];
    for (int k = 0; k < 8; ++k) p[k] = ld(pl[k] + i);
    __m128i x0 = _mm_unpacklo_epi8(p[0], p[1]), x1 = _mm_unpackhi_epi8(p[0], p[1]);
    __m128i x2 = _mm_unpacklo_epi8(p[2], p[3]), x3 = _mm_unpackhi_epi8(p[2], p[3]);
    __m128i x4 = _mm_unpacklo_epi8(p[4], p[5]), x5 = _mm_unpackhi_epi8(p[4], p[5]);
    __m128i x6 = _mm_unpacklo_epi8(p[6], p[7]), x7 = _mm_unpackhi_epi8(p[6], p[7]);
    // words: x0 = planes(0,1) of elements 0..7, x2 = planes(2,3) ...
    __m128i y0 = _mm_unpacklo_epi16(x0, x2), y1 = _mm_unpackhi_epi16(x0, x2);  // planes 0-3, elems 0-3 / 4-7
    __m128i y2 = _mm_unpacklo_epi16(x4, x6), y3 = _mm_unpackhi_epi16(x4, x6);  // planes 4-7, elems 0-3 / 4-7
    __m128i y4 = _mm_unpacklo_epi16(x1, x3), y5 = _mm_unpackhi_epi16(x1, x3);  // planes 0-3, elems 8-11 / 12-15
    __m128i y6 = _mm_unpacklo_epi16(x5, x7), y7 = _mm_unpackhi_epi16(x5, x7);  // planes 4-7, elems 8-11 / 12-15
    uint8_t* d = dst + 8 * i;
    st(d, _mm_unpacklo_epi32(y0, y2));
    st(d + 16, _mm_unpackhi_epi32(y0, y2));
    st(d + 32, _mm_unpacklo_epi32(y1, y3));
    st(d + 48, _mm_unpackhi_epi32(y1, y3));
    st(d + 64, _mm_unpacklo_epi32(y4, y6));
    st(d + 80, _mm_unpackhi_epi32(y4, y6));
    st(d + 96, _mm_unpacklo_epi32(y5, y7));
    st(d + 112, _mm_unpackhi_epi32(y5, y7));
  }
  return i;
}

bool has_ssse3() { return __builtin_cpu_supports("ssse3"); }
#endif

}  // namespace

extern "C" int nvdcp_crc32c_hardware() noexcept { return has_sse42() ? 1 : 0; }

namespace {
// run(lo, hi) over ranges 0..n-1 on up to `threads` threads, the ranges split so each thread
// gets about the same number of bytes (one thread under 1 MiB in all: not worth starting one).
template <typename Run>
void for_byte_shares(const int64_t* lengths, int64_t n, int threads, Run run) {
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) total += lengths[i];
  int workers = threads < 1 ? 1 : threads;
  if (total < (int64_t{1} << 20)) workers = 1;
  if (workers == 1) {
    run(int64_t{0}, n);
    return;
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
}
}  // namespace

// out[i] = CRC32C of base[offsets[i] .. offsets[i] + lengths[i]), for i < n, on up to `threads`
// threads (ranges split so each thread gets about the same number of bytes).
extern "C" int nvdcp_crc32c_ranges(const uint8_t* base, const int64_t* offsets, const int64_t* lengths,
                                   int64_t n, uint32_t* out, int threads) noexcept {
  if (n <= 0) return 0;
  for_byte_shares(lengths, n, threads, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) out[i] = crc32c(base + offsets[i], static_cast<size_t>(lengths[i]));
  });
  return 0;
}

// Copy n ranges (sizes[i] bytes from address srcs[i] to address dsts[i], not overlapping) and
// set crcs[i] to the CRC32C of each copy, read back while it is still in cache: a small-item
// batch's stored chunks gathered into its records and checksummed in one pass over memory
// instead of two (nvdcp/pipeline/cpu_batch.py), on up to `threads` threads.
extern "C" int nvdcp_gather_crc32c(const int64_t* srcs, const int64_t* dsts, const int64_t* sizes, int64_t n,
                                   uint32_t* crcs, int threads) noexcept {
  if (n <= 0) return 0;
  for_byte_shares(sizes, n, threads, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      auto* dst = reinterpret_cast<uint8_t*>(dsts[i]);
      size_t size = sizes[i] > 0 ? static_cast<size_t>(sizes[i]) : 0;
      if (size) std::memcpy(dst, reinterpret_cast<const void*>(srcs[i]), size);
      crcs[i] = crc32c(dst, size);
    }
  });
  return 0;
}

// Split n elements of e bytes at src into e planes: plane p at dst + p * stride (n bytes each).
extern "C" int nvdcp_split_planes(const uint8_t* src, int64_t n, int e, uint8_t* dst, int64_t stride) noexcept {
  if (n <= 0 || e <= 0) return 0;
  size_t un = static_cast<size_t>(n), us = static_cast<size_t>(stride), done = 0;
  switch (e) {
    case 1:
      std::memcpy(dst, src, un);
      return 0;
    case 2:
#ifdef NVDCP_X86
      done = split2_sse2(src, un, dst, us);
#endif
      split_loop<2>(src, done, un, dst, us);
      return 0;
    case 4: {
#ifdef NVDCP_X86
      static const bool ok = has_ssse3();
      if (ok) done = split4_ssse3(src, un, dst, us);
#endif
      split_loop<4>(src, done, un, dst, us);
      return 0;
    }
    case 8: {
#ifdef NVDCP_X86
      static const bool ok = has_ssse3();
      if (ok) done = split8_ssse3(src, un, dst, us);
#endif
      split_loop<8>(src, done, un, dst, us);
      return 0;
    }
    default:
      split_any(src, 0, un, e, dst, us);
      return 0;
  }
}

// Merge e planes (planes[p]: n bytes) into n elements of e bytes at dst.
extern "C" int nvdcp_merge_planes(const uint8_t* const* planes, int64_t n, int e, uint8_t* dst) noexcept {
  if (n <= 0 || e <= 0) return 0;
  size_t un = static_cast<size_t>(n), done = 0;
  switch (e) {
    case 1:
      std::memcpy(dst, planes[0], un);
      return 0;
    case 2:
#ifdef NVDCP_X86
      done = merge2_sse2(planes, un, dst);
#endif
      merge_loop<2>(planes, done, un, dst);
      return 0;
    case 4:
#ifdef NVDCP_X86
      done = merge4_sse2(planes, un, dst);
#endif
      merge_loop<4>(planes, done, un, dst);
      return 0;
    case 8:
#ifdef NVDCP_X86
      done = merge8_sse2(planes, un, dst);
#endif
      merge_loop<8>(planes, done, un, dst);
      return 0;
    default:
      merge_any(planes, 0, un, e, dst);
      return 0;
  }
}


// Copy n ranges: sizes[i] bytes from address srcs[i] to address dsts[i] (a small-item batch's
// stored chunks gathered into its records, nvdcp/pipeline/cpu_batch.py: one call instead of a
// Python slice copy per chunk). Ranges must not overlap.
extern "C" int nvdcp_gather(const int64_t* srcs, const int64_t* dsts, const int64_t* sizes, int64_t n) noexcept {
  for (int64_t i = 0; i < n; ++i) {
    if (sizes[i] > 0) {
      std::memcpy(reinterpret_cast<void*>(dsts[i]), reinterpret_cast<const void*>(srcs[i]),
                  static_cast<size_t>(sizes[i]));
    }
  }
  return 0;
}

// Split `count` arrays into one set of planes: array i (ns[i] elements of e bytes at address
// srcs[i]) lands at dst + offsets[i] in every plane (plane p at dst + p * stride). The tensors
// of a small-item batch go from their own memory straight into the batch's planes, with no
// concatenated copy first (nvdcp/pipeline/cpu_batch.py).
extern "C" int nvdcp_split_planes_many(const int64_t* srcs, const int64_t* ns, int64_t count, int e, uint8_t* dst,
                                       const int64_t* offsets, int64_t stride) noexcept {
  for (int64_t i = 0; i < count; ++i) {
    nvdcp_split_planes(reinterpret_cast<const uint8_t*>(srcs[i]), ns[i], e, dst + offsets[i], stride);
  }
  return 0;
}

// Merge `count` blocks of e planes each: block i's planes at the addresses planes[i * e ..
// i * e + e), ns[i] bytes each, interleaved into ns[i] elements at address dsts[i]. A batch of
// small records decodes into its destinations with one call (nvdcp/pipeline/cpu_batch.py).
extern "C" int nvdcp_merge_planes_many(const int64_t* planes, const int64_t* ns, const int64_t* dsts, int64_t count,
                                       int e) noexcept {
  for (int64_t i = 0; i < count; ++i) {
    nvdcp_merge_planes(reinterpret_cast<const uint8_t* const*>(planes + i * e), ns[i], e,
                       reinterpret_cast<uint8_t*>(dsts[i]));
  }
  return 0;
}

// --- deltas (nvdcp/transform/delta.py) -----------------------------------------------------------
// kind 0 (XOR): out = raw ^ base, byte-wise. kind 1 (ZIGZAG_DIFF): each element of e bytes read
// as a signed integer, d = raw - base (modulo 2^(8e)), out = (d << 1) ^ (d >> (8e - 1)). One
// pass over both inputs instead of numpy's four; it also reports whether any output byte is
// nonzero (an unchanged item), which the encoder otherwise finds with another pass.
namespace {
// Elements are loaded and stored with memcpy: the buffers may be unaligned (a record's bytes at
// any offset of a read buffer); compilers turn these into plain (vectorized) unaligned moves.
template <typename U>
bool zigzag_diff(const uint8_t* raw, const uint8_t* base, size_t n, uint8_t* out) {
  using S = typename std::make_signed<U>::type;
  U seen = 0;
  for (size_t i = 0; i < n; ++i) {
    U a, b;
    std::memcpy(&a, raw + i * sizeof(U), sizeof(U));
    std::memcpy(&b, base + i * sizeof(U), sizeof(U));
    U d = static_cast<U>(a - b);
    U z = static_cast<U>(static_cast<U>(d << 1) ^ static_cast<U>(static_cast<S>(d) >> (8 * sizeof(U) - 1)));
    std::memcpy(out + i * sizeof(U), &z, sizeof(U));
    seen |= z;
  }
  return seen != 0;
}

template <typename U>
void zigzag_apply(uint8_t* value, const uint8_t* delta, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    U v, z;
    std::memcpy(&v, value + i * sizeof(U), sizeof(U));
    std::memcpy(&z, delta + i * sizeof(U), sizeof(U));
    v = static_cast<U>(v + (static_cast<U>(z >> 1) ^ static_cast<U>(0 - (z & 1))));
    std::memcpy(value + i * sizeof(U), &v, sizeof(U));
  }
}
}  // namespace

// out (n elements of e bytes) = the delta of raw against base; returns 1 when any byte of it is
// nonzero, 0 when raw equals base, -1 for an unknown kind or width. The arrays may be unaligned.
extern "C" int nvdcp_delta_encode(const uint8_t* raw, const uint8_t* base, int64_t n, int e, int kind,
                                  uint8_t* out) noexcept {
  if (n <= 0) return 0;
  size_t un = static_cast<size_t>(n);
  if (kind == 0) {
    uint8_t seen = 0;
    for (size_t i = 0; i < un * static_cast<size_t>(e); ++i) {
      out[i] = raw[i] ^ base[i];
      seen |= out[i];
    }
    return seen != 0;
  }
  if (kind != 1) return -1;
  switch (e) {
    case 2: return zigzag_diff<uint16_t>(raw, base, un, out);
    case 4: return zigzag_diff<uint32_t>(raw, base, un, out);
    case 8: return zigzag_diff<uint64_t>(raw, base, un, out);
    default: return -1;
  }
}

// value (the base's bytes, n elements of e bytes) becomes the item's: the inverse of
// nvdcp_delta_encode. Returns 0, or -1 for an unknown kind or width.
extern "C" int nvdcp_delta_apply(uint8_t* value, const uint8_t* delta, int64_t n, int e, int kind) noexcept {
  if (n <= 0) return 0;
  size_t un = static_cast<size_t>(n);
  if (kind == 0) {
    for (size_t i = 0; i < un * static_cast<size_t>(e); ++i) value[i] ^= delta[i];
    return 0;
  }
  if (kind != 1) return -1;
  switch (e) {
    case 2: zigzag_apply<uint16_t>(value, delta, un); return 0;
    case 4: zigzag_apply<uint32_t>(value, delta, un); return 0;
    case 8: zigzag_apply<uint64_t>(value, delta, un); return 0;
    default: return -1;
  }
}

// Merge `count` blocks of e planes each (as nvdcp_merge_planes_many) and apply them, as a delta of
// `kind` over elements of w bytes (nvdcp_delta_apply), to the bytes already at dsts[i] (the base
// item's, decoded there first): one pass over each destination instead of a merge into a
// scratch buffer and a second pass applying it (nvdcp/pipeline/cpu_batch.py, delta chains on the
// host). Each block's n*e bytes must be a multiple of w. Returns 0, or -1 for an unknown kind or
// width (nothing written then).
extern "C" int nvdcp_merge_apply_many(const int64_t* planes, const int64_t* ns, const int64_t* dsts, int64_t count,
                                      int e, int kind, int w) noexcept {
  if (e <= 0 || e > 16 || (kind != 0 && kind != 1) || (kind == 1 && w != 2 && w != 4 && w != 8)) return -1;
  constexpr size_t kTile = 4096;  // elements per round: the merged tile stays in L1
  alignas(16) uint8_t tile[kTile * 16];
  const uint8_t* rows[16];
  for (int64_t i = 0; i < count; ++i) {
    uint8_t* dst = reinterpret_cast<uint8_t*>(dsts[i]);
    const size_t n = static_cast<size_t>(ns[i]);
    for (size_t lo = 0; lo < n; lo += kTile) {
      const size_t m = n - lo < kTile ? n - lo : kTile;
      for (int p = 0; p < e; ++p) rows[p] = reinterpret_cast<const uint8_t*>(planes[i * e + p]) + lo;
      nvdcp_merge_planes(rows, static_cast<int64_t>(m), e, tile);
      uint8_t* out = dst + lo * static_cast<size_t>(e);
      const size_t bytes = m * static_cast<size_t>(e);
      if (kind == 0) {
        for (size_t k = 0; k < bytes; ++k) out[k] ^= tile[k];
      } else if (w == 2) {
        zigzag_apply<uint16_t>(out, tile, bytes / 2);
      } else if (w == 4) {
        zigzag_apply<uint32_t>(out, tile, bytes / 4);
      } else {
        zigzag_apply<uint64_t>(out, tile, bytes / 8);
      }
    }
  }
  return 0;
}

// The delta of `count` arrays against their bases (as nvdcp_delta_encode), split straight into one
// set of planes (as nvdcp_split_planes_many), each array copied to keeps[i] as it goes (0: none):
// one pass over each array instead of a difference into fresh memory, a split of it and a copy
// of the array kept for the next save (nvdcp/transform/delta.py: delta_split). Array i: ns[i]
// elements of e bytes (e planes; e = 1 for a single plane) at address srcs[i], its base at bases[i];
// its planes land at dst + offsets[i] (plane p at dst + p * stride). The delta's elements are w
// bytes wide (XOR: 1); each array's ns[i] * e bytes must be a multiple of w. A kept array may be
// its own base (the base's bytes of each tile are read before the tile is kept) and nothing
// else's. changed[i] gets 1 where the delta is not all zero. Returns 0, or -1 for an unknown
// kind or width (nothing written then).
extern "C" int nvdcp_delta_split_many(const int64_t* srcs, const int64_t* bases, const int64_t* keeps,
                                      const int64_t* ns, int64_t count, int e, int kind, int w, uint8_t* dst,
                                      const int64_t* offsets, int64_t stride, uint8_t* changed) noexcept {
  if (e <= 0 || e > 16 || (kind != 0 && kind != 1) || (kind == 1 && w != 2 && w != 4 && w != 8)) return -1;
  constexpr size_t kTile = 4096;  // elements per round: the tile's difference stays in L1
  alignas(16) uint8_t tile[kTile * 16];
  const size_t ue = static_cast<size_t>(e);
  for (int64_t i = 0; i < count; ++i) {
    const uint8_t* src = reinterpret_cast<const uint8_t*>(srcs[i]);
    const uint8_t* base = reinterpret_cast<const uint8_t*>(bases[i]);
    uint8_t* keep = reinterpret_cast<uint8_t*>(keeps[i]);
    const size_t n = static_cast<size_t>(ns[i]);
    bool seen = false;
    for (size_t lo = 0; lo < n; lo += kTile) {
      const size_t m = n - lo < kTile ? n - lo : kTile;
      const size_t at = lo * ue, bytes = m * ue;
      const int64_t elements = static_cast<int64_t>(kind == 0 ? bytes : bytes / static_cast<size_t>(w));
      seen |= nvdcp_delta_encode(src + at, base + at, elements, kind == 0 ? 1 : w, kind, tile) > 0;
      if (keep != nullptr) std::memcpy(keep + at, src + at, bytes);
      nvdcp_split_planes(tile, static_cast<int64_t>(m), e, dst + offsets[i] + lo, stride);
    }
    changed[i] = seen ? 1 : 0;
  }
  return 0;
}

// The memo-index scan of a pickle (nvdcp/dcp/metadata_io.py: check_memo_indices), its common
// opcodes: from opcode position i, step over every opcode that the scan only steps over and
// that lies whole inside the n bytes (skip[op] >= 0: that many argument bytes; -1/-4/-8: a count
// of that many bytes, then that many bytes), and every LONG_BINPUT (-5) whose memo index is at
// most n. Returns the position of the first opcode it does not step over (STOP, a newline-
// terminated one, an unknown byte, a LONG_BINPUT past n, one cut off by the end), or n: the
// Python loop handles that one opcode exactly as before, then calls this again.
extern "C" int64_t nvdcp_pickle_skip(const uint8_t* b, int64_t n, int64_t i, const int32_t* skip) noexcept {
  while (i < n) {
    const int32_t s = skip[b[i]];
    const int64_t after = i + 1;  // the opcode's argument starts here
    if (s >= 0) {
      if (s > n - after) return i;
      i = after + s;
    } else if (s == -1) {
      if (after >= n || b[after] > n - after - 1) return i;
      i = after + 1 + b[after];
    } else if (s == -4 || s == -8) {
      const int64_t k = -s;
      if (k > n - after) return i;
      uint64_t v = 0;
      for (int64_t j = k - 1; j >= 0; --j) v = (v << 8) | b[after + j];
      if (v > static_cast<uint64_t>(n - after - k)) return i;
      i = after + k + static_cast<int64_t>(v);
    } else if (s == -5) {  // LONG_BINPUT: a 4-byte memo index, at most the pickle's size
      if (4 > n - after) return i;
      const uint64_t v = static_cast<uint64_t>(b[after]) | static_cast<uint64_t>(b[after + 1]) << 8 |
                         static_cast<uint64_t>(b[after + 2]) << 16 | static_cast<uint64_t>(b[after + 3]) << 24;
      if (v > static_cast<uint64_t>(n)) return i;
      i = after + 4;
    } else {
      return i;
    }
  }
  return i;
}
