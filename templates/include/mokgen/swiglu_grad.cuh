// SwiGLU and its input gradients for one element, with mokgen.reference.swiglu's clamp
// semantics: gc = min(g, L), uc = clamp(u, -L, L), h = silu(gc) uc; dg = dh uc silu'(gc) [g <= L],
// du = dh silu(gc) [-L <= u <= L], silu'(z) = s (1 + z (1 - s)), s = sigmoid(z). Used by the
// backward's fused recompute (bwd_gemm.cuh). Host and device code: tests/host/swiglu_check.cu
// checks it against the PyTorch closed form on the CPU (the host build uses expf where the
// device uses __expf).
#pragma once

#include <cmath>

#include "common.cuh"

namespace mokgen {
namespace bwd {

struct SwigluGrad {
  float h, dg, du;
};

MOKGEN_HOST_DEVICE float fast_exp(float x) {
#ifdef __CUDA_ARCH__
  return __expf(x);
#else
  return expf(x);
#endif
}

MOKGEN_HOST_DEVICE SwigluGrad swiglu_grad(float g, float u, float dh, bool clamp, float limit) {
  float gc = g, uc = u, mg = 1.f, mu = 1.f;
  if (clamp) {
    gc = fminf(g, limit);
    uc = fminf(fmaxf(u, -limit), limit);
    mg = g <= limit ? 1.f : 0.f;
    mu = (u >= -limit && u <= limit) ? 1.f : 0.f;
  }
#if defined(__CUDA_ARCH__) && defined(MOKGEN_SWIGLU_FAST_RCP)
  // a measuring build (.ci/dh_swiglu_probe.py): the reciprocal without the IEEE division's
  // slow-path call (other bits)
  const float s = __fdividef(1.f, 1.f + fast_exp(-gc));
#else
  const float s = 1.f / (1.f + fast_exp(-gc));
#endif
  const float silu = gc * s;
  return {silu * uc, dh * uc * (s * (1.f + gc * (1.f - s))) * mg, dh * silu * mu};
}

// Float32 operations rounded on their own (no contraction into an FMA): the device's _rn
// intrinsics; on the host the plain operators (the host checks build for x86-64 without FMA).
MOKGEN_HOST_DEVICE float rn_add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
MOKGEN_HOST_DEVICE float rn_sub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
MOKGEN_HOST_DEVICE float rn_mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
MOKGEN_HOST_DEVICE float rn_div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// The MXFP8 backward's SwiGLU gradient (mx_rows.cuh swiglu_backward_kernel, v0.40): PyTorch's
// expressions of reference.swiglu under autograd, each operation rounded on its own, the accurate
// exp: gc = clamp(g, max=L), uc = clamp(u, -L, L) (a NaN kept, where swiglu_grad's fminf maps it to
// the limit), e = 1 + exp(-gc), s = 1 / e, silu = gc / e, h = silu uc, du = dh silu [-L <= u <= L],
// dg = ((dh uc) s) (1 + gc (1 - s)) [g <= L]. tests/host/swiglu_check.cu ("exact") checks it on
// the CPU against PyTorch's autograd.
MOKGEN_HOST_DEVICE SwigluGrad swiglu_grad_exact(float g, float u, float dh, bool clamp, float limit) {
  bool g_in = true, u_in = true;
  if (clamp) {
    g_in = g <= limit;  // false for a NaN, as PyTorch's mask
    u_in = u >= -limit && u <= limit;
    g = g > limit ? limit : g;
    u = u > limit ? limit : (u < -limit ? -limit : u);
  }
  const float e = rn_add(1.f, expf(-g));
  const float s = rn_div(1.f, e), silu = rn_div(g, e);
  const float dg = rn_mul(rn_mul(rn_mul(dh, u), s), rn_add(1.f, rn_mul(g, rn_sub(1.f, s))));
  return {rn_mul(silu, u), g_in ? dg : 0.f, u_in ? rn_mul(dh, silu) : 0.f};
}

}  // namespace bwd
}  // namespace mokgen
