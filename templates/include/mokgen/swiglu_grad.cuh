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

}  // namespace bwd
}  // namespace mokgen
