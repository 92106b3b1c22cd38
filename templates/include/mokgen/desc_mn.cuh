// The wgmma shared-memory descriptor of an MN-major operand, shared by the backward GEMMs
// (bwd_gemm.cuh) and the raw-weights MX GEMM (mx_rawb.cuh). Kept out of hopper_gemm.cuh, which
// the forward megakernel includes: its sources' digest stamps the tuned files (render.kernel_digest).
#pragma once

#include <cute/arch/mma_sm90_desc.hpp>

#include <cstdint>

#include "common.cuh"

namespace mokgen {
namespace sm90 {

// MN-major operand with the 128-byte swizzle, as the TMA writes a box of 64 M/N elements x k
// rows: k row r at byte 128 r, so 8 k rows form one 1024-byte swizzle atom (the stride byte
// offset), and the next 64 M/N elements are the next box, kBoxBytes on (the leading byte
// offset). CuTe's canonical GMMA MN-major layout for SWIZZLE_128B ((8,n),(8,k)):((1,LBO),(8,SBO))
// in 16-byte units. Boxes 1024-byte aligned; a k16 step moves 2048 bytes.
template <int kBoxBytes>
MOKGEN_DEVICE uint64_t smem_desc_mn(const void* smem) {
  cute::GmmaDescriptor d;
  d.bitfield.start_address_ = uint16_t(smem_u32(smem) >> 4);
  d.bitfield.leading_byte_offset_ = kBoxBytes >> 4;
  d.bitfield.stride_byte_offset_ = 1024 >> 4;
  d.bitfield.base_offset_ = 0;
  d.bitfield.layout_type_ = 1;  // SWIZZLE_128B
  return d.desc_;
}

}  // namespace sm90
}  // namespace mokgen
