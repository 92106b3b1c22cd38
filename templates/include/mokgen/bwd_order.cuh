// The backward megakernel's tile order (docs/architecture.md, "The backward megakernel"), as a
// function of the receive plan only. No kernel walks it yet: it is step (2)'s first piece,
// checked on the host (tests/test_bwd_order.py) before a kernel is built on it.
//
// Rows as in the forward (tile_order.cuh): expert-major, expert le owns rows [eoff[le],
// eoff[le + 1]), cut into chunks of C rows that go through a ring of R slots. Step s = 0 ..
// num_chunks lists, in this order:
//   kind 0, dh tiles of chunk s: per expert segment, its 128-row blocks x dh_tiles column tiles
//     (dh = dy W_down over N = I; dSwiGLU in the epilogue), column-major as the forward's groups;
//   kind 1, dx tiles of chunk s - 1: its blocks x dx_tiles column tiles (dx over N = H);
//   kinds 2, 3, 4, the weight tiles (dW_down, dW_gate, dW_up) of every expert whose last row lies
//     in chunk s - 1: wd_tiles, wgu_tiles and wgu_tiles output tiles, expert by expert.
// A weight tile owns its output tile and walks all of its expert's rows in order (no split-K).
//
// The dependencies the kernel's counters will wait on:
//   dh (c, block)       chunk c has landed;
//   dx (c, block)       the block's dh_tiles dh tiles;
//   weight (e, tile)    every dh tile of expert e, in every chunk it has rows in;
//   slot of chunk c     free once every dx tile of c and every weight tile of the experts with
//                       rows in c are done; chunk c lands only after the slot of c - R is free.
// Claimed in order, the order cannot deadlock when every tile's dependencies are earlier tiles
// and, for every chunk c >= R, the tiles that free the slot of c - R come before the first tile
// that needs chunk c. The first holds by construction. The second holds when R >= 2 and R
// exceeds the most chunks any expert's rows span: an expert's weight tiles come only after its
// last chunk, and hold every slot it has rows in. bwd_min_ring gives that bound; the host check
// finds the same R by brute force from the order itself.
#pragma once

#include "tile_order.cuh"

namespace mokgen {

// Column tiles per row block of each rows kind and output tiles per expert of each weight kind.
struct BwdTiles {
  int dh, dx, wd, wgu;
};

// The chunk holding expert le's last row (-1 for an expert without rows).
MOKGEN_HOST_DEVICE int bwd_last_chunk(const int32_t* eoff, int le, int C) {
  return eoff[le + 1] > eoff[le] ? (eoff[le + 1] - 1) / C : -1;
}

// The smallest ring the order needs (see above): 2, or one more than the most chunks an
// expert's rows span.
MOKGEN_HOST_DEVICE int bwd_min_ring(const int32_t* eoff, int e_loc, int C) {
  int span = 0;
  for (int le = 0; le < e_loc; ++le)
    if (eoff[le + 1] > eoff[le]) span = imax(span, (eoff[le + 1] - 1) / C - eoff[le] / C + 1);
  return imax(2, span + 1);
}

// The whole order: fn(kind, c, le, rows, m, n) for every tile, in order. Rows kinds (0, 1): c
// the tile's chunk, rows the block's rows, m its first row in the chunk, n its column tile.
// Weight kinds (2, 3, 4): c the chunk of the expert's last row, rows the expert's rows, m = 0
// and n the output tile's index. Returns the number of tiles.
template <class Fn>
MOKGEN_HOST_DEVICE int walk_bwd_order(const int32_t* eoff, int e_loc, int n_rows, int C, int num_chunks,
                                      const BwdTiles& nt, Fn&& fn) {
  int t = 0;
  int want = 0;
  auto every = [](int w) { return w + 1; };  // the whole order (a kernel's CTAs would claim)
  int lo_dh = 0, lo_dx = 0, lo_w = 0;
  for (int step = 0; step <= num_chunks; ++step) {
    if (step < num_chunks) {
      const int r0 = step * C, r1 = imin(n_rows, r0 + C);
      lo_dh = advance_expert(eoff, e_loc, lo_dh, r0);
      t = walk_group_dealt<1>(eoff, e_loc, lo_dh, r0, r1, 0, step, nt.dh, 0, t, want, every,
                              [&](int kind, int c, int le, int rows, int m, int n, int) { fn(kind, c, le, rows, m, n); });
    }
    if (step >= 1) {
      const int c = step - 1, r0 = c * C, r1 = imin(n_rows, r0 + C);
      lo_dx = advance_expert(eoff, e_loc, lo_dx, r0);
      t = walk_group_dealt<1>(eoff, e_loc, lo_dx, r0, r1, 1, c, nt.dx, 0, t, want, every,
                              [&](int kind, int cc, int le, int rows, int m, int n, int) { fn(kind, cc, le, rows, m, n); });
      // the experts whose last row is in chunk c: in expert order, from the first one not yet done
      for (; lo_w < e_loc && eoff[lo_w + 1] <= r1; ++lo_w) {
        if (bwd_last_chunk(eoff, lo_w, C) != c) continue;  // no rows
        const int rows = eoff[lo_w + 1] - eoff[lo_w];
        const int per[3] = {nt.wd, nt.wgu, nt.wgu};
        for (int k = 0; k < 3; ++k)
          for (int q = 0; q < per[k]; ++q, ++t, ++want) fn(2 + k, c, lo_w, rows, 0, q);
      }
    }
  }
  return t;
}

// Expert le's rows as its weight tiles read them (their K): per chunk the expert has rows in,
// its segment there in k-blocks of kKb rows from the segment's start, the segment's last one
// short. So a k-block is one TMA box of contiguous ring rows (the chunk's slot, c % R), whose
// rows past the k-block's are zeroed in shared memory as a ragged last k-block's are today
// (bwd_gemm.cuh). A k-block split at a chunk boundary would need a box at an unaligned row of
// a swizzled stage instead; this costs a short k-block per chunk boundary inside an expert.
// fn(kb, c, ring_row, rows) per k-block, in row order. Returns the number of k-blocks.
template <class Fn>
MOKGEN_HOST_DEVICE int bwd_expert_kblocks(const int32_t* eoff, int le, int C, int R, int kKb, Fn&& fn) {
  const int r0 = eoff[le], r1 = eoff[le + 1];
  int kb = 0;
  for (int a = r0; a < r1;) {  // a: the segment's first row
    const int c = a / C, b = imin(r1, (c + 1) * C);
    for (int p = a; p < b; p += kKb, ++kb) fn(kb, c, (c % R) * C + (p - c * C), imin(kKb, b - p));
    a = b;
  }
  return kb;
}

}  // namespace mokgen
