// Host check of templates/include/mokgen/tile_order.cuh (run by tests/test_tile_order.py):
// the walks visit, for every unit, exactly the tiles the v0.2-v0.4 walk visited (every tile of
// the order with a modulo each; CTAs alone in the column-major order of v0.17), in the same
// order, on random receive plans; and the dynamic deal's walks, on random claim sequences. Prints "ok N" or
// the first difference, and exits 1.
#include <cstdio>
#include <cstdlib>
#include <set>
#include <tuple>
#include <vector>

#include "mokgen/tile_order.cuh"

using Tile = std::tuple<int, int, int, int, int, int, int>;  // kind, c, le, rows, m, n, share

// The v0.2-v0.4 walk, kept here as the reference: every tile t of the order, t % units == unit.
static std::vector<Tile> reference_flow(const std::vector<int>& eoff, int e_loc, int n_rows, int C, int num_chunks,
                                        int lag, int up_tiles, int down_tiles, int unit, int units, int crank, int kPair,
                                        int t) {
  std::vector<Tile> out;
  for (int step = 0; step < num_chunks + lag; ++step)
    for (int kind = 0; kind < 2; ++kind) {
      const int c = kind == 0 ? step : step - lag;
      if (c < 0 || c >= num_chunks || (kind == 0 && step >= num_chunks)) continue;
      const int r0 = c * C, r1 = std::min(n_rows, r0 + C);
      const int n_tiles = kind == 0 ? up_tiles : down_tiles;
      for (int le = 0; le < e_loc; ++le) {
        const int a = std::max(r0, eoff[le]), b = std::min(r1, eoff[le + 1]);
        if (kPair == 1) {  // column-major (v0.17)
          for (int n = 0; n < n_tiles; ++n)
            for (int m = a; m < b; m += 128, ++t)
              if (t % units == unit) out.emplace_back(kind, c, le, std::min(128, b - m), m - r0, n, 0);
        } else {  // by column pairs: pair-tiles of columns n2, n2 + 1, then the odd block's half
          const int nb = b > a ? (b - a + 127) / 128 : 0;
          for (int n2 = 0; n2 < n_tiles; n2 += 2) {
            for (int n = n2; n < n2 + 2 && n < n_tiles; ++n)
              for (int mb = 0; mb + 1 < nb; mb += 2, ++t)
                if (t % units == unit) {
                  const int m = a + (mb + crank) * 128;
                  out.emplace_back(kind, c, le, std::min(128, b - m), m - r0, n, 1);
                }
            if (nb % 2) {
              if (t % units == unit) {
                const int m = a + (nb - 1) * 128;
                const bool real = n2 + crank < n_tiles;
                out.emplace_back(kind, c, le, real ? std::min(128, b - m) : 0, m - r0, real ? n2 + crank : n2, 2);
              }
              ++t;
            }
          }
        }
      }
    }
  return out;
}

static int fail(const char* what, int trial) {
  std::printf("trial %d: %s\n", trial, what);
  return 1;
}

int main(int argc, char** argv) {
  const int trials = argc > 1 ? std::atoi(argv[1]) : 2000;
  std::srand(12345);
  auto rnd = [](int lo, int hi) { return lo + std::rand() % (hi - lo + 1); };  // [lo, hi]
  long checked = 0;
  for (int trial = 0; trial < trials; ++trial) {
    const bool big = trial % 10 == 0;  // a few large plans: many experts, many units
    const int e_loc = big ? rnd(100, 256) : rnd(1, 48);
    std::vector<int> eoff(e_loc + 1, 0);
    const int shape = rnd(0, 3);  // uniform, skewed to one expert, many empty, tiny counts
    for (int le = 0; le < e_loc; ++le) {
      int rows = shape == 0 ? rnd(0, 700) : shape == 1 ? (le == e_loc / 2 ? rnd(500, 5000) : rnd(0, 40))
                 : shape == 2 ? (rnd(0, 3) == 0 ? rnd(1, 900) : 0) : rnd(0, 130);
      eoff[le + 1] = eoff[le] + rows;
    }
    const int n_rows = eoff[e_loc];
    const int C = rnd(0, 3) == 0 ? rnd(1, 4096) : 128 * rnd(1, 16);  // multiples of 128, and any
    const int num_chunks = (n_rows + C - 1) / C;
    const int lag = rnd(0, 1), up_tiles = rnd(1, 6), down_tiles = rnd(1, 9);
    const int t0 = rnd(0, 1) ? 0 : rnd(0, 1) ? rnd(1, 60) : rnd(61, 5000);
    for (int kPair = 1; kPair <= 2; ++kPair) {
      const int units = big ? rnd(60, 140) : rnd(1, 24);
      std::vector<int> real_down(num_chunks, 0);  // rows > 0 down tiles per chunk, over all units
      std::set<std::tuple<int, int, int, int, int>> seen;  // (kind, c, le, m, n) of real tiles: each once
      for (int unit = 0; unit < units; ++unit)
        for (int crank = 0; crank < kPair; ++crank) {
          const auto want = reference_flow(eoff, e_loc, n_rows, C, num_chunks, lag, up_tiles, down_tiles, unit, units,
                                           crank, kPair, t0);
          std::vector<Tile> got;
          auto fn = [&](int kind, int c, int le, int rows, int m, int n, int share) {
            got.emplace_back(kind, c, le, rows, m, n, share);
          };
          if (kPair == 1)
            mokgen::walk_flow_tiles<1>(eoff.data(), e_loc, n_rows, C, num_chunks, lag, up_tiles, down_tiles, unit,
                                       units, crank, t0, fn);
          else
            mokgen::walk_flow_tiles<2>(eoff.data(), e_loc, n_rows, C, num_chunks, lag, up_tiles, down_tiles, unit,
                                       units, crank, t0, fn);
          for (const Tile& tl : got) {
            if (std::get<0>(tl) == 1 && std::get<3>(tl) > 0) ++real_down[std::get<1>(tl)];
            if (std::get<3>(tl) > 0 &&
                !seen.emplace(std::get<0>(tl), std::get<1>(tl), std::get<2>(tl), std::get<4>(tl), std::get<5>(tl)).second)
              return fail("a real tile visited twice", trial);
          }
          if (got != want) {
            std::printf("kPair %d unit %d/%d crank %d: %zu tiles, want %zu\n", kPair, unit, units, crank, got.size(),
                        want.size());
            return fail("flow walk differs", trial);
          }
          checked += long(got.size());
        }
      for (int c = 0; c < num_chunks; ++c)  // what the signaller counts to free a slot
        if (mokgen::group_tiles(eoff.data(), e_loc, c * C, std::min(n_rows, c * C + C), down_tiles) != real_down[c])
          return fail("group_tiles differs from the real down tiles", trial);
      for (int c = 0; c < num_chunks; ++c) {  // every up tile visited (each once: seen above)
        int up = 0;
        for (const auto& k : seen) up += std::get<0>(k) == 0 && std::get<1>(k) == c;
        if (mokgen::group_tiles(eoff.data(), e_loc, c * C, std::min(n_rows, c * C + C), up_tiles) != up)
          return fail("the real up tiles are not all visited", trial);
      }
    }
    // the dynamic deal (CTAs alone): a shared counter hands the running indices out in order,
    // so under any interleaving each unit gets an increasing subsequence of them; here a random
    // one per unit. Each unit's walk must give the tiles the whole order has at its indices.
    // Pairs: both CTAs of a unit get its indices; crank c's walk gives the reference's crank-c tiles.
    for (int kPair = 1; kPair <= 2; ++kPair)
      for (int crank = 0; crank < kPair; ++crank) {
        const auto full = reference_flow(eoff, e_loc, n_rows, C, num_chunks, lag, up_tiles, down_tiles, 0, 1, crank,
                                         kPair, t0);
        const int units = big ? rnd(60, 140) : rnd(1, 24);
        std::vector<std::vector<int>> mine(units);
        for (int g = t0; g < t0 + int(full.size()) + units; ++g) mine[rnd(0, units - 1)].push_back(g);
        size_t visited = 0;
        for (int unit = 0; unit < units; ++unit) {
          const std::vector<int>& idx = mine[unit];
          size_t k = 0;
          auto next = [&](int) { ++k; return k < idx.size() ? idx[k] : 1 << 30; };
          int want = idx.empty() ? 1 << 30 : idx[0];
          std::vector<Tile> got;
          auto fn = [&](int kind, int c, int le, int rows, int m, int n, int sh) { got.emplace_back(kind, c, le, rows, m, n, sh); };
          const int end =
              kPair == 1 ? mokgen::walk_flow_tiles_dealt<1>(eoff.data(), e_loc, n_rows, C, num_chunks, lag, up_tiles,
                                                           down_tiles, crank, t0, want, next, fn)
                         : mokgen::walk_flow_tiles_dealt<2>(eoff.data(), e_loc, n_rows, C, num_chunks, lag, up_tiles,
                                                           down_tiles, crank, t0, want, next, fn);
          if (end != t0 + int(full.size())) return fail("dealt walk ends elsewhere", trial);
          for (size_t i = 0; i < got.size(); ++i)
            if (i >= idx.size() || got[i] != full[idx[i] - t0]) return fail("dealt walk differs", trial);
          if (want < end) return fail("dealt walk stopped early", trial);
          visited += got.size();
          checked += long(got.size());
        }
        if (visited != full.size()) return fail("dealt walks do not cover the order", trial);
      }
    // one group at a time (the phased schedule), and the tile count per group (the signaller)
    const int units = big ? rnd(60, 140) : rnd(1, 24);
    for (int c = 0; c < num_chunks; ++c)
      for (int kind = 0; kind < 2; ++kind) {
        const int r0 = c * C, r1 = std::min(n_rows, r0 + C), n_tiles = kind == 0 ? up_tiles : down_tiles;
        int all = 0;
        for (int unit = 0; unit < units; ++unit) {
          std::vector<Tile> want, got;
          int t = 0;
          for (int le = 0; le < e_loc; ++le) {
            const int a = std::max(r0, eoff[le]), b = std::min(r1, eoff[le + 1]);
            for (int n = 0; n < n_tiles; ++n)
              for (int m = a; m < b; m += 128, ++t)
                if (t % units == unit) want.emplace_back(kind, c, le, std::min(128, b - m), m - r0, n, 0);
          }
          const int end = mokgen::walk_group<1>(eoff.data(), e_loc, mokgen::find_expert(eoff.data(), e_loc, r0), r0, r1,
                                                kind, c, n_tiles, unit, units, 0, 0,
                                                [&](int k, int cc, int le, int rows, int m, int n, int s) {
                                                  got.emplace_back(k, cc, le, rows, m, n, s);
                                                });
          if (got != want || end != t) return fail("group walk differs", trial);
          all += int(got.size());
        }
        if (mokgen::group_tiles(eoff.data(), e_loc, r0, r1, n_tiles) != all) return fail("group tile count differs", trial);
      }
    // find_expert against the linear search
    for (int r0 = 0; r0 <= n_rows; r0 += rnd(1, 97))
      if (mokgen::find_expert(eoff.data(), e_loc, r0) != mokgen::advance_expert(eoff.data(), e_loc, 0, r0))
        return fail("find_expert differs", trial);
  }
  // The fused shared expert's pair-tiles (walk_shared_pairs_dealt): for every token count to
  // 1300 and column-tile counts 1-5 (up) and 1-9 (down), the two CTAs of a pair get the same
  // sequence of tiles (kind, share; the shared column when they share the weight tile, the
  // shared rows when they share x's), every real (block, column) of each kind once, rows within
  // [1, 128] and T's, each block's up tiles exactly up_tiles times (what its down tiles wait
  // for), every up tile before every down tile, and a block pair's down tiles after all of its
  // own up tiles and before the next pair's up tiles end (block pairs in turn).
  for (int T = 0; T <= 1300; T += T < 300 ? 1 : 7)
    for (int up_tiles = 1; up_tiles <= 5; ++up_tiles)
      for (int down_tiles = 1; down_tiles <= 9; down_tiles += 2) {
        std::vector<Tile> got[2];
        for (int crank = 0; crank < 2; ++crank) {
          int want = 0;
          const int end = mokgen::walk_shared_pairs_dealt(T, up_tiles, down_tiles, crank, 0, want,
                                                          [](int w) { return w + 1; },
                                                          [&](int k, int c, int le, int rows, int m, int n, int s) {
                                                            got[crank].emplace_back(k, c, le, rows, m, n, s);
                                                          });
          if (end != int(got[crank].size()) || want != end) return fail("shared walk's running index", T);
        }
        if (got[0].size() != got[1].size()) return fail("shared walk: the pair's CTAs get other tile counts", T);
        const int blocks = (T + 127) / 128;
        std::vector<int> seen_up(blocks * up_tiles, 0), seen_down(blocks * down_tiles, 0), bumps(blocks, 0);
        bool down_begun = false;
        for (size_t i = 0; i < got[0].size(); ++i) {
          const Tile& a = got[0][i];
          const Tile& b = got[1][i];
          const int kind = std::get<0>(a), share = std::get<6>(a);
          if (kind != std::get<0>(b) || share != std::get<6>(b)) return fail("shared walk: the pair's tiles differ", T);
          if (share == 1 && std::get<5>(a) != std::get<5>(b)) return fail("shared walk: a shared weight tile differs", T);
          if (share == 2 && std::get<4>(a) != std::get<4>(b)) return fail("shared walk: shared x rows differ", T);
          if (kind == 3) down_begun = true;
          else if (down_begun) return fail("shared walk: an up tile after a down tile", T);
          for (const Tile* tl : {&a, &b}) {
            const int rows = std::get<3>(*tl), m = std::get<4>(*tl), n = std::get<5>(*tl);
            if (rows == 0) continue;  // a pair's partner of zero rows
            const int nt = kind == 2 ? up_tiles : down_tiles;
            if (m % 128 || m / 128 >= blocks || rows != std::min(128, T - m) || n < 0 || n >= nt)
              return fail("shared walk: a tile outside the rows or columns", T);
            if (++(kind == 2 ? seen_up : seen_down)[m / 128 * nt + n] != 1) return fail("shared walk: a tile twice", T);
            if (kind == 2) ++bumps[m / 128];
          }
          checked += 2;
        }
        for (int v : seen_up) if (v != 1) return fail("shared walk: an up tile missing", T);
        for (int v : seen_down) if (v != 1) return fail("shared walk: a down tile missing", T);
        for (int v : bumps) if (v != up_tiles) return fail("shared walk: a block's up tiles counted wrong", T);
        // block pairs in turn: the up tiles of blocks 2p, 2p + 1 are one contiguous run of indices
        int last_pair = -1;
        for (const Tile& tl : got[0])
          if (std::get<0>(tl) == 2) {
            const int pair = std::get<4>(tl) / 256;
            if (pair < last_pair) return fail("shared walk: block pairs out of turn", T);
            last_pair = pair;
          }
      }
  std::printf("ok %ld\n", checked);
  return 0;
}
