// Calls nvCOMP's CPU GDeflate decompressor and turns the C++ exception it throws on a malformed
// stream into a return code. Without this frame the exception unwinds into ctypes, finds no
// handler and std::terminate aborts the whole process (docs/SECURITY.md).
//
// Plain C ABI, no Python headers: nvdcp/codecs/gdeflate.py loads it with ctypes. Built by
// setup.py as an optional extension; when it is missing, gdeflate.py calls nvCOMP directly.
#include <cstddef>
#include <cstring>
#include <exception>

namespace {
// nvcomp::gdeflate::decompressCPU(const void* const*, const size_t*, size_t, void* const*,
//                                 size_t*, size_t*) from include/nvcomp/native/gdeflate_cpu.h
using decompress_fn = void (*)(const void* const*, const size_t*, size_t, void* const*, size_t*, size_t*);

void copy_message(const char* what, char* err, size_t err_len) {
  if (err_len == 0) return;
  std::strncpy(err, what, err_len - 1);
  err[err_len - 1] = '\0';
}
}  // namespace

extern "C" int nvdcp_gdeflate_decompress(void* fn, const void* const* in_ptrs, const size_t* in_sizes,
                                         size_t n, void* const* out_ptrs, size_t* capacities,
                                         size_t* actual, char* err, size_t err_len) noexcept {
  try {
    reinterpret_cast<decompress_fn>(fn)(in_ptrs, in_sizes, n, out_ptrs, capacities, actual);
    return 0;
  } catch (const std::exception& e) {
    copy_message(e.what(), err, err_len);
    return 1;
  } catch (...) {
    copy_message("unknown C++ exception", err, err_len);
    return 2;
  }
}
