// Host check of templates/include/mokgen/swiglu_grad.cuh (run by tests/test_bwd_gemm.py): reads
// float32 quadruples (g, u, dh, limit; limit <= 0: no clamp) from argv[1], writes (h, dg, du)
// float32 triples to argv[2]. The test compares them with mokgen.backward's closed form.
#include <cstdio>
#include <vector>

#include "mokgen/swiglu_grad.cuh"

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  FILE* in = std::fopen(argv[1], "rb");
  if (!in) return 2;
  std::vector<float> v;
  float x;
  while (std::fread(&x, 4, 1, in) == 1) v.push_back(x);
  std::fclose(in);
  if (v.size() % 4) return 3;
  std::vector<float> out;
  for (size_t i = 0; i < v.size(); i += 4) {
    const mokgen::bwd::SwigluGrad r = mokgen::bwd::swiglu_grad(v[i], v[i + 1], v[i + 2], v[i + 3] > 0.f, v[i + 3]);
    out.push_back(r.h);
    out.push_back(r.dg);
    out.push_back(r.du);
  }
  FILE* o = std::fopen(argv[2], "wb");
  if (!o) return 2;
  std::fwrite(out.data(), 4, out.size(), o);
  std::fclose(o);
  return 0;
}
