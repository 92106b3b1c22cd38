// The order of the fused backward (v0.23, bwd_gemm.cu's fused_kernel, MOKGEN_BWD_FUSED): the
// experts' GEMM chain of one rank's rows in one persistent launch, and the SwiGLU backward
// between its GEMMs done by otherwise idle warps. Host and device code: tests/host/
// bwd_fused_check.cu checks it on the CPU (every tile once, each CTA's items in order, every
// dependency earlier, and no deadlock in a simulation of the roles).
//
// Rows as bwd_tiles.cuh's walks: expert-major, expert e owning [end of e - 1, min(offs[e],
// total)), 128-row blocks from each expert's first row, numbered over the experts in order
// (block ids). The experts are cut into groups: a group closes at the first expert that brings
// its rows to `chunk` or more (the last group takes what is left). Step s = 0, 1, ... lists:
//   kind 0 (dh), group s:       per expert, its blocks x dh_n column tiles (dh = dOut Wd), a
//                               block's column tiles consecutive;
//   kind 1 (dx), group s - lag: its blocks x dx_n column tiles (dx = dg Wg + du Wu);
//   kind 2 (dW_down), group s - lag: per expert wd_m x wd_n output tiles (dWd = dOut^T hw);
//   kind 3 (dW_gate / dW_up joint), group s - lag: wgu_m x wgu_n tiles (M stacked: gate, up).
// Item i of the whole order goes to CTA i mod ctas (static: no claim counter, and a CTA's items
// come in the order's order). Beside them, the SwiGLU backward of block b (hw, dg, du and the
// routing weight's gradient from dh and the saved g, u) is a "swiglu item" of CTA b mod ctas,
// run by its background warps in increasing b.
// Dependencies: swiglu(b) waits for b's dh tiles; dx tiles of b wait for swiglu(b); weight
// tiles of expert e wait for swiglu of all of e's blocks. Placing swiglu(b) just after the last
// dh tile of b, every dependency points to an earlier item, and each role takes its items in
// increasing order, so the earliest unfinished item can always run: no deadlock while every CTA
// is resident (bwd_fused_check.cu simulates it).
#pragma once

#include "bwd_tiles.cuh"

namespace mokgen {
namespace bwd {

enum FusedKind : int { kFusedDh = 0, kFusedDx = 1, kFusedWd = 2, kFusedWgu = 3 };

// Tile counts and the grouping of one fused launch.
struct FusedShape {
  int dh_n;          // column tiles of a dh row block (I / 256)
  int dx_n;          // column tiles of a dx row block (H / 256)
  int wd_m, wd_n;    // dW_down's output tiles per expert (H / 128 x I / 256)
  int wgu_m, wgu_n;  // the joint dW_gate / dW_up's (2 I / 128 x H / 256)
  int chunk;         // rows per group (>= 1)
  int lag;           // steps from a group's dh tiles to its dx and weight tiles (>= 1)
};

// A walk position over the experts' segments.
struct FusedCursor {
  int e = 0, blk = 0, prev_end = 0;  // the next expert, its first block id, its first row
};

// The experts of the group starting at cursor c: [c.e, e_end); advances c past it. Returns
// false when no expert is left.
MOKGEN_HOST_DEVICE bool fused_group(const int32_t* offs, int E, int total, int chunk, FusedCursor& c, FusedCursor& first,
                                    int& e_end) {
  if (c.e >= E) return false;
  first = c;
  int rows = 0;
  while (c.e < E) {
    const int end = clamp_rows(offs[c.e], c.prev_end, total > c.prev_end ? total : c.prev_end);
    const int n = end - c.prev_end;
    c.blk += (n + kTileRows - 1) / kTileRows;
    c.prev_end = end;
    ++c.e;
    rows += n;
    if (rows >= chunk) break;
  }
  e_end = c.e;
  return true;
}

// Items of one kind over the group [first.e, e_end): fn(kind, e, row0, rows, blk, nb, m, n) for
// the items this CTA takes (global item number `next`, advanced by ctas; `base`: items before
// this segment). Rows kinds: row0 / rows the block's, blk its id, nb 1, m 0. Weight kinds:
// row0 / rows the expert's (its K), blk its first block, nb its blocks, (m, n) the output tile.
template <class Fn>
MOKGEN_HOST_DEVICE void fused_segment(const int32_t* offs, int total, const FusedShape& sh, int kind,
                                      const FusedCursor& first, int e_end, int& base, int& next, int ctas,
                                      Fn&& fn) {
  int start = first.prev_end, blk = first.blk;
  for (int e = first.e; e < e_end; ++e) {
    const int end = clamp_rows(offs[e], start, total > start ? total : start);
    const int rows = end - start, nb = (rows + kTileRows - 1) / kTileRows;
    int per = 0;
    if (kind == kFusedDh) per = nb * sh.dh_n;
    else if (kind == kFusedDx) per = nb * sh.dx_n;
    else if (kind == kFusedWd) per = sh.wd_m * sh.wd_n;
    else per = sh.wgu_m * sh.wgu_n;
    while (next < base + per) {
      const int q = next - base;
      if (kind <= kFusedDx) {
        const int cols = kind == kFusedDh ? sh.dh_n : sh.dx_n;
        const int mb = q / cols, r0 = start + mb * kTileRows, left = end - r0;
        fn(kind, e, r0, left < kTileRows ? left : kTileRows, blk + mb, 1, 0, q % cols);
      } else {
        const int cols = kind == kFusedWd ? sh.wd_n : sh.wgu_n;
        fn(kind, e, start, rows, blk, nb, q / cols, q % cols);
      }
      next += ctas;
    }
    base += per;
    start = end;
    blk += nb;
  }
}

// The whole order, CTA cta of ctas's items in order (ctas = 1, cta = 0: every item).
template <class Fn>
MOKGEN_HOST_DEVICE void walk_fused(const int32_t* offs, int E, int total, const FusedShape& sh, int cta, int ctas,
                                   Fn&& fn) {
  FusedCursor lead, lag;  // the dh groups' walk and the lagged groups' one
  int base = 0, next = cta;  // items before the segment, this CTA's next item
  const int delay = sh.lag < 1 ? 1 : sh.lag;
  for (int step = 0;; ++step) {
    FusedCursor first;
    int e_end = 0;
    const bool dh = fused_group(offs, E, total, sh.chunk, lead, first, e_end);
    if (dh) fused_segment(offs, total, sh, kFusedDh, first, e_end, base, next, ctas, fn);
    if (step >= delay) {
      if (!fused_group(offs, E, total, sh.chunk, lag, first, e_end)) return;
      for (int kind = kFusedDx; kind <= kFusedWgu; ++kind)
        fused_segment(offs, total, sh, kind, first, e_end, base, next, ctas, fn);
    }
  }
}

// The swiglu items of CTA cta of ctas, in increasing block id: fn(blk, row0, rows).
template <class Fn>
MOKGEN_HOST_DEVICE void walk_fused_swiglu(const int32_t* offs, int E, int total, int cta, int ctas, Fn&& fn) {
  int start = 0, blk = 0, next = cta;
  for (int e = 0; e < E; ++e) {
    const int end = clamp_rows(offs[e], start, total > start ? total : start);
    const int nb = (end - start + kTileRows - 1) / kTileRows;
    while (next < blk + nb) {
      const int r0 = start + (next - blk) * kTileRows, left = end - r0;
      fn(next, r0, left < kTileRows ? left : kTileRows);
      next += ctas;
    }
    blk += nb;
    start = end;
  }
}

// Block ids of a launch: at most total / 128 + E (each expert's last block may be partial).
MOKGEN_HOST_DEVICE int fused_max_blocks(int total, int E) { return total / kTileRows + E + 1; }

}  // namespace bwd
}  // namespace mokgen
