// Trace builds of the forward megakernel only (-DMOKGEN_FWD_TRACE; .ci/fwd_trace.py builds one
// and reads it). Every other build compiles none of this: MOKGEN_FWD_TRACE_ONLY(...) is empty.
//
// The buffer (int64, set by moe_forward.cu's mokgen_fwd_set_trace) holds, per CTA of the launch,
// g_tiles + 1 records of kRoles x kFields values. Record i < g_tiles is the CTA's i-th tile (a
// dispatch CTA: its i-th chunk), record g_tiles the CTA's phases:
//   role 0 (the producer thread)
//     [0] globaltimer at the tile's start  [1] clock64 at its start  [2] clock64 after its
//     dependency waits (chunk landed; down tiles: the row block's up tiles)  [3] clock64 after
//     its last load was issued  [4] kind  [5] chunk  [6] rows | n << 16 | m << 32  [7] cycles
//     waiting for empty stages
//   roles 1, 2 (consumer warpgroups)
//     [0] globaltimer at the tile's start  [1] clock64 at its start  [2] clock64 after the last
//     wgmma retired  [3] clock64 after the epilogue  [4] cycles waiting for full stages
//     [5] clock64 after the signal handshake  [6] kind  [7] rows
//   dispatch CTAs, role 0 of chunk c's record: [0] globaltimer at the chunk's start  [1] after its
//     ring slot was free  [2] after this CTA's part of it landed
//   phase record, role 0: [0] globaltimer at the kernel's start  [1] at the compute roles' start
//     (after the chunk-0 pull and the pipeline set-up)  [2] at the compute roles' end  [3] at the
//     combine's start  [4] at its end  [5] 1 for a dispatch CTA  [6] 1: the producer records
//     carry the tile's row (m << 32 in their [6])
//   phase record, role 1 (the signaller of a compute CTA): [0] cycles waiting for the consumers'
//     handshakes  [1] cycles publishing (fence and counters)  [2] the most of one tile  [3] tiles
// Consumer values are staged in shared memory during the tile (stage: one shared store; a global
// address computed in the consumers' loop cost them a spill) and written to the records by the
// signaller thread (flush_consumers, after the tile's handshake; the clock after the handshake,
// [5], which is staged after it, one tile later, and the last tile's after the compute roles'
// end). Every consumer thread stages (the same slots, no branch on the thread index: ptxas
// serializes the wgmma of a kernel whose consumers branch on it). The staging ring is twice as
// deep as the signal ring: a consumer warpgroup starts tile i only after the signaller has handled
// tile i - 1 - kSig.
#pragma once

#include "common.cuh"

#ifdef MOKGEN_FWD_TRACE
#define MOKGEN_FWD_TRACE_ONLY(...) __VA_ARGS__

namespace mokgen {
namespace fwd_trace {

constexpr int kRoles = 3, kFields = 8;
__device__ long long* g_buf = nullptr;
__device__ int g_tiles = 0;
// Handed from hopper_gemm.cuh's loops to their callers, per role: the clock after the last
// wgmma (consumers) and the cycles of stage waits in the last tile.
__shared__ long long s_kloop_end[kRoles], s_waited[kRoles];
// The consumer warpgroups' staged fields (roles 1 and 2), by tile i % kStage.
constexpr int kStage = 8;
__shared__ long long s_stage[kStage][2][kFields];

MOKGEN_DEVICE long long clock() { return clock64(); }

// The low 32 bits of the SM clock, for the waits summed inside the k-loops: one register each
// (a tile's waits are far below 2^32 cycles).
MOKGEN_DEVICE unsigned clock32() {
  unsigned t;
  asm volatile("mov.u32 %0, %%clock;" : "=r"(t));
  return t;
}

MOKGEN_DEVICE unsigned long long timer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The buffer and its tile count are read at each stamp (volatile): hoisted out of the tile loop
// they would hold three registers across the consumers' k-loop, which has none to spare.
MOKGEN_DEVICE long long* buffer() { return *const_cast<long long* volatile*>(&g_buf); }
MOKGEN_DEVICE int tiles() { return *const_cast<volatile int*>(&g_tiles); }

// This CTA's record i of `role` in buffer buf of n traced tiles per CTA (buf not null).
MOKGEN_DEVICE long long* record_in(long long* buf, int n, int i, int role) {
  return buf + ((int64_t(blockIdx.x) * (n + 1) + i) * kRoles + role) * kFields;
}

// The record of tile i (i == tiles(): the phase record) and role, or null without a buffer.
MOKGEN_DEVICE long long* record(int i, int role) {
  long long* buf = buffer();
  return buf == nullptr ? nullptr : record_in(buf, tiles(), i, role);
}

// Tile i's record of `role`, or null (past the traced tiles, or no buffer): a role that writes
// several fields of a tile locates the record once and writes them with set().
MOKGEN_DEVICE long long* tile_record(int i, int role) {
  long long* buf = buffer();
  const int n = tiles();  // read once (record() would read both again)
  return buf == nullptr || i >= n ? nullptr : record_in(buf, n, i, role);
}
MOKGEN_DEVICE void set(long long* r, int field, long long v) {
  if (r != nullptr) r[field] = v;
}

// Field `field` of tile i's record (tiles past the traced ones are not recorded).
MOKGEN_DEVICE void put(int i, int role, int field, long long v) {
  if (i < tiles())
    if (long long* r = record(i, role)) r[field] = v;
}

// Stage field `field` of tile i's record of consumer role `role` (1 or 2).
MOKGEN_DEVICE void stage(int i, int role, int field, long long v) { s_stage[i % kStage][role - 1][field] = v; }

// Write both consumer roles' staged fields of tile i (all but [5]) and [5] of tile i - 1 (the
// signaller, once it has acquired tile i's handshake); last: [5] of tile i only. The buffer and
// its tile count are read once per call: put() per field read them 16 times per tile, dependent
// global loads in the signaller thread, whose reads of the tile queue the walker's claims wait for
// (docs/perf-notes.md v0.46: the trace build's own cost in the down tiles' "gap").
MOKGEN_DEVICE void flush_consumers(int i, bool last = false) {
  long long* buf = buffer();
  const int n = tiles();
  if (buf == nullptr) return;
  auto rec = [&](int t, int role) { return record_in(buf, n, t, role); };
  for (int role = 1; role <= 2; ++role) {
    const long long* st = s_stage[i % kStage][role - 1];
    if (last) {
      if (i < n) rec(i, role)[5] = st[5];
      continue;
    }
    if (i < n) {
      long long* r = rec(i, role);
      for (int f = 0; f < kFields; ++f)
        if (f != 5) r[f] = st[f];
    }
    if (i > 0 && i - 1 < n) rec(i - 1, role)[5] = s_stage[(i - 1) % kStage][role - 1][5];
  }
}

MOKGEN_DEVICE void phase(int field, long long v, int role = 0) {
  if (long long* r = record(tiles(), role)) r[field] = v;
}

}  // namespace fwd_trace
}  // namespace mokgen
#else
#define MOKGEN_FWD_TRACE_ONLY(...)
#endif
