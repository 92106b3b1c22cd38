// File I/O of the host checks that exchange arrays with their pytest (mx_check.cu,
// swiglu_check.cu): raw little-endian arrays, no header.
#pragma once

#include <cstdio>
#include <vector>

// Every float32 of the file at path; false when it cannot be read.
inline bool read_floats(const char* path, std::vector<float>& out) {
  FILE* f = std::fopen(path, "rb");
  if (!f) return false;
  float x;
  while (std::fread(&x, 4, 1, f) == 1) out.push_back(x);
  std::fclose(f);
  return true;
}

// bytes of data to the file at path; false when it cannot be written.
inline bool write_bytes(const char* path, const void* data, size_t bytes) {
  FILE* f = std::fopen(path, "wb");
  if (!f) return false;
  const bool ok = std::fwrite(data, 1, bytes, f) == bytes;
  return std::fclose(f) == 0 && ok;
}
