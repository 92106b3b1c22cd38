// Inter-CTA and inter-GPU signalling for the persistent megakernel.
//
// * Flags are 64-bit and tagged: tag(epoch, seq) = epoch << 32 | seq. A launch reads its epoch
//   from the control block; flags only grow, so values left by earlier launches are always
//   smaller than anything a later launch waits for, and nothing is reset between launches.
// * Cross-GPU flags use system-scope release stores / acquire loads; flags private to one rank's
//   CTAs use gpu scope.
// * Every wait is bounded: after `timeout_ns` (%globaltimer) the waiting CTA records which rank,
//   stage and peer stalled in the sticky ErrorRecord, raises the launch's abort flag, and every
//   CTA leaves through the common exit. The host reads the record and raises a clear error.
// * Fault injection (tests only; docs/architecture.md, "Fault injection"): a build compiled with
//   -DMOKGEN_FAULT_STAGE=N (mokgen.build.fault_flags, N = 2..6) leaves out the one signal whose
//   absence makes the waits of Stage N time out; each such edit sits in an
//   `#if defined(MOKGEN_FAULT_STAGE) && MOKGEN_FAULT_STAGE == N` block, so default builds are
//   the same machine code. tests/test_gpu_faults.py launches each and checks the error.
#pragma once

#include "common.cuh"

#if defined(MOKGEN_FAULT_STAGE) && !(MOKGEN_FAULT_STAGE >= 2 && MOKGEN_FAULT_STAGE <= 6)
#error "MOKGEN_FAULT_STAGE must be a wait stage from 2 to 6 (sync.cuh, enum Stage); stage 1 is EpParams.silent_rank"
#endif

namespace mokgen {

enum Stage : int {
  kStageNone = 0,
  kStageRoutingReady = 1,   // waiting for a peer's routing tables (its prologue)
  kStageRankBarrier = 2,    // waiting for the CTAs of one's own rank
  kStageRingFree = 3,       // dispatch waiting for a free ring slot
  kStageChunkLanded = 4,    // compute waiting for pulled rows
  kStageCombineDone = 5,    // owner waiting for a peer's pushes
  kStageBlockReady = 6,     // a down tile waiting for the up projection of its row block
};

struct ErrorRecord {       // sticky: the first failure of any launch; cleared by the host
  int code;                // 0 = ok, 1 = timeout
  int rank;                // the rank that waited
  int stage;               // Stage
  int peer;                // the rank (or -1: own CTAs) it waited for
  unsigned long long epoch;
};

// One per launch (virtual ranks) or per rank (real GPUs); zeroed once at allocation.
struct Control {
  unsigned long long epoch;     // last finished launch
  unsigned int finished;        // CTAs of the current launch that reached the exit
  unsigned int abort;           // set on the first timeout of the current launch
  ErrorRecord error;
};

MOKGEN_HOST_DEVICE constexpr unsigned long long tag(unsigned long long epoch, unsigned long long seq) {
  return (epoch << 32) | seq;
}

MOKGEN_DEVICE unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

MOKGEN_DEVICE unsigned long long ld_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
MOKGEN_DEVICE unsigned long long ld_acquire_gpu(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
MOKGEN_DEVICE void st_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
MOKGEN_DEVICE void st_release_gpu(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
MOKGEN_DEVICE unsigned int ld_volatile_u32(const unsigned int* p) {
  return *reinterpret_cast<const volatile unsigned int*>(p);
}

// Waits on peers (kSys) get the launch's timeout; waits on one's own CTAs get twice that, so a
// missing peer is reported by the CTA that waited for it, not by the CTAs queued behind it.
struct Waiter {
  Control* ctl;
  long long timeout_ns;
  unsigned long long epoch;
  int rank;

  MOKGEN_DEVICE bool aborted() const { return ld_volatile_u32(&ctl->abort) != 0; }

  MOKGEN_DEVICE void fail(int stage, int peer) const {
    if (atomicCAS(&ctl->error.code, 0, 1) == 0) {
      ctl->error.rank = rank;
      ctl->error.stage = stage;
      ctl->error.peer = peer;
      ctl->error.epoch = epoch;
    }
    __threadfence();
    atomicExch(&ctl->abort, 1u);
  }

  // Single-thread wait for *flag >= target. Returns false on timeout or abort.
  template <bool kSys>
  MOKGEN_DEVICE bool wait_geq(const unsigned long long* flag, unsigned long long target, int stage, int peer) const {
    const unsigned long long start = globaltimer_ns();
    for (unsigned it = 0;; ++it) {
      const unsigned long long v = kSys ? ld_acquire_sys(flag) : ld_acquire_gpu(flag);
      if (v >= target) return true;
      if ((it & 63) == 63) {
        if (aborted()) return false;
        if ((long long)(globaltimer_ns() - start) > (kSys ? timeout_ns : 2 * timeout_ns)) {
          fail(stage, peer);
          return false;
        }
      }
      __nanosleep(32);
    }
  }
};

// Barrier among `n` CTAs sharing a 64-bit arrival counter that only grows: the b-th barrier of
// launch `epoch` completes when the counter reaches tag(epoch, b * n). The counter of a group is
// re-based at the start of each launch by the last CTA of the previous launch (see Control).
// Call from all threads of each CTA; returns false (in every thread) on timeout/abort.
MOKGEN_DEVICE bool group_barrier(unsigned long long* counter, unsigned long long target, const Waiter& w, int* smem_flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
#if defined(MOKGEN_FAULT_STAGE) && MOKGEN_FAULT_STAGE == 2
    // fault build: the first CTA of rank 0 never arrives at any barrier of its rank (it still waits)
    if (w.rank != 0 || blockIdx.x != 0)
#endif
    atomicAdd(counter, 1ull);
    *smem_flag = w.wait_geq<false>(counter, target, kStageRankBarrier, -1) ? 1 : 0;
    __threadfence();
  }
  __syncthreads();
  return *smem_flag != 0;
}

}  // namespace mokgen
