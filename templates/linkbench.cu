// templates/linkbench.cu (mokgen): the NVLink link microbenchmark's C-ABI launcher library.
// Not a Jinja template: mokgen/linkbench.py compiles this file as it is into
// <cache>/<version>/sm_90a/linkbench-<key12>/liblinkbench.so; do not edit the cached copy.
//
// No torch headers: Python passes raw device pointers (torch symmetric memory, peers' buffers
// included) and the current CUDA stream. Every entry point returns a cudaError_t code (0 = ok);
// argument mistakes are cudaErrorInvalidValue. Device logic lives in mokgen/linkbench.cuh.
#include "mokgen/linkbench.cuh"

namespace {

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <int kUnroll>
cudaError_t launch_copy(void* dst, const void* src, long long bytes, int ctas, int threads,
                        unsigned long long* counter, cudaStream_t stream) {
  mokgen::link::copy_kernel<kUnroll><<<ctas, threads, 0, stream>>>(
      static_cast<uint4*>(dst), static_cast<const uint4*>(src), bytes / 16, counter);
  return cudaGetLastError();
}

}  // namespace

extern "C" {

const char* mokgen_link_error_string(int code) { return cudaGetErrorString(cudaError_t(code)); }

// `ctas` CTAs of `threads` threads copy `bytes` (a multiple of 16, both pointers 16-byte aligned)
// from src to dst with `unroll` (4 or 8) loads in flight per thread; each CTA then adds 1 to
// *counter (system-scope release), unless counter is null. bytes == 0 only signals.
int mokgen_link_copy(void* dst, const void* src, long long bytes, int ctas, int threads,
                     unsigned long long* counter, int unroll, void* stream) {
  if (bytes < 0 || bytes % 16 != 0 || ctas < 1 || threads < 32 || threads > 1024 || threads % 32 != 0)
    return int(cudaErrorInvalidValue);
  if (bytes > 0 && (dst == nullptr || src == nullptr || !aligned16(dst) || !aligned16(src)))
    return int(cudaErrorInvalidValue);
  if (counter != nullptr && (reinterpret_cast<uintptr_t>(counter) & 7u) != 0) return int(cudaErrorInvalidValue);
  const auto s = static_cast<cudaStream_t>(stream);
  switch (unroll) {
    case 4: return int(launch_copy<4>(dst, src, bytes, ctas, threads, counter, s));
    case 8: return int(launch_copy<8>(dst, src, bytes, ctas, threads, counter, s));
    default: return int(cudaErrorInvalidValue);
  }
}

// One thread waits until *counter >= target; after timeout_ns it sets *error (if still 0) to
// mokgen::link::kWaitTimeout.
int mokgen_link_wait(const unsigned long long* counter, unsigned long long target, long long timeout_ns, int* error,
                     void* stream) {
  if (counter == nullptr || error == nullptr || timeout_ns <= 0) return int(cudaErrorInvalidValue);
  mokgen::link::wait_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(counter, target, timeout_ns, error);
  return int(cudaGetLastError());
}

// `iters` timed round trips (plus one untimed handshake) between this rank and a peer: launch it
// on both, initiator = 1 on exactly one. my_flag is this rank's flag, peer_flag the peer's (its
// address as mapped here). Flag values start above `base`; the next call must pass
// base + 2 * (iters + 1). The initiator writes the ns of the timed round trips to *out_ns.
int mokgen_link_pingpong(unsigned long long* my_flag, unsigned long long* peer_flag, int iters, int initiator,
                         unsigned long long base, long long timeout_ns, unsigned long long* out_ns, int* error,
                         void* stream) {
  if (my_flag == nullptr || peer_flag == nullptr || error == nullptr || iters < 1 || timeout_ns <= 0 ||
      (initiator && out_ns == nullptr))
    return int(cudaErrorInvalidValue);
  mokgen::link::pingpong_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(
      my_flag, peer_flag, iters, initiator, base, timeout_ns, out_ns, error);
  return int(cudaGetLastError());
}

}  // extern "C"
