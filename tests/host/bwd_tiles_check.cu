// Host check of templates/include/mokgen/bwd_tiles.cuh (run by tests/test_bwd_gemm.py): on
// random plans (experts with no rows, one row, many rows; offs past the operands' rows; 1-140
// CTAs), the rows-GEMM and weight-gradient walks visit every expected tile exactly once over all
// CTAs, each CTA in increasing tile order (the rows GEMMs' in their band order, v0.43: one CTA's
// walk is that order exactly, and CTA c of C takes its tiles c, c + C, ...), with the expected row
// ranges; the walks by CTA pairs
// give both CTAs of a pair the same sequence, at the two row blocks (weights) or column tiles
// (rows GEMMs) of each pair. Prints "ok N" (tiles
// checked) or the first problem, and exits 1.
#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <map>
#include <tuple>
#include <vector>

#include "mokgen/bwd_tiles.cuh"

using mokgen::bwd::kTileRows;

static unsigned long long rng_state = 0x9E3779B97F4A7C15ull;
static int rnd(int n) {  // xorshift, [0, n)
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return int(rng_state % unsigned(n));
}

static int fail(const char* what, int plan) {
  std::printf("plan %d: %s\n", plan, what);
  return 1;
}

int main(int argc, char** argv) {
  const int plans = argc > 1 ? std::atoi(argv[1]) : 500;
  long long checked = 0;
  for (int p = 0; p < plans; ++p) {
    const int E = 1 + rnd(p % 7 == 0 ? 384 : 24);
    std::vector<int> counts(E);
    for (int& c : counts) {
      const int kind = rnd(4);
      c = kind == 0 ? 0 : kind == 1 ? 1 + rnd(3) : kind == 2 ? rnd(300) : rnd(1200);
    }
    std::vector<int32_t> offs(E);
    int sum = 0;
    for (int e = 0; e < E; ++e) offs[e] = sum += counts[e];
    const int total = rnd(3) == 0 ? (sum > 0 ? rnd(sum + 1) : 0) : sum;  // sometimes fewer operand rows than offs says
    const int n_tiles = 1 + rnd(28), m_tiles = 1 + rnd(16), ctas = 1 + rnd(140);
    // expected segments: expert e owns [min(offs[e-1], total), min(offs[e], total))
    std::vector<int> seg0(E), seg1(E);
    for (int e = 0, start = 0; e < E; ++e) {
      seg0[e] = start;
      seg1[e] = std::min(offs[e], total);
      if (seg1[e] < start) seg1[e] = start;
      start = seg1[e];
    }
    // rows GEMMs
    std::map<std::tuple<int, int, int>, int> want;  // (e, row0, n) -> rows
    for (int e = 0; e < E; ++e)
      for (int r = seg0[e]; r < seg1[e]; r += kTileRows)
        for (int n = 0; n < n_tiles; ++n) want[{e, r, n}] = std::min(kTileRows, seg1[e] - r);
    // bands of row blocks (v0.43): 1 is row block by row block; else column tile by column tile
    // within each band of `band` row blocks
    const int band = p % 3 == 0 ? 1 : 1 + rnd(10);
    // the walk's order for one CTA: experts in order, bands in order, column tiles, row blocks
    std::vector<std::tuple<int, int, int, int>> order;  // (e, row0, rows, n)
    for (int e = 0; e < E; ++e) {
      const int blocks = (seg1[e] - seg0[e] + kTileRows - 1) / kTileRows;
      for (int b0 = 0; b0 < blocks; b0 += band)
        for (int n = 0; n < n_tiles; ++n)
          for (int mb = b0; mb < std::min(blocks, b0 + band); ++mb) {
            const int r = seg0[e] + mb * kTileRows;
            order.push_back({e, r, std::min(kTileRows, seg1[e] - r), n});
          }
    }
    std::vector<std::tuple<int, int, int, int>> one;
    mokgen::bwd::walk_row_tiles(
        offs.data(), E, total, n_tiles, 0, 1, [&](int e, int row0, int rows, int n) { one.push_back({e, row0, rows, n}); },
        1, 0, band);
    if (one != order) return fail("row tiles: one CTA's walk is not the band order", p);
    std::map<std::tuple<int, int, int>, int> seen;
    for (int cta = 0; cta < ctas; ++cta) {
      size_t next = size_t(cta);  // the index in `order` of this CTA's next tile
      bool ordered = true;
      mokgen::bwd::walk_row_tiles(
          offs.data(), E, total, n_tiles, cta, ctas,
          [&](int e, int row0, int rows, int n) {
            // CTA cta takes tiles cta, cta + ctas, ... of the one CTA's order
            if (next >= order.size() || order[next] != std::make_tuple(e, row0, rows, n)) ordered = false;
            next += size_t(ctas);
            if (seen.count({e, row0, n}) || !want.count({e, row0, n}) || want[{e, row0, n}] != rows)
              seen[{e, -1, -1}] = -1;
            seen[{e, row0, n}] = rows;
          },
          1, 0, band);
      if (!ordered || next < order.size())  // out of order, or stopped before its last tile
        return fail("a CTA's row tiles are not its share of the band order", p);
    }
    if (seen != want) return fail("row tiles: not every expected tile exactly once with its rows", p);
    checked += (long long)want.size();
    // rows GEMMs by CTA pairs (an even n_tiles): both CTAs of a pair visit the same (expert,
    // row block) in step, at column tiles 2 np and 2 np + 1; every tile once with its rows
    if (n_tiles % 2 == 0) {
      const int pairs = 1 + rnd(70);
      std::map<std::tuple<int, int, int>, int> paired;
      for (int c = 0; c < pairs; ++c) {
        std::vector<std::tuple<int, int, int, int>> walked[2];  // (e, row0, rows, n / 2) per rank
        bool ok = true;
        for (int crank = 0; crank < 2; ++crank)
          mokgen::bwd::walk_row_tiles(
              offs.data(), E, total, n_tiles, c, pairs,
              [&](int e, int row0, int rows, int n) {
                if (n % 2 != crank || paired.count({e, row0, n})) ok = false;
                paired[{e, row0, n}] = rows;
                walked[crank].push_back({e, row0, rows, n / 2});
              },
              2, crank, band);
        if (!ok) return fail("paired row tiles: column tile parity wrong or a tile visited twice", p);
        if (walked[0] != walked[1]) return fail("paired row tiles: the pair's CTAs walk different rows", p);
      }
      if (paired != want) return fail("paired row tiles: not every expected tile exactly once with its rows", p);
      checked += (long long)paired.size();
    }
    // weight gradients
    std::vector<int> hits(size_t(E) * m_tiles * n_tiles, 0);
    for (int cta = 0; cta < ctas; ++cta) {
      long long last = -1;
      bool ok = true;
      mokgen::bwd::walk_weight_tiles(offs.data(), E, total, m_tiles, n_tiles, cta, ctas,
                                     [&](int e, int row0, int rows, int m, int n) {
                                       const long long q = ((long long)e * m_tiles + m) * n_tiles + n;
                                       if (q <= last || q % ctas != cta || row0 != seg0[e] || rows != seg1[e] - seg0[e])
                                         ok = false;
                                       last = q;
                                       ++hits[size_t(q)];
                                     });
      if (!ok) return fail("weight tiles: order, ownership or rows wrong", p);
    }
    for (int h : hits)
      if (h != 1) return fail("weight tiles: a tile visited other than once", p);
    checked += (long long)hits.size();
    // weight gradients by CTA pairs (an even m_tiles): both CTAs of a pair visit the same
    // (expert, rows, column tile) in step, at row blocks 2 mp and 2 mp + 1; every tile once
    if (m_tiles % 2 == 0) {
      const int pairs = 1 + rnd(70);
      std::fill(hits.begin(), hits.end(), 0);
      for (int c = 0; c < pairs; ++c) {
        std::vector<std::tuple<int, int, int, int>> walked[2];  // (e, row0, rows, n) per rank
        bool ok = true;
        for (int crank = 0; crank < 2; ++crank)
          mokgen::bwd::walk_weight_tiles(
              offs.data(), E, total, m_tiles, n_tiles, c, pairs,
              [&](int e, int row0, int rows, int m, int n) {
                if (m % 2 != crank || row0 != seg0[e] || rows != seg1[e] - seg0[e]) ok = false;
                walked[crank].push_back({e, row0, rows, n});
                ++hits[size_t((long long)e * m_tiles + m) * n_tiles + n];
              },
              2, crank);
        if (!ok) return fail("paired weight tiles: row block parity or rows wrong", p);
        if (walked[0] != walked[1]) return fail("paired weight tiles: the pair's CTAs walk different tiles", p);
      }
      for (int h : hits)
        if (h != 1) return fail("paired weight tiles: a tile visited other than once", p);
      checked += (long long)hits.size();
    }
  }
  std::printf("ok %lld\n", checked);
  return 0;
}
