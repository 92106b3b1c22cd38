// Host check of templates/include/mokgen/mx.cuh (run by tests/test_mx.py): reads float32 values
// (a multiple of 32) from the file argv[1], quantizes each block of 32 with mokgen::mx, and
// writes the codes then the scales (uint8) to argv[2]. The test compares them with the oracle.
#include <vector>

#include "host_io.h"
#include "mokgen/mx.cuh"

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  std::vector<float> v;
  if (!read_floats(argv[1], v)) return 2;
  if (v.size() % mokgen::mx::kBlock) return 3;
  const size_t blocks = v.size() / mokgen::mx::kBlock;
  std::vector<uint8_t> codes(v.size()), scales(blocks);
  for (size_t b = 0; b < blocks; ++b) {
    float blk[mokgen::mx::kBlock];
    uint8_t c[mokgen::mx::kBlock];
    for (int i = 0; i < mokgen::mx::kBlock; ++i) blk[i] = v[b * mokgen::mx::kBlock + i];
    scales[b] = mokgen::mx::quantize_block(blk, c);
    for (int i = 0; i < mokgen::mx::kBlock; ++i) codes[b * mokgen::mx::kBlock + i] = c[i];
  }
  codes.insert(codes.end(), scales.begin(), scales.end());  // codes, then scales
  return write_bytes(argv[2], codes.data(), codes.size()) ? 0 : 2;
}
