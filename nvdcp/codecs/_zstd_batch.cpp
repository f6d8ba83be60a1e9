// Many byte ranges of one buffer compressed into zstd frames, on several threads, in one call.
//
// Why it exists: the sign+exponent planes of floats (and the planes of a delta) are near-iid
// bytes, where zstd's gain is all in the Huffman-coded literals and its match search is wasted
// work. zstd can skip that search while still Huffman-coding the literals (fast strategy with a
// large "acceleration" plus ZSTD_c_literalCompressionMode=ZSTD_ps_enable), but the `zstandard`
// package's C binding does not expose that parameter. Its cffi backend exposes the whole zstd
// API, so nvdcp/codecs/zstd.py hands this file the addresses of the zstd functions that package
// already carries, and the parameters as (key, value) pairs; nothing is linked here and no second
// copy of zstd is built. The frames are ordinary zstd frames: every decoder reads them.
//
// The same file decodes: nvdcp_zstd_decode_blocks turns the stored chunks of many blocks back
// into their elements, each block's frames decoded into a small per-thread scratch and its planes
// interleaved (or applied, for a delta) into the destination while they are in cache. zstd's
// batch API decodes into fresh buffers instead: on the CPU machine half of that call's CPU time
// was the kernel zero-filling their pages, and the interleave read them back from memory.
//
// Plain C ABI, no Python headers: loaded with ctypes, which releases the GIL during the call.
// Built by setup.py as an optional extension; without it nvdcp/codecs/zstd.py compresses each
// range from Python through the same cffi functions, or with the C binding's batch API.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <thread>
#include <vector>

namespace {

using CreateFn = void* (*)();
using FreeFn = size_t (*)(void*);
using SetParameterFn = size_t (*)(void*, int, int);
using Compress2Fn = size_t (*)(void*, void*, size_t, const void*, size_t);
using IsErrorFn = unsigned (*)(size_t);

struct ZstdApi {
  CreateFn create;
  FreeFn free_context;
  SetParameterFn set_parameter;
  Compress2Fn compress2;
  IsErrorFn is_error;
};

// Ranges are handed out in runs of this many, so threads stay busy on uneven sizes without
// contending on the counter for every small range.
constexpr int64_t kRangesPerClaim = 16;

// run(job) on this thread and on up to threads - 1 more, no more than there are claims of
// `per_claim` of the `items` to go round; the threads share the job's work through its counter.
// A thread that cannot be started is done without: the others, this one at least, take its share.
template <typename Work>
void on_threads(void (*run)(Work*), Work* job, int threads, int64_t items, int64_t per_claim) {
  const int64_t useful = (items + per_claim - 1) / per_claim;
  int workers = threads < 1 ? 1 : threads;
  if (workers > useful) workers = useful < 1 ? 1 : static_cast<int>(useful);
  std::vector<std::thread> pool;
  try {
    pool.reserve(static_cast<size_t>(workers));
    for (int t = 1; t < workers; ++t) pool.emplace_back(run, job);
  } catch (...) {
  }
  run(job);
  for (auto& thread : pool) thread.join();
}

struct Job {
  const ZstdApi* api;
  const int32_t* params;
  int64_t n_params;
  const uint8_t* src;
  const int64_t* src_off;
  const int64_t* src_len;
  uint8_t* dst;
  const int64_t* dst_off;
  const int64_t* dst_cap;
  int64_t* out_len;
  int64_t n;
  std::atomic<int64_t> next{0};
  std::atomic<int> failed{0};
};

void run(Job* job) {
  const ZstdApi& api = *job->api;
  void* context = api.create();
  if (context == nullptr) {
    job->failed.store(1);
    return;
  }
  for (int64_t p = 0; p < job->n_params; ++p) {
    if (api.is_error(api.set_parameter(context, job->params[2 * p], job->params[2 * p + 1]))) {
      job->failed.store(1);
      api.free_context(context);
      return;
    }
  }
  for (;;) {
    const int64_t start = job->next.fetch_add(kRangesPerClaim);
    if (start >= job->n) break;
    const int64_t stop = start + kRangesPerClaim < job->n ? start + kRangesPerClaim : job->n;
    for (int64_t i = start; i < stop; ++i) {
      const size_t written = api.compress2(context, job->dst + job->dst_off[i], static_cast<size_t>(job->dst_cap[i]),
                                           job->src + job->src_off[i], static_cast<size_t>(job->src_len[i]));
      job->out_len[i] = api.is_error(written) ? -1 : static_cast<int64_t>(written);
    }
  }
  api.free_context(context);
}

// -- decoding --------------------------------------------------------------------------------
using DecompressFn = size_t (*)(void*, void*, size_t, const void*, size_t);
using FrameSizeFn = size_t (*)(const void*, size_t);
using ContentSizeFn = unsigned long long (*)(const void*, size_t);
using MergeFn = int (*)(const uint8_t* const*, int64_t, int, uint8_t*);
using MergeApplyFn = int (*)(const int64_t*, const int64_t*, const int64_t*, int64_t, int, int, int);

constexpr int kMaxPlanes = 16;
constexpr int64_t kMaxPlaneBytes = int64_t{1} << 20;  // a block's bytes per plane (the format's are <= 64 KiB)
// Blocks are handed out in runs of this many (a block is at most 64 KiB a plane).
constexpr int64_t kBlocksPerClaim = 4;

struct DecodeJob {
  CreateFn create;
  FreeFn free_context;
  DecompressFn decompress;
  IsErrorFn is_error;
  FrameSizeFn frame_size;        // ZSTD_findFrameCompressedSize
  ContentSizeFn content_size;    // ZSTD_getFrameContentSize
  MergeFn merge;
  MergeApplyFn merge_apply;
  const int64_t* chunks;  // count * e chunk addresses, block-major
  const int64_t* stored;  // their stored sizes
  const uint8_t* coded;   // 1: a zstd frame; 0: the plane's raw bytes
  const int64_t* ns;      // bytes per plane of each block
  const int64_t* dsts;    // each block's destination (ns[i] * e bytes)
  int64_t count;
  int e;
  int kind;  // -1: write the elements; else apply them as a delta of this kind (nvdcp_merge_apply_many)
  int w;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> first_bad{-1};  // lowest block found not to decode
};

void note_bad(DecodeJob* job, int64_t block) {
  int64_t seen = job->first_bad.load();
  while ((seen < 0 || block < seen) && !job->first_bad.compare_exchange_weak(seen, block)) {
  }
}

constexpr uint32_t kZstdMagic = 0xFD2FB528u;

// Decode the chunk `src` (`size` bytes) into `n` bytes at `out` as the codecs' batch path
// (zstandard's multi_decompress_to_buffer) accepts it: one zstd frame at the start, declaring
// content size n; bytes after that frame are not read. False for anything else (a skippable or
// unknown frame first, no or another content size, a frame that does not decode to n bytes).
bool decode_frame(const DecodeJob& job, void* context, const uint8_t* src, size_t size, uint8_t* out, size_t n) {
  if (size < 4) return false;
  uint32_t magic;
  std::memcpy(&magic, src, 4);
  if (magic != kZstdMagic) return false;  // little-endian hosts (what nvdcp builds for)
  const size_t frame = job.frame_size(src, size);
  if (job.is_error(frame) || frame > size) return false;
  if (job.content_size(src, frame) != static_cast<unsigned long long>(n)) return false;
  const size_t got = job.decompress(context, out, n, src, frame);
  return !job.is_error(got) && got == n;
}

// One block: its planes decoded (or taken raw) and interleaved into place. False: a frame did not
// decode to the plane's size (decode_frame), or a raw chunk is not that size.
bool decode_block(const DecodeJob& job, void* context, int64_t i, uint8_t* scratch) {
  const int e = job.e;
  const size_t n = static_cast<size_t>(job.ns[i]);
  const uint8_t* rows[kMaxPlanes];
  for (int p = 0; p < e; ++p) {
    const int64_t c = i * e + p;
    const uint8_t* src = reinterpret_cast<const uint8_t*>(job.chunks[c]);
    if (job.stored[c] < 0) return false;
    const size_t size = static_cast<size_t>(job.stored[c]);
    if (job.coded[c]) {
      uint8_t* out = scratch + static_cast<size_t>(p) * n;
      if (!decode_frame(job, context, src, size, out, n)) return false;
      rows[p] = out;
    } else {
      if (size != n) return false;
      rows[p] = static_cast<const uint8_t*>(src);
    }
  }
  if (job.kind < 0) return job.merge(rows, static_cast<int64_t>(n), e, reinterpret_cast<uint8_t*>(job.dsts[i])) == 0;
  int64_t planes[kMaxPlanes];
  for (int p = 0; p < e; ++p) planes[p] = reinterpret_cast<int64_t>(rows[p]);
  const int64_t ns = static_cast<int64_t>(n);
  return job.merge_apply(planes, &ns, job.dsts + i, 1, e, job.kind, job.w) == 0;
}

// A thread's decode scratch, uninitialized (nothing reads it before a frame is decoded there).
// The calling thread's is kept across calls (a reader thread decodes batch after batch): its pages
// are not faulted in again for every batch; a worker started for one call has its own.
struct Scratch {
  std::unique_ptr<uint8_t[]> data;
  size_t size = 0;
  uint8_t* at_least(size_t need) {
    if (size < need) {
      data.reset(new (std::nothrow) uint8_t[need]);
      size = data ? need : 0;
    }
    return data.get();
  }
};

void decode_run(DecodeJob* job) noexcept {
  void* context = job->create();
  if (context == nullptr) return;  // the other threads take the blocks
  thread_local Scratch scratch;
  for (;;) {
    const int64_t start = job->next.fetch_add(kBlocksPerClaim);
    if (start >= job->count) break;
    const int64_t stop = start + kBlocksPerClaim < job->count ? start + kBlocksPerClaim : job->count;
    for (int64_t i = start; i < stop; ++i) {
      // the callers' blocks are at most 64 KiB a plane; anything else is refused, not allocated
      uint8_t* room = job->ns[i] < 0 || job->ns[i] > kMaxPlaneBytes
          ? nullptr : scratch.at_least(static_cast<size_t>(job->ns[i]) * static_cast<size_t>(job->e) + 1);
      if (room == nullptr || !decode_block(*job, context, i, room)) note_bad(job, i);
    }
  }
  job->free_context(context);
}

}  // namespace

extern "C" {

// Decode `count` blocks of `e` planes each. `functions`: the addresses of ZSTD_createDCtx,
// ZSTD_freeDCtx, ZSTD_decompressDCtx, ZSTD_isError, ZSTD_findFrameCompressedSize and
// ZSTD_getFrameContentSize (the cffi backend's, as above), then of nvdcp_merge_planes and
// nvdcp_merge_apply_many (nvdcp/format/_crc32c_batch.cpp), in that order.
// Plane p of block i is chunk i * e + p: `stored[c]` bytes at address `chunks[c]`, a zstd frame of
// `ns[i]` bytes where `coded[c]`, else those bytes raw. The planes are interleaved into ns[i]
// elements of e bytes at address dsts[i] (kind -1), or applied there as a delta of `kind` over
// w-byte elements (nvdcp_merge_apply_many's kinds). On up to `threads` threads. Returns 0; -1 for
// bad arguments or when a decoding context could not be made (nothing written then); i + 1 when
// block i (the lowest such) did not decode to its size (other blocks may have been written).
int64_t nvdcp_zstd_decode_blocks(const void* const* functions, const int64_t* chunks, const int64_t* stored,
                                 const uint8_t* coded, const int64_t* ns, const int64_t* dsts, int64_t count, int e,
                                 int kind, int w, int threads) noexcept {
  if (e < 1 || e > kMaxPlanes || count < 0) return -1;
  if (kind < -1 || kind > 1 || (kind == 1 && w != 2 && w != 4 && w != 8)) return -1;  // merge_apply's kinds
  if (count == 0) return 0;
  DecodeJob job;
  job.create = reinterpret_cast<CreateFn>(functions[0]);
  job.free_context = reinterpret_cast<FreeFn>(functions[1]);
  job.decompress = reinterpret_cast<DecompressFn>(functions[2]);
  job.is_error = reinterpret_cast<IsErrorFn>(functions[3]);
  job.frame_size = reinterpret_cast<FrameSizeFn>(functions[4]);
  job.content_size = reinterpret_cast<ContentSizeFn>(functions[5]);
  job.merge = reinterpret_cast<MergeFn>(functions[6]);
  job.merge_apply = reinterpret_cast<MergeApplyFn>(functions[7]);
  job.chunks = chunks;
  job.stored = stored;
  job.coded = coded;
  job.ns = ns;
  job.dsts = dsts;
  job.count = count;
  job.e = e;
  job.kind = kind;
  job.w = w;
  on_threads(decode_run, &job, threads, count, kBlocksPerClaim);
  if (job.next.load() == 0) return -1;  // no thread could make a context: no block was claimed
  const int64_t bad = job.first_bad.load();
  return bad < 0 ? 0 : bad + 1;
}

// `functions`: the addresses of ZSTD_createCCtx, ZSTD_freeCCtx, ZSTD_CCtx_setParameter,
// ZSTD_compress2 and ZSTD_isError, in that order. `params`: `n_params` (ZSTD_cParameter, value)
// pairs set on each thread's context. Range i (`src_len[i]` bytes at `src + src_off[i]`) becomes
// one frame at `dst + dst_off[i]` (at most `dst_cap[i]` bytes); `out_len[i]` gets its size, or
// -1 if zstd reported an error for it. Then, unless a range failed, the frames are moved down to
// lie back to back from `dst` in range order (one pass on this thread: the caller gets one
// buffer, not a copy per frame). Returns the frames' total size, -1 when a context could not be
// made or a parameter was refused, -2 when zstd failed on a range (its `out_len` is -1).
int64_t nvdcp_zstd_compress_ranges(const void* const* functions, const int32_t* params, int64_t n_params,
                               const uint8_t* src, const int64_t* src_off, const int64_t* src_len, uint8_t* dst,
                               const int64_t* dst_off, const int64_t* dst_cap, int64_t* out_len, int64_t n,
                               int threads) {
  const ZstdApi api{reinterpret_cast<CreateFn>(functions[0]), reinterpret_cast<FreeFn>(functions[1]),
                    reinterpret_cast<SetParameterFn>(functions[2]), reinterpret_cast<Compress2Fn>(functions[3]),
                    reinterpret_cast<IsErrorFn>(functions[4])};
  Job job;
  job.api = &api;
  job.params = params;
  job.n_params = n_params;
  job.src = src;
  job.src_off = src_off;
  job.src_len = src_len;
  job.dst = dst;
  job.dst_off = dst_off;
  job.dst_cap = dst_cap;
  job.out_len = out_len;
  job.n = n;
  on_threads(run, &job, threads, n, kRangesPerClaim);
  if (job.failed.load()) return -1;
  int64_t packed = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (out_len[i] < 0) return -2;
    // packed <= dst_off[i]: each frame moves down, never over one not yet moved
    if (packed != dst_off[i]) std::memmove(dst + packed, dst + dst_off[i], static_cast<size_t>(out_len[i]));
    packed += out_len[i];
  }
  return packed;
}

}  // extern "C"
