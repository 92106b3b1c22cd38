// Host check of templates/include/mokgen/swiglu_grad.cuh (run by tests/test_bwd_gemm.py): reads
// float32 quadruples (g, u, dh, limit; limit <= 0: no clamp) from argv[1], writes (h, dg, du)
// float32 triples to argv[2]. The test compares them with mokgen.backward's closed form.
#include <vector>

#include "host_io.h"
#include "mokgen/swiglu_grad.cuh"

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  std::vector<float> v;
  if (!read_floats(argv[1], v)) return 2;
  if (v.size() % 4) return 3;
  std::vector<float> out;
  for (size_t i = 0; i < v.size(); i += 4) {
    const mokgen::bwd::SwigluGrad r = mokgen::bwd::swiglu_grad(v[i], v[i + 1], v[i + 2], v[i + 3] > 0.f, v[i + 3]);
    out.push_back(r.h);
    out.push_back(r.dg);
    out.push_back(r.du);
  }
  return write_bytes(argv[2], out.data(), out.size() * 4) ? 0 : 2;
}
