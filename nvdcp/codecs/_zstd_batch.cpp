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
// Plain C ABI, no Python headers: loaded with ctypes, which releases the GIL during the call.
// Built by setup.py as an optional extension; without it nvdcp/codecs/zstd.py compresses each
// range from Python through the same cffi functions, or with the C binding's batch API.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
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

}  // namespace

extern "C" {

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
  int64_t useful = (n + kRangesPerClaim - 1) / kRangesPerClaim;
  int workers = threads < 1 ? 1 : threads;
  if (workers > useful) workers = useful < 1 ? 1 : static_cast<int>(useful);
  std::vector<std::thread> pool;
  for (int t = 1; t < workers; ++t) pool.emplace_back(run, &job);
  run(&job);
  for (auto& thread : pool) thread.join();
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
