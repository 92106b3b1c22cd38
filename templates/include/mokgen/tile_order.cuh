// The compute tile order of the megakernel (ep_forward.cuh), as functions of the receive plan
// only: the walker thread of every compute CTA walks it (ep_forward.cuh's tile queue), and host
// programs can check it (tests/test_tile_order.py).
//
// The received rows are expert-major: expert le owns rows [eoff[le], eoff[le + 1]) (eoff is
// nondecreasing, eoff[e_loc] = n_rows), cut into chunks of C rows. A group (chunk c, kind: 0 = up
// tiles, 1 = down tiles) lists, for each expert overlapping the chunk, its 128-row blocks in the
// chunk times the kind's column tiles, column-major: column tile 0 of each of its blocks, then
// column tile 1, ... (the tiles that share a weight tile next to each other, v0.17). With CTA
// pairs (kPair = 2) a group lists pair-tiles instead: row blocks (2p, 2p + 1) of a segment with
// one column tile (the pair shares the weight tile, share = 1) and, for an odd last block,
// column tiles (2g, 2g + 1) of it (the pair shares the row tile, share = 2; past the last column
// tile, a partner of zero rows), by column pairs: the pair-tiles of columns 2g and 2g + 1, then
// the odd block's half g.
// Dealing: the *_dealt walks take any strictly increasing sequence of running indices (`next`).
// The forward megakernel's CTAs (or pairs) claim theirs from a counter that all compute CTAs of
// a rank share, in order: the tiles that share an operand then start at about the same time
// whatever the CTAs' drift, so the second reader finds the operand in L2 (v0.17). StaticDeal
// (unit `unit` of `units` takes t % units == unit: the megakernel's deal until v0.16) serves the
// phased schedule and the host check's reference.
//
// Each role visits only the experts overlapping a chunk (found by a running pointer or a binary
// search) and jumps from one of its tiles to the next, so the walk costs O(its tiles + experts
// per chunk), not O(all tiles): v0.5 measured the old walk (every tile of the order, a modulo
// each, in every consumer thread and in the producer thread) at 9% of all warp samples.
#pragma once

#include "common.cuh"

namespace mokgen {

MOKGEN_HOST_DEVICE int imin(int a, int b) { return a < b ? a : b; }
MOKGEN_HOST_DEVICE int imax(int a, int b) { return a > b ? a : b; }

// The first expert le >= lo whose rows end after row r0 (eoff[le + 1] > r0), or e_loc.
MOKGEN_HOST_DEVICE int advance_expert(const int32_t* eoff, int e_loc, int lo, int r0) {
  while (lo < e_loc && eoff[lo + 1] <= r0) ++lo;
  return lo;
}

// The same from scratch, by binary search.
MOKGEN_HOST_DEVICE int find_expert(const int32_t* eoff, int e_loc, int r0) {
  int lo = 0, hi = e_loc;  // the answer is in [lo, hi]
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (eoff[mid + 1] <= r0) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Offset from t to the first tile t' >= t with t' % units == unit (0 <= unit < units, t >= 0).
MOKGEN_HOST_DEVICE int to_owned(int t, int unit, int units) {
  const int d = unit - t % units;
  return d < 0 ? d + units : d;
}

// The static deal: unit `unit` of `units` takes the running indices t % units == unit.
struct StaticDeal {
  int unit, units;
  MOKGEN_HOST_DEVICE int first(int t) const { return t + to_owned(t, unit, units); }  // its first index >= t
  MOKGEN_HOST_DEVICE int operator()(int want) const { return want + units; }           // its next after want
};

// One group: the tiles of rows [r0, r1) (chunk c) of one kind with n_tiles column tiles, from
// running index t; the experts from `le` on (the first that can overlap r0). `want` is the
// running index of the unit's next tile; for each tile of the group at index want, calls
// fn(kind, c, le, rows, m (row in chunk), n, share) and then want = next(want) (strictly
// increasing). crank: the CTA's rank in its pair (the two CTAs of a pair get the same indices).
// Returns t past the group.
template <int kPair, class Next, class Fn>
MOKGEN_HOST_DEVICE int walk_group_dealt(const int32_t* eoff, int e_loc, int le, int r0, int r1, int kind, int c,
                                        int n_tiles, int crank, int t, int& want, Next&& next, Fn&& fn) {
  static_assert(kPair == 1 || kPair == 2, "CTAs alone or in pairs");
  for (; le < e_loc && eoff[le] < r1; ++le) {
    const int a = imax(r0, eoff[le]), b = imin(r1, eoff[le + 1]);
    if (b <= a) continue;
    const int nb = (b - a + 127) / 128;
    if constexpr (kPair == 1) {
      const int seg = nb * n_tiles;
      for (; want < t + seg; want = next(want)) {
        const int q = want - t;
        const int m = a + q % nb * 128;  // column-major: the segment's blocks for column tile q / nb
        fn(kind, c, le, imin(128, b - m), m - r0, q / nb, 0);
      }
      t += seg;
    } else {
      // Column-major too, by column pairs: for columns 2g and 2g + 1 the segment's pair-tiles
      // (row-block pairs p = 0 .. np - 1) of column 2g, then of 2g + 1, then the odd last block's
      // half g (columns 2g, 2g + 1: share = 2), so every reader of a weight tile is within
      // 2 np + 1 indices of the others.
      const int np = nb / 2, odd = nb % 2;
      const int gs = 2 * np + odd;  // indices per column pair (the last: np + odd for an odd n_tiles)
      const int seg = n_tiles * np + odd * ((n_tiles + 1) / 2);
      for (; want < t + seg; want = next(want)) {
        const int q = want - t;
        const int g = q / gs, r = q % gs;
        const int cols = 2 * g + 1 < n_tiles ? 2 : 1;  // columns in this column pair
        if (r < cols * np) {
          const int m = a + (r % np * 2 + crank) * 128;
          fn(kind, c, le, imin(128, b - m), m - r0, 2 * g + r / np, 1);
        } else {
          const int m = a + (nb - 1) * 128;
          const bool real = 2 * g + crank < n_tiles;
          fn(kind, c, le, real ? imin(128, b - m) : 0, m - r0, real ? 2 * g + crank : 2 * g, 2);
        }
      }
      t += seg;
    }
  }
  return t;
}

// One group, dealt statically.
template <int kPair, class Fn>
MOKGEN_HOST_DEVICE int walk_group(const int32_t* eoff, int e_loc, int le, int r0, int r1, int kind, int c, int n_tiles,
                                  int unit, int units, int crank, int t, Fn&& fn) {
  const StaticDeal deal{unit, units};
  int want = deal.first(t);
  return walk_group_dealt<kPair>(eoff, e_loc, le, r0, r1, kind, c, n_tiles, crank, t, want, deal, fn);
}

// The flow schedule's routed tiles: step s holds the up tiles (kind 0) of chunk s, then the down
// tiles (kind 1) of chunk s - lag; running index from t; any deal (want, next as in
// walk_group_dealt). Returns t past the last tile.
template <int kPair, class Next, class Fn>
MOKGEN_HOST_DEVICE int walk_flow_tiles_dealt(const int32_t* eoff, int e_loc, int n_rows, int C, int num_chunks, int lag,
                                             int up_tiles, int down_tiles, int crank, int t, int& want, Next&& next,
                                             Fn&& fn) {
  int lo[2] = {0, 0};  // per kind: the first expert that can overlap its current chunk
  for (int step = 0; step < num_chunks + lag; ++step)
#pragma unroll  // lo[] in registers (indexed by a run-time kind it went to local memory)
    for (int kind = 0; kind < 2; ++kind) {
      const int c = kind == 0 ? step : step - lag;
      if (c < 0 || c >= num_chunks) continue;
      const int r0 = c * C, r1 = imin(n_rows, r0 + C);
      lo[kind] = advance_expert(eoff, e_loc, lo[kind], r0);
      t = walk_group_dealt<kPair>(eoff, e_loc, lo[kind], r0, r1, kind, c, kind == 0 ? up_tiles : down_tiles, crank, t,
                                  want, next, fn);
    }
  return t;
}

// The same, dealt statically.
template <int kPair, class Fn>
MOKGEN_HOST_DEVICE int walk_flow_tiles(const int32_t* eoff, int e_loc, int n_rows, int C, int num_chunks, int lag,
                                       int up_tiles, int down_tiles, int unit, int units, int crank, int t, Fn&& fn) {
  const StaticDeal deal{unit, units};
  int want = deal.first(t);
  return walk_flow_tiles_dealt<kPair>(eoff, e_loc, n_rows, C, num_chunks, lag, up_tiles, down_tiles, crank, t, want,
                                      deal, fn);
}

// The fused shared expert's tiles for CTA pairs (ep_forward.cuh): its T token rows as pair-tiles
// of walk_group_dealt (row blocks 2p and 2p + 1 with one column tile, the pair sharing the weight
// tile; an odd last block by column pairs, sharing its x rows, with a zero-row partner past an
// odd column count), 256 rows at a time, so that a block pair's up tiles end together and its
// down tiles can start (as the single CTAs' block-major walk allows); all up tiles (kind 2), then
// all down tiles (kind 3). fn(kind, -1, 0, rows, m (token row), n, share); any deal. Returns t
// past the last tile.
template <class Next, class Fn>
MOKGEN_HOST_DEVICE int walk_shared_pairs_dealt(int T, int up_tiles, int down_tiles, int crank, int t, int& want,
                                               Next&& next, Fn&& fn) {
  const int32_t seg[2] = {0, T};
#pragma unroll 1
  for (int kind = 2; kind < 4; ++kind)
#pragma unroll 1
    for (int r = 0; r < T; r += 256)
      t = walk_group_dealt<2>(seg, 1, 0, r, imin(T, r + 256), kind, -1, kind == 2 ? up_tiles : down_tiles, crank, t,
                              want, next, [&](int k, int c, int le, int rows, int m, int n, int share) {
                                fn(k, c, le, rows, m + r, n, share);
                              });
  return t;
}

// Tiles of one group, all units (CTAs alone): sum over the experts overlapping [r0, r1) of
// their 128-row blocks in it, times n_tiles.
MOKGEN_HOST_DEVICE int group_tiles(const int32_t* eoff, int e_loc, int r0, int r1, int n_tiles) {
  int blocks = 0;
  for (int le = find_expert(eoff, e_loc, r0); le < e_loc && eoff[le] < r1; ++le) {
    const int a = imax(r0, eoff[le]), b = imin(r1, eoff[le + 1]);
    if (b > a) blocks += (b - a + 127) / 128;
  }
  return blocks * n_tiles;
}

}  // namespace mokgen
