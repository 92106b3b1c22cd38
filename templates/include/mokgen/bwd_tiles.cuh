// Tile walks of the backward GEMMs (bwd_gemm.cuh): which output tiles CTA `cta` of `ctas` takes,
// in order. The producer and the consumers of a CTA walk the same sequence. Host and device code
// (tests/host/bwd_tiles_check.cu checks them on the CPU: every tile exactly once, each CTA's in
// increasing tile order, rows clamped to the operands).
#pragma once

#include <cstdint>

#include "common.cuh"

namespace mokgen {
namespace bwd {

constexpr int kTileRows = 128;  // rows of a tile (the rows GEMMs' row blocks, the weight tiles' M)

MOKGEN_HOST_DEVICE int clamp_rows(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

// Rows GEMMs: the tiles of expert e are its row blocks x n_tiles column tiles. Tiles are
// numbered over the experts in order; CTA b takes tiles b, b + ctas, ... fn(e, row0 (global),
// rows, n (column tile)). Within an expert the row blocks go in bands of `band` (the last band
// may be shorter), and within a band column by column: the band's row blocks of column tile 0,
// then of column tile 1, ... So the CTAs of one wave that share a column tile of B (an expert's
// weights: 58 MB for kimi-k2.5's dx) load it at about the same time, and it comes from DRAM once
// per band instead of once per wave that holds some of the expert's row blocks (v0.43: kimi-k2.5
// local's dx read 5.6 GB from DRAM for 2.9 GB of operands under band 1); the band's A rows stay
// in L2 across its column tiles. band 1: row block by row block, the column tiles within
// (consecutive tiles share the A rows; v0.42's order). Expert e owns rows [end of e - 1,
// min(offs[e], total)), so rows past `total` (the operands' row count) are never visited,
// whatever offs says. CTA pairs (pair = 2, n_tiles even): the units walked are (expert, row
// block, column-tile pair), unit u taken by pair cta, cta + ctas, ... (cta and ctas count
// pairs), and the CTA of rank crank computes column tile 2 (u's column pair) + crank: both CTAs
// of a pair walk the same rows in step, so they can share the A operand by TMA multicast.
template <class Fn>
MOKGEN_HOST_DEVICE void walk_row_tiles(const int32_t* offs, int E, int total, int n_tiles, int cta, int ctas, Fn&& fn,
                                       int pair = 1, int crank = 0, int band = 1) {
  const int n_units = n_tiles / pair;
  if (band < 1) band = 1;
  int64_t base = 0;  // first unit number of expert e
  int64_t next = cta;
  int start = 0;
  for (int e = 0; e < E; ++e) {
    const int end = clamp_rows(offs[e], start, total > start ? total : start);
    const int blocks = (end - start + kTileRows - 1) / kTileRows;
    const int64_t count = int64_t(blocks) * n_units;
    while (next < base + count) {
      const int64_t q = next - base;
      const int64_t band_units = int64_t(band) * n_units;
      const int b = int(q / band_units), qb = int(q - b * band_units);  // band b, unit qb within it
      const int in_band = blocks - b * band < band ? blocks - b * band : band;  // its row blocks
      const int mb = b * band + qb % in_band, n = pair * (qb / in_band) + crank;
      const int rows = end - start - mb * kTileRows;
      fn(e, start + mb * kTileRows, rows < kTileRows ? rows : kTileRows, n);
      next += ctas;
    }
    base += count;
    start = end;
  }
}

// Weight gradients: E x m_tiles x n_tiles tiles, expert-major; fn(e, row0, rows (the K), m, n),
// with expert e's rows clamped as in walk_row_tiles. CTA pairs (pair = 2, m_tiles even): the
// units walked are (expert, row-block pair, column tile), unit u taken by pair cta, cta + ctas,
// ... (cta and ctas count pairs), and the CTA of rank crank in its pair computes row block
// 2 (u's row-block pair) + crank: both CTAs of a pair walk the same experts, K and column tiles,
// in step, so they can share the B operand (the same rows and columns) by TMA multicast.
template <class Fn>
MOKGEN_HOST_DEVICE void walk_weight_tiles(const int32_t* offs, int E, int total, int m_tiles, int n_tiles, int cta,
                                          int ctas, Fn&& fn, int pair = 1, int crank = 0) {
  const int m_units = m_tiles / pair, per_e = m_units * n_tiles;
  if (per_e <= 0) return;
  int e_seen = -1, start = 0, end = 0;  // expert e's clamped segment, advanced as q grows
  int prev_end = 0;
  // unit q = e per_e + r, advanced by ctas in 32-bit steps (a 64-bit division per tile cost
  // about as much as the rest of the walk)
  for (int e = cta / per_e, r = cta % per_e; e < E;) {
    while (e_seen < e) {  // the same segments as walk_row_tiles: each starts where the last ended
      ++e_seen;
      start = prev_end;
      end = clamp_rows(offs[e_seen], start, total > start ? total : start);
      prev_end = end;
    }
    fn(e, start, end - start, pair * (r / n_tiles) + crank, r % n_tiles);
    r += ctas;
    e += r / per_e;
    r %= per_e;
  }
}

}  // namespace bwd
}  // namespace mokgen
