// mokgen device helpers shared by every kernel: bf16 packing, cp.async, ldmatrix and mma.sync
// wrappers. Hand-written and readable; templates include this header, they never copy it.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#define MOKGEN_DEVICE __device__ __forceinline__
#define MOKGEN_HOST_DEVICE __host__ __device__ __forceinline__
#define MOKGEN_STR_(x) #x
#define MOKGEN_STR(x) MOKGEN_STR_(x)

namespace mokgen {

using bf16 = __nv_bfloat16;

MOKGEN_HOST_DEVICE constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
MOKGEN_HOST_DEVICE constexpr size_t align_up(size_t a, size_t b) { return (a + b - 1) / b * b; }

// ---- shared-memory address of a generic pointer (for PTX operands) ---------------------------
MOKGEN_DEVICE uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- cp.async: 16 bytes global -> shared; src_bytes 0 fills zeros --------------------------
// x, hidden from the optimizer: a value derived from it is computed again rather than kept.
MOKGEN_DEVICE int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

MOKGEN_DEVICE void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem_dst)),
               "l"(gmem_src), "r"(src_bytes)
               : "memory");
}
MOKGEN_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
MOKGEN_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- ldmatrix: four 8x8 b16 matrices, one row address per lane -----------------------------
MOKGEN_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(smem_row)));
}

// ---- mma.sync m16n8k16, bf16 inputs, fp32 accumulators --------------------------------------
MOKGEN_DEVICE void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- bf16 packing -----------------------------------------------------------------------------
MOKGEN_DEVICE uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Eight bf16 in one 16-byte word <-> eight floats.
MOKGEN_DEVICE void unpack_bf16x8(const uint4& w, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&w);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 v = __bfloat1622float2(h[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}
MOKGEN_DEVICE uint4 pack_bf16x8(const float (&f)[8]) {
  uint4 w;
  w.x = pack_bf16x2(f[0], f[1]);
  w.y = pack_bf16x2(f[2], f[3]);
  w.z = pack_bf16x2(f[4], f[5]);
  w.w = pack_bf16x2(f[6], f[7]);
  return w;
}

// ---- SwiGLU with the optional clamp (gate <= L, -L <= up <= L), fp32 ----------------------------
// silu(gate) * up with the fast division (__fdividef: within 2 ulp; a zero where the divisor
// passes 2^126, a gate below about -87, whose true quotient is below 2^-119 in magnitude). The
// IEEE division cost about ten instructions and a range check per element, 64 elements per
// consumer thread and up tile: the up epilogue took 3x the down epilogue's cycles
// (docs/perf-notes.md v0.15).
template <bool kHasClamp>
MOKGEN_DEVICE float swiglu(float gate, float up, float limit) {
  if constexpr (kHasClamp) {
    gate = fminf(gate, limit);
    up = fminf(fmaxf(up, -limit), limit);
  }
  return __fdividef(gate, 1.0f + __expf(-gate)) * up;
}

// Exclusive prefix sum over the kThreads threads of a block: thread tid's `local` value, given
// the sum of the values of threads 0 .. tid - 1 (Hillis-Steele over `scratch`, kThreads int32 of
// shared memory, which the caller may reuse after its next __syncthreads). Every thread of the block calls
// it. total, where given, gets the sum over all threads. (The routing's send offsets and the
// receive plan's row bases, ep_routing.cuh and ep_forward.cuh.)
template <int kThreads>
MOKGEN_DEVICE int32_t block_exclusive_scan(int32_t local, int32_t* scratch, int32_t* total = nullptr) {
  const int tid = threadIdx.x;
  scratch[tid] = local;
  __syncthreads();
  for (int d = 1; d < kThreads; d <<= 1) {
    const int32_t v = tid >= d ? scratch[tid - d] : 0;
    __syncthreads();
    scratch[tid] += v;
    __syncthreads();
  }
  const int32_t inclusive = scratch[tid];
  if (total != nullptr) *total = scratch[kThreads - 1];
  return inclusive - local;
}

}  // namespace mokgen
