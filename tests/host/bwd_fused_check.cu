// Host check of templates/include/mokgen/bwd_fused.cuh (run by tests/test_bwd_fused.py): on
// random plans (experts with no rows, one row, many rows; offs past the operands' rows; chunks
// of 1-5000 rows, lags 1-4, 1-140 CTAs, random tile counts per kind), the fused backward's order
// lists every expected tile exactly once (against an independent listing), gives item i to CTA
// i mod ctas in the order's order, puts every tile after its dependencies, gives every block's
// swiglu item to one CTA in increasing block order, and a simulation of the roles (each CTA's
// GEMM tiles and its swiglu items, each in order, an item running once its dependencies are
// done) finishes every item: no deadlock. Prints "ok N" (items checked) or the first problem,
// and exits 1.
#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <map>
#include <tuple>
#include <vector>

#include "mokgen/bwd_fused.cuh"

using mokgen::bwd::kTileRows;
namespace bwd = mokgen::bwd;

static unsigned long long rng_state = 0x2545F4914F6CDD1Dull;
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

struct Item {
  int kind, e, row0, rows, blk, nb, m, n;
  bool operator<(const Item& o) const {
    return std::tie(kind, e, row0, rows, blk, nb, m, n) < std::tie(o.kind, o.e, o.row0, o.rows, o.blk, o.nb, o.m, o.n);
  }
  bool operator==(const Item& o) const { return !(*this < o) && !(o < *this); }
};

int main(int argc, char** argv) {
  const int plans = argc > 1 ? std::atoi(argv[1]) : 300;
  long long checked = 0;
  for (int p = 0; p < plans; ++p) {
    const int E = 1 + rnd(p % 5 == 0 ? 300 : 30);
    std::vector<int> counts(E);
    for (int& c : counts) {
      const int kind = rnd(4);
      c = kind == 0 ? 0 : kind == 1 ? 1 + rnd(3) : kind == 2 ? rnd(300) : rnd(1500);
    }
    std::vector<int32_t> offs(E);
    int sum = 0;
    for (int e = 0; e < E; ++e) offs[e] = sum += counts[e];
    const int total = rnd(4) == 0 ? (sum > 0 ? rnd(sum + 1) : 0) : sum;
    bwd::FusedShape sh;
    sh.dh_n = 1 + rnd(8);
    sh.dx_n = 1 + rnd(28);
    sh.wd_m = 1 + rnd(6);
    sh.wd_n = 1 + rnd(6);
    sh.wgu_m = 1 + rnd(6);
    sh.wgu_n = 1 + rnd(6);
    sh.chunk = 1 + rnd(rnd(2) ? 5000 : 300);
    sh.lag = 1 + rnd(4);
    const int ctas = 1 + rnd(140);
    // the independent listing: expert segments, blocks, tiles
    std::vector<int> seg0(E), seg1(E), blk0(E), nblk(E);
    int blocks = 0;
    for (int e = 0, start = 0; e < E; ++e) {
      seg0[e] = start;
      seg1[e] = std::max(start, std::min(offs[e], total));
      start = seg1[e];
      blk0[e] = blocks;
      nblk[e] = (seg1[e] - seg0[e] + kTileRows - 1) / kTileRows;
      blocks += nblk[e];
    }
    if (blocks > bwd::fused_max_blocks(total, E)) return fail("more blocks than fused_max_blocks", p);
    std::vector<Item> want;
    for (int e = 0; e < E; ++e) {
      for (int b = 0; b < nblk[e]; ++b) {
        const int r0 = seg0[e] + b * kTileRows, rows = std::min(kTileRows, seg1[e] - r0);
        for (int n = 0; n < sh.dh_n; ++n) want.push_back({0, e, r0, rows, blk0[e] + b, 1, 0, n});
        for (int n = 0; n < sh.dx_n; ++n) want.push_back({1, e, r0, rows, blk0[e] + b, 1, 0, n});
      }
      for (int m = 0; m < sh.wd_m; ++m)
        for (int n = 0; n < sh.wd_n; ++n) want.push_back({2, e, seg0[e], seg1[e] - seg0[e], blk0[e], nblk[e], m, n});
      for (int m = 0; m < sh.wgu_m; ++m)
        for (int n = 0; n < sh.wgu_n; ++n) want.push_back({3, e, seg0[e], seg1[e] - seg0[e], blk0[e], nblk[e], m, n});
    }
    // the whole order (one CTA)
    std::vector<Item> order;
    bwd::walk_fused(offs.data(), E, total, sh, 0, 1, [&](int kind, int e, int r0, int rows, int blk, int nb, int m, int n) {
      order.push_back({kind, e, r0, rows, blk, nb, m, n});
    });
    std::vector<Item> a = order, b = want;
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    if (a != b) return fail("the order does not list every expected tile exactly once", p);
    std::map<Item, int> pos;
    for (int i = 0; i < int(order.size()); ++i) pos[order[i]] = i;
    // dependencies earlier: dx of block b and weight tiles of expert e after every dh tile of
    // their blocks (so after the swiglu items, placed just after a block's last dh tile)
    std::vector<int> last_dh(blocks, -1);
    for (int i = 0; i < int(order.size()); ++i)
      if (order[i].kind == 0) last_dh[order[i].blk] = i;
    for (int i = 0; i < int(order.size()); ++i) {
      const Item& it = order[i];
      if (it.kind == 1 && last_dh[it.blk] >= i) return fail("a dx tile before its block's dh tiles", p);
      if (it.kind >= 2)
        for (int bb = it.blk; bb < it.blk + it.nb; ++bb)
          if (last_dh[bb] >= i) return fail("a weight tile before its expert's dh tiles", p);
    }
    // each CTA's items: i mod ctas == cta, increasing
    std::vector<std::vector<Item>> per(ctas);
    for (int c = 0; c < ctas; ++c) {
      int last = -1;
      bool ok = true;
      bwd::walk_fused(offs.data(), E, total, sh, c, ctas, [&](int kind, int e, int r0, int rows, int blk, int nb, int m, int n) {
        const Item it{kind, e, r0, rows, blk, nb, m, n};
        const auto f = pos.find(it);
        if (f == pos.end() || f->second <= last || f->second % ctas != c) ok = false;
        if (f != pos.end()) last = f->second;
        per[c].push_back(it);
      });
      if (!ok) return fail("a CTA's items are not its own or not in order", p);
    }
    // swiglu items: every block once, per CTA increasing, with the block's rows
    std::vector<std::vector<std::tuple<int, int, int>>> sw(ctas);
    std::vector<int> sw_hits(blocks, 0);
    for (int c = 0; c < ctas; ++c) {
      int last = -1;
      bool ok = true;
      bwd::walk_fused_swiglu(offs.data(), E, total, c, ctas, [&](int blk, int r0, int rows) {
        if (blk <= last || blk % ctas != c || blk >= blocks) ok = false;
        last = blk;
        if (blk < blocks) ++sw_hits[blk];
        sw[c].push_back({blk, r0, rows});
      });
      if (!ok) return fail("swiglu items: not the CTA's own blocks in increasing order", p);
    }
    for (int e = 0; e < E; ++e)
      for (int bb = 0; bb < nblk[e]; ++bb) {
        const int blk = blk0[e] + bb;
        if (sw_hits[blk] != 1) return fail("swiglu items: a block other than once", p);
      }
    for (int c = 0; c < ctas; ++c)
      for (auto& [blk, r0, rows] : sw[c]) {
        int e = 0;
        while (!(blk >= blk0[e] && blk < blk0[e] + nblk[e])) ++e;
        if (r0 != seg0[e] + (blk - blk0[e]) * kTileRows || rows != std::min(kTileRows, seg1[e] - r0))
          return fail("swiglu items: wrong rows", p);
      }
    // the roles: each CTA's GEMM tiles in order, its swiglu items in order
    std::vector<int> dh_done(blocks, 0), sw_done(blocks, 0);
    std::vector<size_t> gi(ctas, 0), si(ctas, 0);
    size_t left = order.size();
    for (int c = 0; c < ctas; ++c) left += sw[c].size();
    for (bool progress = true; progress && left > 0;) {
      progress = false;
      for (int c = 0; c < ctas; ++c) {
        while (gi[c] < per[c].size()) {
          const Item& it = per[c][gi[c]];
          bool ready = true;
          if (it.kind == 1) ready = sw_done[it.blk] != 0;
          if (it.kind >= 2)
            for (int bb = it.blk; bb < it.blk + it.nb; ++bb) ready = ready && sw_done[bb] != 0;
          if (!ready) break;
          if (it.kind == 0) ++dh_done[it.blk];
          ++gi[c];
          --left;
          progress = true;
        }
        while (si[c] < sw[c].size()) {
          const int blk = std::get<0>(sw[c][si[c]]);
          if (dh_done[blk] != sh.dh_n) break;
          sw_done[blk] = 1;
          ++si[c];
          --left;
          progress = true;
        }
      }
    }
    if (left != 0) return fail("the roles deadlock", p);
    checked += (long long)order.size();
  }
  std::printf("ok %lld\n", checked);
  return 0;
}
