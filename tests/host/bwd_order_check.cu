// Host check of templates/include/mokgen/bwd_order.cuh (run by tests/test_bwd_order.py), on random
// receive plans:
//   - every tile of the backward is listed exactly once: the rows tiles of every 128-row block of
//     every expert segment of every chunk, the weight tiles of every expert with rows, built here
//     independently of the walk;
//   - every tile's dependencies come before it: a dx tile after its block's dh tiles, a weight
//     tile after every dh tile of its expert;
//   - each expert's k-blocks for its weight tiles (bwd_expert_kblocks): kKb rows of each chunk
//     segment at a time, covering its rows in order, each inside one chunk at its ring rows;
//   - the ring: with R = bwd_min_ring slots, for every chunk c >= R the tiles that free the slot
//     of c - R come before the first tile that needs chunk c, and none of them needs a chunk >= c;
//     the smallest R found by trying them all is never above bwd_min_ring.
// Prints "ok N T" (N tiles checked, T plans where the brute-force ring equals bwd_min_ring) or
// the first failure, and exits 1.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "mokgen/bwd_order.cuh"

using Key = std::tuple<int, int, int, int, int>;  // kind, c, le, m, n

static int fail(const char* what, int plan) {
  std::printf("FAIL plan %d: %s\n", plan, what);
  return 1;
}

// Whether ring R works for the order `pos` (tile -> position), per the header's rule.
static bool ring_ok(int R, int num_chunks, int C, const std::vector<int32_t>& eoff, int e_loc,
                    const std::vector<Key>& order) {
  std::vector<int> first_need(num_chunks, 1 << 30), free_at(num_chunks, -1), free_needs(num_chunks, -1);
  for (int i = 0; i < int(order.size()); ++i) {
    const auto [kind, c, le, m, n] = order[i];
    if (kind == 0) first_need[c] = std::min(first_need[c], i);
    if (kind == 1) free_at[c] = std::max(free_at[c], i);
    if (kind >= 2) {  // frees every chunk the expert has rows in, and needs all of them
      const int c0 = eoff[le] / C, c1 = (eoff[le + 1] - 1) / C;
      for (int k = c0; k <= c1; ++k) {
        free_at[k] = std::max(free_at[k], i);
        free_needs[k] = std::max(free_needs[k], c1);
      }
    }
  }
  for (int c = R; c < num_chunks; ++c)
    if (free_at[c - R] >= first_need[c] || free_needs[c - R] >= c) return false;
  return true;
}

int main(int argc, char** argv) {
  const int plans = argc > 1 ? std::atoi(argv[1]) : 500;
  std::mt19937 rng(12345);
  long long checked = 0;
  int tight = 0;
  for (int plan = 0; plan < plans; ++plan) {
    const int e_loc = 1 + int(rng() % 200);
    const int shape = int(rng() % 4);  // uniform, skewed, mostly empty, tiny
    std::vector<int32_t> eoff(e_loc + 1, 0);
    for (int le = 0; le < e_loc; ++le) {
      int rows = 0;
      switch (shape) {
        case 0: rows = int(rng() % 700); break;
        case 1: rows = le == 0 ? int(rng() % 20000) : int(rng() % 100); break;
        case 2: rows = rng() % 5 == 0 ? int(rng() % 2000) : 0; break;
        default: rows = int(rng() % 4); break;
      }
      eoff[le + 1] = eoff[le] + rows;
    }
    const int n_rows = eoff[e_loc];
    const int Cs[] = {7, 128, 300, 1024, 2048, 4096};
    const int C = Cs[rng() % 6];
    const int num_chunks = int(mokgen::ceil_div(n_rows, C));
    const mokgen::BwdTiles nt{1 + int(rng() % 8), 1 + int(rng() % 8), 1 + int(rng() % 10), 1 + int(rng() % 10)};
    std::vector<Key> order;
    const int count = mokgen::walk_bwd_order(eoff.data(), e_loc, n_rows, C, num_chunks, nt,
                                             [&](int kind, int c, int le, int rows, int m, int n) {
                                               (void)rows;
                                               order.emplace_back(kind, c, le, m, n);
                                             });
    if (count != int(order.size())) return fail("the returned count is not the tiles listed", plan);
    // every tile once, against an independent listing
    std::set<Key> want;
    for (int c = 0; c < num_chunks; ++c) {
      const int r0 = c * C, r1 = std::min(n_rows, r0 + C);
      for (int le = 0; le < e_loc; ++le) {
        const int a = std::max(r0, eoff[le]), b = std::min(r1, eoff[le + 1]);
        for (int m = a; m < b; m += 128)
          for (int kind = 0; kind < 2; ++kind)
            for (int n = 0; n < (kind == 0 ? nt.dh : nt.dx); ++n) want.emplace(kind, c, le, m - r0, n);
      }
    }
    for (int le = 0; le < e_loc; ++le) {
      if (eoff[le + 1] == eoff[le]) continue;
      const int c1 = (eoff[le + 1] - 1) / C;
      for (int n = 0; n < nt.wd; ++n) want.emplace(2, c1, le, 0, n);
      for (int n = 0; n < nt.wgu; ++n) want.emplace(3, c1, le, 0, n), want.emplace(4, c1, le, 0, n);
    }
    std::map<Key, int> pos;
    for (int i = 0; i < int(order.size()); ++i)
      if (!pos.emplace(order[i], i).second) return fail("a tile is listed twice", plan);
    if (pos.size() != want.size()) return fail("the order lists a different number of tiles", plan);
    for (const Key& k : want)
      if (!pos.count(k)) return fail("a tile is missing", plan);
    // dependencies before their dependents
    std::vector<int> last_dh_of_expert(e_loc, -1);
    for (int i = 0; i < int(order.size()); ++i) {
      const auto [kind, c, le, m, n] = order[i];
      if (kind == 0) last_dh_of_expert[le] = std::max(last_dh_of_expert[le], i);
      if (kind == 1)
        for (int k = 0; k < nt.dh; ++k)
          if (pos.at(Key(0, c, le, m, k)) >= i) return fail("a dx tile comes before one of its block's dh tiles", plan);
    }
    for (int i = 0; i < int(order.size()); ++i) {
      const auto [kind, c, le, m, n] = order[i];
      if (kind >= 2 && last_dh_of_expert[le] >= i) return fail("a weight tile comes before one of its expert's dh tiles", plan);
    }
    // the weight tiles' k-blocks of each expert: one per kKb rows of each of its chunk segments
    // (the last of a segment short), covering its rows in order, each inside one chunk at that
    // chunk's ring rows
    for (int le = 0; le < e_loc; ++le) {
      const int kKb = 1 << (3 + int(rng() % 4)), R = 2 + int(rng() % 6);  // 8 .. 64
      int next = eoff[le], want_kb = 0;
      bool bad = false;
      const int n_kb = mokgen::bwd_expert_kblocks(eoff.data(), le, C, R, kKb, [&](int kb, int c, int ring_row, int rows) {
        const int seg_end = std::min(eoff[le + 1], (next / C + 1) * C);
        if (kb != want_kb++ || c != next / C || rows <= 0 || rows > kKb) bad = true;
        if (rows < kKb && next + rows != seg_end) bad = true;  // short only at a segment's end
        if (next + rows > seg_end) bad = true;                 // inside one chunk
        if (ring_row != (c % R) * C + next % C) bad = true;
        next += rows;
      });
      int expect = 0;
      for (int c = eoff[le] / C; eoff[le + 1] > eoff[le] && c <= (eoff[le + 1] - 1) / C; ++c)
        expect += int(mokgen::ceil_div(std::min(eoff[le + 1], (c + 1) * C) - std::max(eoff[le], c * C), kKb));
      if (bad || next != eoff[le + 1] || n_kb != expect || n_kb != want_kb)
        return fail("an expert's k-blocks do not cover its chunk segments in ring order", plan);
    }
    // the ring
    const int r_min = mokgen::bwd_min_ring(eoff.data(), e_loc, C);
    if (!ring_ok(r_min, num_chunks, C, eoff, e_loc, order)) return fail("the order deadlocks at bwd_min_ring slots", plan);
    int brute = 2;
    while (!ring_ok(brute, num_chunks, C, eoff, e_loc, order)) ++brute;
    if (brute > r_min) return fail("a smaller ring than bwd_min_ring's failed where the bound says it should not", plan);
    tight += brute == r_min;
    checked += long(order.size());
  }
  std::printf("ok %lld %d\n", checked, tight);
  return 0;
}
