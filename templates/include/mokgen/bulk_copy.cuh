// Row copies through the TMA's bulk-copy engine (sm_90): the dispatch's `pull_mode` "bulk"
// (ep_forward.cuh). One thread moves a list of rows (each kRowBytes, 16-byte aligned, from any
// global address, a peer GPU's over NVLink included) into contiguous global rows, staged through
// shared memory: cp.async.bulk global -> shared completes on an mbarrier per stage (transaction
// bytes), cp.async.bulk shared -> global goes out in bulk groups. One thread keeps up to
// kStages stages of loads in flight (the whole free shared memory of the CTA) with a handful of
// instructions per row, where the copy by load/store instructions holds 16 bytes per register
// quad of every thread.
#pragma once

#include "common.cuh"

namespace mokgen {
namespace bulk {

MOKGEN_DEVICE void bar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)) : "memory");
}
MOKGEN_DEVICE void bar_inval(uint64_t* bar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(smem_u32(bar)) : "memory");
}
MOKGEN_DEVICE void bar_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
MOKGEN_DEVICE void bar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
// bytes from global src into this CTA's shared memory at dst; completes `bytes` on bar
MOKGEN_DEVICE void load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
// bytes from this CTA's shared memory at src to global dst, in the current bulk group
MOKGEN_DEVICE void store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_u32(src)), "r"(bytes)
               : "memory");
}
MOKGEN_DEVICE void commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// at most N bulk groups still reading shared memory
template <int N>
MOKGEN_DEVICE void wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
// every bulk group complete: its writes performed and visible to this thread
MOKGEN_DEVICE void wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Stage geometry for rows of kRowBytes in kBufBytes of shared memory: stages of whole rows, at
// least 16 KB each where a row is smaller, at most 16 stages.
template <int kRowBytes, size_t kBufBytes>
struct Stages {
  static_assert(kRowBytes % 16 == 0, "bulk copies move multiples of 16 bytes");
  static constexpr int kRows = kRowBytes >= 16384 ? 1 : 16384 / kRowBytes;  // rows per stage
  static constexpr int kBytes = kRows * kRowBytes;
  static constexpr int kFit = int(kBufBytes / kBytes);
  static constexpr int kCount = kFit > 16 ? 16 : kFit;
  static_assert(kCount >= 2, "the bulk row copy needs two stages of shared memory");
};

// One thread: rows from[0 .. n) (kRowBytes each) -> to[0 .. n) (contiguous). smem: one 8-byte
// mbarrier per stage, 16 of them (bars, 8-byte aligned) and the stage buffers (buf, 128-byte aligned).
// Returns after every row has been written (wait_all), so a release by this thread that follows
// publishes them. The barriers are initialized and invalidated here: the memory is free again
// afterwards.
template <int kRowBytes, size_t kBufBytes>
MOKGEN_DEVICE void copy_rows(const void* const* from, unsigned char* to, int n, uint64_t* bars, unsigned char* buf) {
  using St = Stages<kRowBytes, kBufBytes>;
  constexpr int kS = St::kCount, kR = St::kRows;
  const int n_st = (n + kR - 1) / kR;
  if (n_st == 0) return;
  for (int s = 0; s < kS; ++s) bar_init(&bars[s]);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  auto issue = [&](int j) {  // loads of stage j into buffer j % kS
    const int s = j % kS, r0 = j * kR, nr = min(kR, n - r0);
    unsigned char* b = buf + size_t(s) * St::kBytes;
    bar_expect(&bars[s], uint32_t(nr) * kRowBytes);
    for (int r = 0; r < nr; ++r) load(b + r * kRowBytes, from[r0 + r], kRowBytes, &bars[s]);
  };
  for (int j = 0; j < kS && j < n_st; ++j) issue(j);
  for (int j = 0; j < n_st; ++j) {
    const int s = j % kS, nr = min(kR, n - j * kR);
    bar_wait(&bars[s], uint32_t(j / kS) & 1u);
    store(to + size_t(j) * St::kBytes, buf + size_t(s) * St::kBytes, uint32_t(nr) * kRowBytes);
    commit();
    // refill the buffer whose store went out one step ago (it has had a step to read it)
    if (j >= 1 && j - 1 + kS < n_st) {
      wait_read<1>();
      issue(j - 1 + kS);
    }
  }
  wait_all();
  for (int s = 0; s < kS; ++s) bar_inval(&bars[s]);
}

}  // namespace bulk
}  // namespace mokgen
