// Host check of templates/include/mokgen/swiglu_grad.cuh (run by tests/test_bwd_gemm.py and
// tests/test_mx_experts.py): reads float32 quadruples (g, u, dh, limit; limit <= 0: no clamp) from
// argv[1], writes (h, dg, du) float32 triples to argv[2]: swiglu_grad's, or with argv[3] "exact"
// swiglu_grad_exact's (the MXFP8 backward's). The tests compare them with mokgen.backward's closed
// form, and the exact ones with PyTorch's autograd.
#include <string>
#include <vector>

#include "host_io.h"
#include "mokgen/swiglu_grad.cuh"

int main(int argc, char** argv) {
  if (argc != 3 && argc != 4) return 2;
  const bool exact = argc == 4 && std::string(argv[3]) == "exact";
  std::vector<float> v;
  if (!read_floats(argv[1], v)) return 2;
  if (v.size() % 4) return 3;
  std::vector<float> out;
  for (size_t i = 0; i < v.size(); i += 4) {
    const mokgen::bwd::SwigluGrad r =
        exact ? mokgen::bwd::swiglu_grad_exact(v[i], v[i + 1], v[i + 2], v[i + 3] > 0.f, v[i + 3])
              : mokgen::bwd::swiglu_grad(v[i], v[i + 1], v[i + 2], v[i + 3] > 0.f, v[i + 3]);
    out.push_back(r.h);
    out.push_back(r.dg);
    out.push_back(r.du);
  }
  return write_bytes(argv[2], out.data(), out.size() * 4) ? 0 : 2;
}
