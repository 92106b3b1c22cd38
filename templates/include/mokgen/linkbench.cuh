// NVLink link microbenchmark: the device side of mokgen/linkbench.py (templates/linkbench.cu
// exports it). Three kernels:
//
// * copy:     `grid` CTAs move `bytes` from src to dst in 16-byte words, then each CTA signals
//             one system-scope release add on a 64-bit completion counter. Pull and push are the
//             same kernel: pull passes the peer's buffer as src (counter local), push passes the
//             peer's buffer as dst (counter in the peer's buffer). A copy of 0 bytes is a pure
//             signal, which the host uses as a start gate across ranks.
// * wait:     one thread spins until a counter reaches a target: the receiver side of push.
// * pingpong: one thread per rank bounces a flag to measure the one-way signal latency.
//
// Counters only grow (the host keeps the running target), so nothing is reset between runs.
// Every wait is bounded by %globaltimer; a timeout writes an error code and the kernel returns.
#pragma once

#include "sync.cuh"

namespace mokgen::link {

enum Error : int {
  kOk = 0,
  kWaitTimeout = 1,      // a counter did not reach its target (a peer never signalled)
  kPingPongTimeout = 2,  // the ping-pong partner stopped answering
};

// Vectors of 16 bytes that one warp covers contiguously; CTA ranges start on this boundary so
// no warp's 512-byte access is split between two CTAs.
constexpr long long kCtaAlignVec = 32;

MOKGEN_DEVICE void red_add_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// The data is touched once: .cg keeps it out of L1 (caching peer lines in L1 would only evict
// useful ones) and leaves L2 to do its normal job for the local side.
MOKGEN_DEVICE uint4 load_cg(const uint4* p) { return __ldcg(p); }
MOKGEN_DEVICE void store_cg(uint4* p, const uint4& v) { __stcg(p, v); }

// Spin (one thread) until *flag >= target; false after timeout_ns. No __nanosleep: the
// latency this measures is of the order of a microsecond, and a sleep would add to it. The
// timer is read only every 256 polls, to keep the poll loop tight.
MOKGEN_DEVICE bool spin_geq(const unsigned long long* flag, unsigned long long target, long long timeout_ns) {
  const unsigned long long start = globaltimer_ns();
  for (unsigned it = 0;; ++it) {
    if (ld_acquire_sys(flag) >= target) return true;
    if ((it & 255) == 255 && (long long)(globaltimer_ns() - start) > timeout_ns) return false;
  }
}

MOKGEN_DEVICE void report(int* error, int code) { atomicCAS(error, 0, code); }  // first error sticks

// End of a CTA's part: every thread fences its own stores at system scope, the barrier orders
// them before thread 0's release add, so a receiver that acquires counter == ctas * round sees
// every byte of that round. (The release alone would do, being cumulative over the barrier; the
// explicit fence costs one instruction per thread and makes the ordering obvious.)
MOKGEN_DEVICE void cta_done(unsigned long long* counter) {
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0 && counter != nullptr) red_add_release_sys(counter, 1ull);
}

// Each CTA copies one contiguous range rather than striding over the whole buffer: its signal
// then means "this slice has landed", as in the megakernel's dispatch where each CTA owns whole
// chunks, and each CTA streams sequential addresses. Within the range, each thread issues kUnroll
// independent 16-byte loads (consecutive threads on consecutive words: a warp reads 512
// contiguous bytes per load) before any store, to keep enough bytes in flight to cover the
// NVLink round trip.
template <int kUnroll>
__global__ void __launch_bounds__(1024) copy_kernel(uint4* __restrict__ dst, const uint4* __restrict__ src,
                                                    long long n_vec, unsigned long long* counter) {
  const long long per_cta = align_up(ceil_div(n_vec, gridDim.x), kCtaAlignVec);
  const long long begin = min(n_vec, per_cta * blockIdx.x);
  const long long end = min(n_vec, begin + per_cta);
  const long long step = (long long)blockDim.x * kUnroll;
  for (long long base = begin + threadIdx.x; base < end; base += step) {
    // 32-bit offsets within one step (< 1024 * kUnroll): keeps the unrolled loads within 64
    // registers (the cap of a 1024-thread CTA) without spilling
    const uint4* s = src + base;
    uint4* d = dst + base;
    const int left = (int)min(end - base, step);
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (u * (int)blockDim.x < left) v[u] = load_cg(s + u * blockDim.x);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (u * (int)blockDim.x < left) store_cg(d + u * blockDim.x, v[u]);
    }
  }
  cta_done(counter);
}

// Receiver of a push: wait until `counter` reaches `target` (launched after the copies of the
// same round on the receiver's own stream, so its end marks "every byte arrived").
__global__ void wait_kernel(const unsigned long long* counter, unsigned long long target, long long timeout_ns,
                            int* error) {
  if (!spin_geq(counter, target, timeout_ns)) report(error, kWaitTimeout);
}

// Round trips between an initiator and a responder, one thread each. Round i (0..iters) uses the
// flag values base + 2i + 1 (ping, written by the initiator into the responder's flag) and
// base + 2i + 2 (pong, the reverse); release stores, acquire polls, both at system scope. Round 0
// is a handshake outside the timing, so the responder's launch delay does not count; the
// initiator stores the %globaltimer ns of rounds 1..iters in *out_ns.
__global__ void pingpong_kernel(unsigned long long* my_flag, unsigned long long* peer_flag, int iters, int initiator,
                                unsigned long long base, long long timeout_ns, unsigned long long* out_ns, int* error) {
  unsigned long long t0 = 0;
  for (int i = 0; i <= iters; ++i) {
    if (i == 1) t0 = globaltimer_ns();
    const unsigned long long ping = base + 2ull * i + 1, pong = ping + 1;
    if (initiator) {
      st_release_sys(peer_flag, ping);
      if (!spin_geq(my_flag, pong, timeout_ns)) return report(error, kPingPongTimeout);
    } else {
      if (!spin_geq(my_flag, ping, timeout_ns)) return report(error, kPingPongTimeout);
      st_release_sys(peer_flag, pong);
    }
  }
  if (initiator) *out_ns = globaltimer_ns() - t0;
}

}  // namespace mokgen::link
