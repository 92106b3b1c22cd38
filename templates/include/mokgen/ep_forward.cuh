// The expert-parallel forward megakernel: one persistent, cooperative launch per rank (or, for
// virtual ranks on one GPU, one launch for all W ranks, each a group of CTAs).
//
// Per rank, in order:
//   1. publish  all CTAs copy x into the rank's symmetric region (unless it is read in place);
//               the first CTAs build the expert-major send lists (ep_routing.cuh: counts, a rank
//               barrier, assignment); a rank barrier; then routing_ready = tag(epoch, 1)
//               (system-scope release).
//   2. plan     CTA 0 waits for every peer's routing_ready, reads the counts for its own experts
//               and lays out the received rows: expert-major, then source rank, then the source's
//               pair order. A pure function of the routing: never of arrival order.
//   3. stream   the rows go through a ring of `ring_chunks` slots of `chunk_rows` rows.
//               Dispatch CTAs PULL chunk c from the owners' x buffers into slot c % S once chunk
//               c - S has been consumed (flow control: the ring never overflows, nothing is
//               dropped); chunk 0 is pulled by all CTAs of the rank, the compute CTAs having
//               nothing else to do until it lands. Compute CTAs take chunks in order as they
//               land: up projection with SwiGLU into the slot's h rows, a barrier, down projection whose epilogue PUSHES
//               each row into the owner's combine slot (t, j), a barrier, slot freed.
//               When all chunks are done: system fence, done[rank] = tag(epoch, 1) on every owner.
//   4. combine  every CTA of the rank waits for done from all W ranks, then reduces its tokens:
//               out[t] = sum_{j=0..K-1} w[t, j] * slot[t, j], fp32, fixed order (combine.cuh).
// Flags are epoch-tagged and every wait is bounded (sync.cuh). The last CTA to exit re-bases the
// barrier counters and advances the epoch, so the next launch needs no reset.
#pragma once

#include "bulk_copy.cuh"
#include "combine.cuh"
#include "ep_routing.cuh"
#include "fwd_trace.cuh"
#include "grouped_gemm.cuh"
#include "hopper_gemm.cuh"
#include "mx_tile.cuh"
#include "sync.cuh"
#include "tile_order.cuh"

#include <cstring>
#include <type_traits>

namespace mokgen {

constexpr int kMaxWorld = 64;
constexpr int kMaxLaunchRanks = 16;

// Per-rank statistics of the last launch (int64 slots in the private region; mokgen.ep reads
// them). Times are %globaltimer ns of this GPU: only differences within one rank mean anything.
enum StatSlot : int {
  kStatRowsReceived = 0,  // rows this rank's experts received (all sources)
  kStatRowsPulled = 1,    // rows pulled into the ring (== received when nothing went wrong)
  kStatRowsPushed = 2,    // rows pushed to owners' combine slots
  kStatRowsRemote = 3,    // rows pulled from other ranks (each is pushed back to its owner too)
  kStatTimeStart = 4,     // the rank's first CTA started
  kStatTimePullFirst = 5, // the first chunk pull started
  kStatTimePullLast = 6,  // the last chunk landed
  kStatTimeDone = 7,      // every push of the rank issued and fenced (done flags raised)
  kStatTimePushFirst = 8, // the first row block's pushes were counted (flow: its first down tile finished)
  kStatSlots = 9,
};

// Run-time parameters of one launch. Plain data, passed by value (__grid_constant__); the Python
// binding mirrors this layout with ctypes and checks sizeof through mokgen_ep_params_bytes().
struct EpParams {
  char* sym[kMaxWorld];                    // symmetric region of every rank (peer pointers)
  char* local[kMaxLaunchRanks];            // private region of each rank in this launch
  const bf16* x[kMaxLaunchRanks];          // [T_r, H]
  const int32_t* ids[kMaxLaunchRanks];     // [T_r, K] global expert ids
  const float* weights[kMaxLaunchRanks];   // [T_r, K]
  const bf16* w_gate[kMaxLaunchRanks];     // [E / W, I, H] this rank's experts
  const bf16* w_up[kMaxLaunchRanks];       // [E / W, I, H]
  const bf16* w_down[kMaxLaunchRanks];     // [E / W, H, I]
  bf16* out[kMaxLaunchRanks];              // [T_r, H]
  // The backward's saved pre-activations (mokgen.backward's "save" policy; null: none): the up
  // tiles of every rank write g and u of each (token, slot) pair they compute, bf16 [g | u], to
  // row `pair` of save_gu[source rank] ([T_src * K, 2 I]). Only when every rank is in the launch
  // (launch_ranks == world: one GPU), so that every source's buffer is local.
  bf16* save_gu[kMaxLaunchRanks];
  // Fused shared expert (Cfg::kFuseShared; null w: none): w_gate / w_up [I, H], w_down [H, I],
  // the same for every rank; scale [T_r] fp32 per token (null: 1), e.g. Qwen's sigmoid gate.
  const bf16* shared_w[3];
  const float* shared_scale[kMaxLaunchRanks];
  Control* ctl;                            // shared by the CTAs of this launch
  long long timeout_ns;                    // bound of every wait
  int num_tokens[kMaxLaunchRanks];         // T_r
  int world;                               // W
  int rank_base;                           // global rank of launch-local rank 0
  int launch_ranks;                        // ranks in this launch (1 on real GPUs)
  int ctas_per_rank;                       // G
  int dispatch_ctas;                       // P of the G CTAs pull; the rest compute
  int max_tokens;                          // capacity of the symmetric buffers, tokens per rank
  int chunk_rows;                          // C, a multiple of 128
  int ring_chunks;                         // S
  int silent_rank;                         // testing: this rank never publishes (-1: none)
};

// TMA descriptors of one launch, encoded on the host from EpParams (Hopper core only).
struct EpMaps {
  CUtensorMap ring_x[kMaxLaunchRanks];  // [S*C, H]    A of the up projection
  CUtensorMap ring_h[kMaxLaunchRanks];  // [S*C, I]    A of the down projection
  CUtensorMap w_gate[kMaxLaunchRanks];  // [E/W*I, H]
  CUtensorMap w_up[kMaxLaunchRanks];    // [E/W*I, H]
  CUtensorMap w_down[kMaxLaunchRanks];  // [E/W*H, I]
  // fused shared expert (Cfg::kFuseShared): the rank's published x and shared h, its weights.
  // MXFP8 builds (Cfg::kMx, never fused) use these two for the A scales of the up and the down
  // tiles instead: the ring's blocked scale planes (mx_tile.cuh, encode_scales_2d)
  CUtensorMap sym_x[kMaxLaunchRanks];     // [max_tokens, H]  A of the shared up projection
  CUtensorMap shared_h[kMaxLaunchRanks];  // [max_tokens, I]  A of the shared down projection
  CUtensorMap sh_gate, sh_up, sh_down;    // [I, H], [I, H], [H, I]
};

// Cfg::kMx, false where a configuration does not say (the layout tests' small configurations).
template <class Cfg, class = void>
struct CfgMx : std::false_type {};
template <class Cfg>
struct CfgMx<Cfg, std::void_t<decltype(Cfg::kMx)>> : std::bool_constant<Cfg::kMx> {};

// MXFP8 builds come in two forms (plan mx_form; docs/architecture.md, "The megakernel's MXFP8 path"):
// - codes (the default): the ring holds E4M3 codes and blocked scales, and the expert tiles are
//   mx_tile.cuh's MxTile, which decodes A in its consumers' registers;
// - expand (Cfg::kMxExpand, v0.57): rows still travel as codes and scales, but the pull writes
//   their exact MX values into the ring as bf16 (k permuted within each 16 as the bf16 MX
//   weights are), the up tiles store h as its MX values in bf16 (MxRoundedRows), and the expert
//   tiles are the bf16 builds' HopperTiles: the same products, no decode in the k-loops.
// MOKGEN_MX_EXPAND (v0.57's measuring macro, kept so that its commands still run) forces the
// expanded form on an MXFP8 build.
#if defined(MOKGEN_MX_EXPAND)
constexpr bool kMxExpandBuild = true;
#else
constexpr bool kMxExpandBuild = false;
#endif
// Cfg::kMxExpand, false where a configuration does not say
template <class Cfg, class = void>
struct CfgMxExpandAsked : std::false_type {};
template <class Cfg>
struct CfgMxExpandAsked<Cfg, std::void_t<decltype(Cfg::kMxExpand)>> : std::bool_constant<Cfg::kMxExpand> {};
// an MXFP8 build whose ring and h hold bf16 MX values (HopperTile)
template <class Cfg>
struct CfgMxExpand : std::bool_constant<CfgMx<Cfg>::value && (kMxExpandBuild || CfgMxExpandAsked<Cfg>::value)> {};
// an MXFP8 build whose ring and h hold codes (MxTile)
template <class Cfg>
struct CfgMxCodes : std::bool_constant<CfgMx<Cfg>::value && !CfgMxExpand<Cfg>::value> {};
// Cfg::kMxRawB (plan mx_fwd_weights "raw", v0.68), false where a configuration does not say: an
// expanded MXFP8 build whose tiles take the weights as the layer holds them (bf16) and quantize
// each stage's B in shared memory (mx_tile.cuh MxQuantB) instead of reading their converted values
template <class Cfg, class = void>
struct CfgMxRawB : std::false_type {};
template <class Cfg>
struct CfgMxRawB<Cfg, std::void_t<decltype(Cfg::kMxRawB)>> : std::bool_constant<Cfg::kMxRawB> {};

// The MXFP8 builds' extra offsets (Cfg::kMx), as empty bases for the others: the bf16 builds'
// layouts, and so their kernel parameters, stay as they were.
template <bool kMx>
struct SymMxOffsets {};
template <>
struct SymMxOffsets<true> {
  size_t x_scales;
};
template <bool kMx>
struct LocalMxOffsets {};
template <>
struct LocalMxOffsets<true> {
  size_t ring_x_scales, ring_h_scales;
};

// Byte offsets inside a rank's symmetric region (identical on every rank).
template <class Cfg>
struct SymLayout : SymMxOffsets<CfgMx<Cfg>::value> {
  size_t routing_ready, done, send_count, send_offset, send_pairs, x, slots, shared_blk, shared_h, shared_y, total;
  MOKGEN_HOST_DEVICE explicit SymLayout(int64_t max_tokens) {
    size_t at = 0;
    auto take = [&](size_t bytes) { const size_t here = at; at = align_up(at + bytes, 256); return here; };
    routing_ready = take(8);
    done = take(8 * kMaxWorld);
    send_count = take(4 * Cfg::kExperts);
    send_offset = take(4 * (Cfg::kExperts + 1));
    send_pairs = take(4 * max_tokens * Cfg::kTopK);
    // the published rows: bf16, or (CfgMx<Cfg>::value) E4M3 codes [max_tokens, H] and E8M0 scales
    // [max_tokens, H / 32] (a row's scales contiguous, as the pull copies rows)
    x = take((CfgMx<Cfg>::value ? 1 : sizeof(bf16)) * max_tokens * Cfg::kHidden);
    if constexpr (CfgMx<Cfg>::value) this->x_scales = take(max_tokens * Cfg::kHidden / 32);
    slots = take(sizeof(bf16) * max_tokens * Cfg::kTopK * Cfg::kHidden);
    // fused shared expert (empty without): up tiles done per 128-token block, h and y rows
    const int64_t fuse = Cfg::kFuseShared ? 1 : 0;
    shared_blk = take(8 * fuse * ((max_tokens + 127) / 128));
    shared_h = take(sizeof(bf16) * fuse * max_tokens * Cfg::kInter);
    shared_y = take(sizeof(bf16) * fuse * max_tokens * Cfg::kHidden);
    total = at;
  }
};

// Byte offsets inside a rank's private region.
template <class Cfg>
struct LocalLayout : LocalMxOffsets<CfgMxCodes<Cfg>::value> {
  size_t bar_rank, bar_compute, tile_next, stats, chunk_landed, chunk_free, chunk_arrived, chunk_done, block_done,
      recv_expert_offset, recv_base, recv_src_off, ring_meta, ring_x, ring_h, route_hist, total;
  MOKGEN_HOST_DEVICE LocalLayout(int world, int chunk_rows, int ring_chunks) {
    const int64_t e_loc = Cfg::kExperts / world;
    const int64_t ring_rows = int64_t(chunk_rows) * ring_chunks;
    size_t at = 0;
    auto take = [&](size_t bytes) { const size_t here = at; at = align_up(at + bytes, 256); return here; };
    bar_rank = take(8);
    bar_compute = take(8);
    tile_next = take(8);  // flow schedule: the next running index to claim (u32; 0 between launches)
    stats = take(8 * kStatSlots);
    chunk_landed = take(8 * ring_chunks);
    chunk_free = take(8 * ring_chunks);
    chunk_arrived = take(8 * ring_chunks);  // CTAs done with their part of the slot's chunk (P parts; G for chunk 0)
    chunk_done = take(8 * ring_chunks);   // flow schedule: down tiles finished, per slot
    block_done = take(8 * ring_rows);     // flow schedule: up tiles finished, per row block start
    recv_expert_offset = take(4 * (e_loc + 1));
    recv_base = take(4 * (Cfg::kExperts + 1));
    recv_src_off = take(4 * Cfg::kExperts);
    ring_meta = take(8 * ring_rows);
    // ring rows and h rows: bf16, or (CfgMxCodes<Cfg>::value) E4M3 codes plus E8M0 scales in the
    // tiles' blocked layout [K / 128, ring_rows, 4] (a k128 block's scales of consecutive rows together)
    ring_x = take((CfgMxCodes<Cfg>::value ? 1 : sizeof(bf16)) * ring_rows * Cfg::kHidden);
    ring_h = take((CfgMxCodes<Cfg>::value ? 1 : sizeof(bf16)) * ring_rows * Cfg::kInter);
    if constexpr (CfgMxCodes<Cfg>::value) {
      this->ring_x_scales = take(ring_rows * Cfg::kHidden / 32);
      this->ring_h_scales = take(ring_rows * Cfg::kInter / 32);
    }
    route_hist = take(4 * kRouteParts * Cfg::kExperts);  // routing prologue: pairs per (part, expert)
    total = at;
  }
};

template <class T>
MOKGEN_DEVICE T* at(char* base, size_t offset) { return reinterpret_cast<T*>(base + offset); }

// Output-row functors of the fused-shared-expert build (one type per tile kind, so routed and
// shared tiles share one inlined mainloop): row r of a tile -> bf16* of its column 0.
template <int kLd>
struct StridedRows {  // rows kLd elements apart from base (h rows of the ring or of the shared expert)
  bf16* base;
  MOKGEN_DEVICE bf16* operator()(int r) const { return base + int64_t(r) * kLd; }
};
template <int kH>
struct SharedOrSlotRows {  // shared y rows when shared != null, else the owners' combine slots
  bf16* shared;
  const int2* meta;  // (source rank, pair) of each ring row of the tile
  char* const* sym;
  size_t slots_off;
  MOKGEN_DEVICE bf16* operator()(int r) const {
    if (shared != nullptr) return shared + int64_t(r) * kH;
    const int2 d = meta[r];
    return at<bf16>(sym[d.x], slots_off) + int64_t(d.y) * kH;
  }
};

// The MX up tile's save rows: SaveRows's rows (below), the ring's (source rank, pair) table
// found from the rank's private region when the epilogue asks (loc: a pointer the tile keeps
// live anyway; meta_off: the table's offset, a kernel parameter). Holding a pointer to the
// tile's part of the table through the k-loop spilled one 64-bit register (12 / 28 bytes, v0.64).
template <int kI>
struct SaveRingRows {
  static constexpr bool kMay = true;
  bf16* const* base;    // EpParams::save_gu, by source rank (all ranks are in the launch)
  const char* loc;      // the rank's private region
  const size_t& meta_off;  // LocalLayout::ring_meta (in the kernel's parameters)
  int row0;             // the tile's first ring row
  MOKGEN_DEVICE bool enabled() const { return base[0] != nullptr; }
  MOKGEN_DEVICE bf16* operator()(int r) const {
    const int2 d = reinterpret_cast<const int2*>(loc + meta_off)[row0 + r];
    return base[d.x] + int64_t(d.y) * (2 * kI);
  }
};

// The gated epilogue's save rows (hopper_gemm.cuh, NoSaveRows): row r of an up tile -> the
// [g | u] row of its (source rank, pair) in that source's save buffer (EpParams::save_gu).
template <int kI>
struct SaveRows {
  static constexpr bool kMay = true;
  bf16* const* base;  // EpParams::save_gu, by source rank (all ranks are in the launch)
  const int2* meta;   // (source rank, pair) of each ring row of the tile
  bool on;            // false for tiles whose rows are not routed pairs (the fused shared expert's)
  MOKGEN_DEVICE bool enabled() const { return on && base[0] != nullptr; }
  MOKGEN_DEVICE bf16* operator()(int r) const {
    const int2 d = meta[r];
    return base[d.x] + int64_t(d.y) * (2 * kI);
  }
};

MOKGEN_HOST_DEVICE constexpr size_t max3(size_t a, size_t b, size_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

// The two GEMM cores: Cfg::kWgmma selects the Hopper one (TMA + wgmma, 384 threads per CTA) or
// the portable one (cp.async + mma.sync, 256 threads per CTA).
template <class Cfg, bool kWgmma = Cfg::kWgmma>
struct EpCore;
template <class Cfg>
struct EpCore<Cfg, false> {
  static_assert(!Cfg::kMx, "MXFP8 builds need the Hopper core");
  using Up = GemmTile<Cfg::kInter, Cfg::kHidden, true, Cfg::kHasClamp, Cfg::kStages>;
  using Down = GemmTile<Cfg::kHidden, Cfg::kInter, false, Cfg::kHasClamp, Cfg::kStages>;
  static constexpr int kThreads = 256;
};
template <class Cfg, bool kMx = CfgMxCodes<Cfg>::value>
struct EpHopperTiles {
  // one pipeline serves both tile kinds, so both step through it with the larger stage size
  static constexpr int kStride = (128 + (256 > Cfg::kDownBlockN ? 256 : Cfg::kDownBlockN)) * Cfg::kBlockK * 2;
  // the weights raw (CfgMxRawB): each stage's B quantized by the consumers; in CTA pairs under
  // -DMOKGEN_MX_RAWB_SPLIT (measuring builds, v0.70), a shared B's two halves by the two CTAs
#if defined(MOKGEN_MX_RAWB_SPLIT)
  using QuantB = std::conditional_t<Cfg::kCluster == 2, sm90::MxQuantBSplit, sm90::MxQuantB>;
#else
  using QuantB = sm90::MxQuantB;
#endif
  using StageB = std::conditional_t<CfgMxRawB<Cfg>::value, QuantB, sm90::PlainB>;
  using Up = sm90::HopperTile<Cfg::kInter, Cfg::kHidden, true, Cfg::kHasClamp, Cfg::kStages, 256, kStride, Cfg::kCluster,
                              Cfg::kBlockK, Cfg::kStagger, StageB>;
  using Down = sm90::HopperTile<Cfg::kHidden, Cfg::kInter, false, Cfg::kHasClamp, Cfg::kStages, Cfg::kDownBlockN, kStride,
                                Cfg::kCluster, Cfg::kBlockK, Cfg::kStagger, StageB>;
  static_assert(Cfg::kStagger == 0 || Cfg::kFlow, "the consumers' stagger: the flow schedule only");
  static_assert(!CfgMxRawB<Cfg>::value || CfgMxExpand<Cfg>::value,
                "the weights raw (kMxRawB): expanded MXFP8 builds only (the bf16 tiles' B)");
};
// MXFP8 (Cfg::kMx): the tiles of mx_tile.cuh, A as E4M3 rows plus scales (a stage: A codes, B bf16
// MX values, the k128 block's A scales), under the flow schedule, single CTAs or CTA pairs
template <class Cfg>
struct EpHopperTiles<Cfg, true> {
  // the gated tile's own stride: B tiles are 128 or 256 rows, so its 256 rows make the larger stage
  static constexpr int kStride =
      sm90::MxTile<Cfg::kInter, Cfg::kHidden, true, Cfg::kHasClamp, Cfg::kStages, 256>::kStageStride;
  using Up = sm90::MxTile<Cfg::kInter, Cfg::kHidden, true, Cfg::kHasClamp, Cfg::kStages, 256, kStride, Cfg::kCluster>;
  using Down = sm90::MxTile<Cfg::kHidden, Cfg::kInter, false, Cfg::kHasClamp, Cfg::kStages, Cfg::kDownBlockN, kStride,
                            Cfg::kCluster>;
  static_assert(Cfg::kStagger == 0, "MXFP8 builds: the consumers run in lockstep (the MX tile has no stagger)");
  static_assert(Cfg::kFlow && !Cfg::kFuseShared && Cfg::kBlockK == 64 && !Cfg::kPullBulk,
                "MXFP8 builds: the Hopper core's flow schedule, no fused shared expert, k-blocks of 64, the copy "
                "dispatch");
};
template <class Cfg>
struct EpCore<Cfg, true> {
  using Up = typename EpHopperTiles<Cfg>::Up;
  using Down = typename EpHopperTiles<Cfg>::Down;
  static_assert(Up::kStageStride == Down::kStageStride && Up::kStageStride >= Up::kStageBytes &&
                    Down::kStageStride >= Down::kStageBytes, "up and down tiles share the stage stride");
  static constexpr int kThreads = 384;
};

template <class Cfg>
struct EpForward {
  using Core = EpCore<Cfg>;
  using Up = typename Core::Up;
  using Down = typename Core::Down;
  static constexpr int kThreads = Core::kThreads;
  static constexpr int kH = Cfg::kHidden, kI = Cfg::kInter, kE = Cfg::kExperts, kK = Cfg::kTopK;
  static constexpr size_t kRoutingSmem = size_t(kThreads / 32) * kE * sizeof(int32_t);
  static constexpr size_t kSmemBytes = max3(Up::kSmemBytes, Down::kSmemBytes, kRoutingSmem);
  // sm_90: 227 KB of shared memory per CTA, dynamic + static; the kernel's static part (flags,
  // signal barriers) is under 2 KB, so 4 KB are kept for it
  static_assert(kSmemBytes <= 227 * 1024 - 4096, "the stage ring does not fit in shared memory");
  static_assert(kH % 8 == 0, "hidden must be a multiple of 8");
};

// Row i of the received-row space -> (source rank, source pair index).
MOKGEN_DEVICE void locate_row(int i, int e_loc, int world, const int32_t* expert_offset, const int32_t* base,
                              const int32_t* src_off, char* const* sym, size_t send_pairs_off, int* src,
                              int* pair) {
  int lo = 0, hi = e_loc;  // largest le with expert_offset[le] <= i
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (expert_offset[mid] <= i) lo = mid; else hi = mid;
  }
  const int le = lo;
  int s = 0;
  while (s + 1 < world && base[le * world + s + 1] <= i) ++s;
  const int idx = i - base[le * world + s];
  *src = s;
  *pair = at<const int32_t>(sym[s], send_pairs_off)[src_off[le * world + s] + idx];
}

// The regions' layouts of one launch, computed on the host (EpLauncher::launch): the kernel reads
// the offsets from parameter memory where it needs them. Computed in the kernel, their 64-bit
// offsets were held in registers for the whole launch, and the fused builds spilled them
// (v0.17: the spill stores of qwen3.5-35b-a3b's fused build were these layouts' offsets).
template <class Cfg>
struct EpLayouts {
  SymLayout<Cfg> S;
  LocalLayout<Cfg> L;
};

template <class Cfg>
__global__ void __launch_bounds__(EpForward<Cfg>::kThreads, 1)
    ep_forward_kernel(const __grid_constant__ EpParams p, const __grid_constant__ EpMaps maps,
                      const __grid_constant__ EpLayouts<Cfg> lay) {
  using K_ = EpForward<Cfg>;
  using Up = typename K_::Up;
  using Down = typename K_::Down;
  constexpr int kH = K_::kH, kI = K_::kI, kE = K_::kE, kK = K_::kK;
  constexpr int kEpThreads = K_::kThreads;
#ifdef MOKGEN_FWD_TRACE
  constexpr bool kJoin = false;  // a trace build's records of a dispatch CTA hold its chunks (fwd_trace.cuh)
#else
  constexpr bool kJoin = Cfg::kDispatchJoin && Cfg::kWgmma && Cfg::kFlow;
#endif
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int s_flag;

  Control* ctl = p.ctl;
  const unsigned long long epoch = *reinterpret_cast<volatile unsigned long long*>(&ctl->epoch);
  const int g = blockIdx.x / p.ctas_per_rank;
  const int cta = blockIdx.x % p.ctas_per_rank;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  if (g < p.launch_ranks) {
    MOKGEN_FWD_TRACE_ONLY(if (tid == 0) fwd_trace::phase(0, fwd_trace::timer());)
    const int rank = p.rank_base + g;
    const int W = p.world, G = p.ctas_per_rank, P = p.dispatch_ctas, Gc = G - P;
    // Dispatch CTAs that have pulled their last chunk join the compute CTAs (kJoin, below): the
    // compute CTAs' final barrier then counts all G.
    const int Gj = kJoin ? G : Gc;
    const int e_loc = kE / W;
    const int T = p.num_tokens[g];
    const SymLayout<Cfg>& S = lay.S;
    const LocalLayout<Cfg>& L = lay.L;
    char* mine = p.sym[rank];
    char* loc = p.local[g];
    const Waiter w{ctl, p.timeout_ns, epoch, rank};
    unsigned long long* bar_rank = at<unsigned long long>(loc, L.bar_rank);
    unsigned long long* bar_comp = at<unsigned long long>(loc, L.bar_compute);
    unsigned long long n_rank = 0, n_comp = 0;
    bool ok = true;

    // This launch runs the fused shared expert (its weights are set).
    const bool has_shared = Cfg::kFuseShared && p.shared_w[0] != nullptr;
    // When every rank is in this launch (one GPU: W = 1 or virtual ranks), dispatch reads each
    // rank's x where it lies (p.x) and the publish copy is skipped; the fused shared expert's
    // TMA map reads the published copy, so a launch running it publishes.
    // MXFP8 builds always publish: the rows are quantized there (the dispatch moves codes).
    const bool x_in_place = !Cfg::kMx && p.launch_ranks == p.world && !has_shared;

    // ---- 1. publish -----------------------------------------------------------------------
    {
      if constexpr (Cfg::kMx) {
        // MXFP8: each 32-element block of x quantized (mx::quantize_block_hw, the oracle's bits):
        // codes [T, H] into S.x, scales [T, H / 32] into S.x_scales
        uint8_t* codes = at<uint8_t>(mine, S.x);
        uint8_t* scales = at<uint8_t>(mine, S.x_scales);
        const int64_t blocks = int64_t(T) * (kH / 32);
        for (int64_t b = int64_t(cta) * kEpThreads + tid; b < blocks; b += int64_t(G) * kEpThreads) {
          float v[32];
          mx::load_bf16_block(p.x[g] + b * 32, v);
          uint8_t q[32];
          scales[b] = mx::quantize_block_hw(v, q);
          uint4 out[2];
          memcpy(out, q, sizeof(q));
          reinterpret_cast<uint4*>(codes + b * 32)[0] = out[0];
          reinterpret_cast<uint4*>(codes + b * 32)[1] = out[1];
        }
      } else if (!x_in_place) {
        const uint4* src = reinterpret_cast<const uint4*>(p.x[g]);
        uint4* dst = at<uint4>(mine, S.x);
        const int64_t vecs = int64_t(T) * kH / 8;
        for (int64_t v = int64_t(cta) * kEpThreads + tid; v < vecs; v += int64_t(G) * kEpThreads) dst[v] = __ldg(src + v);
        if constexpr (Cfg::kWgmma && Cfg::kFuseShared) sm90::fence_proxy_async_global();  // read by the shared expert's TMA
      }
      if (cta == 0 && tid == 0) {  // counters of this launch (incremented only after barrier 2)
        long long* st = at<long long>(loc, L.stats);
        st[kStatRowsPulled] = 0;
        st[kStatRowsPushed] = 0;
        st[kStatRowsRemote] = 0;
        st[kStatTimeStart] = (long long)globaltimer_ns();
        st[kStatTimePullFirst] = 0x7fffffffffffffffll;
        st[kStatTimePullLast] = 0;
        st[kStatTimeDone] = 0;
        st[kStatTimePushFirst] = 0x7fffffffffffffffll;
      }
      if constexpr (Cfg::kFuseShared)  // counters of this launch's shared up tiles (read after barrier 2)
        if (cta == 0)
          for (int i = tid; i < (T + 127) / 128; i += kEpThreads) at<unsigned long long>(mine, S.shared_blk)[i] = 0;
      // the send lists, built by the rank's first route_parts CTAs (ep_routing.cuh)
      const int route_parts = min(G, kRouteParts);
      int32_t* part_hist = at<int32_t>(loc, L.route_hist);
      if (cta < route_parts)
        routing_count<kE, kK, kEpThreads>(p.ids[g], T, cta, route_parts, part_hist, reinterpret_cast<int32_t*>(smem));
      MOKGEN_FWD_TRACE_ONLY(if (tid == 0) fwd_trace::phase(4, fwd_trace::timer(), 2);)
      ok = group_barrier(bar_rank, tag(epoch, ++n_rank * G), w, &s_flag);
      MOKGEN_FWD_TRACE_ONLY(if (tid == 0) fwd_trace::phase(0, fwd_trace::timer(), 2);)
      if (ok && cta < route_parts)
        routing_assign<kE, kK, kEpThreads>(p.ids[g], T, cta, route_parts, part_hist, at<int32_t>(mine, S.send_count),
                                           at<int32_t>(mine, S.send_offset), at<int32_t>(mine, S.send_pairs),
                                           reinterpret_cast<int32_t*>(smem));
      MOKGEN_FWD_TRACE_ONLY(if (tid == 0) fwd_trace::phase(5, fwd_trace::timer(), 2);)
      ok = group_barrier(bar_rank, tag(epoch, ++n_rank * G), w, &s_flag) && ok;
      MOKGEN_FWD_TRACE_ONLY(if (tid == 0) fwd_trace::phase(1, fwd_trace::timer(), 2);)
      if (ok && cta == 0 && tid == 0 && rank != p.silent_rank) {
        __threadfence_system();
        st_release_sys(at<unsigned long long>(mine, S.routing_ready), tag(epoch, 1));
      }
    }

    // ---- 2. plan the received rows ------------------------------------------------------------
    int32_t* r_eoff = at<int32_t>(loc, L.recv_expert_offset);  // [e_loc + 1]
    int32_t* r_base = at<int32_t>(loc, L.recv_base);           // [e_loc * W + 1]
    int32_t* r_soff = at<int32_t>(loc, L.recv_src_off);        // [e_loc * W]
    if (ok && cta == 0) {
      if (tid == 0) {
        bool all = true;
        for (int s = 0; s < W && all; ++s)
          all = w.wait_geq<true>(at<unsigned long long>(p.sym[s], S.routing_ready), tag(epoch, 1), kStageRoutingReady, s);
        s_flag = all;
      }
      __syncthreads();
      ok = s_flag;
      if (ok) {
        for (int idx = tid; idx < e_loc * W; idx += kEpThreads) {
          const int le = idx / W, s = idx % W, e = rank * e_loc + le;
          r_base[idx] = at<const int32_t>(p.sym[s], S.send_count)[e];
          r_soff[idx] = at<const int32_t>(p.sym[s], S.send_offset)[e];
        }
        __syncthreads();
        {  // exclusive prefix sum of the counts as a block scan (v0.26: the plan 40.7 -> 18.7 us on the
          // qwen3.5 layer against one thread's loop); thread tid owns entries [tid * kPer, (tid + 1) * kPer)
          constexpr int kPer = (kE + kEpThreads - 1) / kEpThreads;
          int32_t* s_run = reinterpret_cast<int32_t*>(smem);  // scratch: the ring is not in use yet
          const int n = e_loc * W;
          int32_t c[kPer], local = 0;
#pragma unroll
          for (int q = 0; q < kPer; ++q) {
            const int idx = tid * kPer + q;
            c[q] = idx < n ? r_base[idx] : 0;
            local += c[q];
          }
          int32_t run = block_exclusive_scan<kEpThreads>(local, s_run);
#pragma unroll
          for (int q = 0; q < kPer; ++q) {
            const int idx = tid * kPer + q;
            if (idx < n) {
              r_base[idx] = run;
              if (idx % W == 0) r_eoff[idx / W] = run;
            }
            run += c[q];
          }
          if (tid == kEpThreads - 1) {
            r_base[n] = run;
            r_eoff[e_loc] = run;
            at<long long>(loc, L.stats)[kStatRowsReceived] = run;
          }
        }
      }
    }
    MOKGEN_FWD_TRACE_ONLY(if (tid == 0) fwd_trace::phase(2, fwd_trace::timer(), 2);)
    ok = group_barrier(bar_rank, tag(epoch, ++n_rank * G), w, &s_flag) && ok;
    MOKGEN_FWD_TRACE_ONLY(if (tid == 0) fwd_trace::phase(3, fwd_trace::timer(), 2);)
    // Every CTA of the rank now sees the plan (barrier = fence + acquire).
    if constexpr (Cfg::kCluster == 2) {
      // The two CTAs of a cluster pair (both dispatch or both compute: P and G are even) take
      // the same branch below: a pair's tiles need both of them.
      __shared__ int s_peer_ok;
      if (tid == 0) sm90::st_cluster_u32(&s_peer_ok, cute::block_rank_in_cluster() ^ 1u, ok ? 1u : 0u);
      cute::cluster_sync();
      ok = ok && s_peer_ok;
    }

    const int n_rows = ok ? r_eoff[e_loc] : 0;
    const int C = p.chunk_rows, R = p.ring_chunks;
    const int num_chunks = int(ceil_div(n_rows, C));
    unsigned long long* landed = at<unsigned long long>(loc, L.chunk_landed);
    unsigned long long* freed = at<unsigned long long>(loc, L.chunk_free);
    unsigned long long* chk_done = at<unsigned long long>(loc, L.chunk_done);
    unsigned long long* blk_done = at<unsigned long long>(loc, L.block_done);
    int2* meta = at<int2>(loc, L.ring_meta);
    bf16* ring_x = at<bf16>(loc, L.ring_x);
    bf16* ring_h = at<bf16>(loc, L.ring_h);

    // ---- 3. stream the rows through the ring ---------------------------------------------------
    // Pulling: chunk c goes to slot c % R in n_parts contiguous parts, part `part` by this CTA.
    // Per batch of rows, all threads first locate their rows' sources in parallel (each costs a
    // read of the source's send list, across NVLink for a peer) into shared memory; then the
    // batch is copied as one flat stream of 16-byte vectors (row-major over the batch's rows):
    // each warp takes runs of 32 x kPullUnroll vectors, all loads of a run in flight before its
    // stores, so a warp keeps 32 x kPullUnroll x 16 bytes in flight whatever the row width. With
    // Cfg::kPullBulk (plan pull_mode "bulk") one thread copies the batch's rows instead, through
    // the TMA's bulk-copy engine and the CTA's free shared memory (bulk_copy.cuh). The CTA that
    // lands the last part publishes landed[slot].
    constexpr int kPullUnroll = Cfg::kPullUnroll;
    constexpr int kVecs = Cfg::kMx ? kH / 16 : kH / 8;  // 16-byte vectors per row (MXFP8: of codes)
    constexpr int kBatch = 1024;   // rows located per batch (8 KB of source row pointers)
    static_assert(K_::kSmemBytes >= (Cfg::kMx ? 2 : 1) * kBatch * sizeof(const uint4*),
                  "dispatch batch must fit in shared memory");
    long long* st = at<long long>(loc, L.stats);
    unsigned long long* arrived = at<unsigned long long>(loc, L.chunk_arrived);
    unsigned remote = 0;  // rows this thread located on other ranks
    // Uses the start of shared memory: in compute CTAs, only before their pipeline is set up.
    auto pull_chunk = [&](int c, int part, int n_parts) {
      const uint4** s_from = reinterpret_cast<const uint4**>(smem);
      const int slot = c % R;
      if (c == 0 && tid == 0) atomicMin(reinterpret_cast<unsigned long long*>(st + kStatTimePullFirst), globaltimer_ns());
      const int r0 = c * C, r1 = min(n_rows, r0 + C);
      const int per = int(ceil_div(r1 - r0, n_parts));
      const int q0 = min(r1, r0 + part * per), q1 = min(r1, q0 + per);
      for (int b0 = q0; b0 < q1; b0 += kBatch) {
        const int b1 = min(q1, b0 + kBatch);
        for (int i = b0 + tid; i < b1; i += kEpThreads) {
          int src = 0, pair = 0;
          locate_row(i, e_loc, W, r_eoff, r_base, r_soff, p.sym, S.send_pairs, &src, &pair);
          // launch-local rank src - rank_base holds rank src's x when x_in_place (rank_base = 0 then)
          const uint4* x_src = x_in_place ? reinterpret_cast<const uint4*>(p.x[src - p.rank_base]) : at<const uint4>(p.sym[src], S.x);
          s_from[i - b0] = x_src + int64_t(pair / kK) * kVecs;
          if constexpr (Cfg::kMx)  // the row's scales (kH / 32 bytes) after the batch's code pointers
            reinterpret_cast<const uint32_t**>(smem)[kBatch + (i - b0)] =
                at<const uint32_t>(p.sym[src], S.x_scales) + int64_t(pair / kK) * (kH / 128);
          meta[int64_t(slot) * C + (i - r0)] = make_int2(src, pair);
          remote += src != rank;
        }
        __syncthreads();
        uint4* to = CfgMxCodes<Cfg>::value
                        ? reinterpret_cast<uint4*>(reinterpret_cast<uint8_t*>(ring_x) + (int64_t(slot) * C + (b0 - r0)) * kH)
                        : reinterpret_cast<uint4*>(ring_x + (int64_t(slot) * C + (b0 - r0)) * kH);  // the batch's rows
        if constexpr (CfgMxCodes<Cfg>::value) {
          // the rows' scales, a 4-byte word per k128 block, into the ring's blocked plane
          // [H / 128, ring_rows, 4]
          const uint32_t* const* s_sfrom = reinterpret_cast<const uint32_t* const*>(smem) + kBatch;
          uint32_t* ring_s = at<uint32_t>(loc, L.ring_x_scales);
          const int64_t ring_rows = int64_t(C) * R, first = int64_t(slot) * C + (b0 - r0);
          constexpr int kWords = kH / 128;
          for (int v = tid; v < (b1 - b0) * kWords; v += kEpThreads) {
            const int r = v / kWords, kb = v % kWords;
            ring_s[int64_t(kb) * ring_rows + first + r] = s_sfrom[r][kb];
          }
        }
        if constexpr (Cfg::kPullBulk) {
          // s_from, then 16 mbarriers, then the stage buffers (128-byte aligned)
          constexpr size_t kBars = kBatch * sizeof(const uint4*), kBuf = kBars + 16 * sizeof(uint64_t);
          static_assert(K_::kSmemBytes > kBuf, "no shared memory left for the bulk row copy");
          if (tid == 0) {
            // published x rows (generic writes, acquired) and this shared memory (the routing
            // prologue's generic stores) -> bulk reads and writes
            sm90::fence_proxy_async_all();
            bulk::copy_rows<kH * 2, K_::kSmemBytes - kBuf>(reinterpret_cast<const void* const*>(s_from),
                                                          reinterpret_cast<unsigned char*>(to), b1 - b0,
                                                          reinterpret_cast<uint64_t*>(smem + kBars), smem + kBuf);
          }
          __syncthreads();  // s_from is reused by the next batch
          continue;
        }
        const int n_vecs = (b1 - b0) * kVecs;  // < 2^31: kBatch rows of at most 2^20 vectors
        for (int v0 = warp * 32 * kPullUnroll + lane; v0 < n_vecs; v0 += kEpThreads * kPullUnroll) {
          uint4 r[kPullUnroll];
          [[maybe_unused]] uint32_t sw[kPullUnroll];  // expanded MXFP8: the vector's k128 scale word
#pragma unroll
          for (int u = 0; u < kPullUnroll; ++u) {
            const int v = v0 + u * 32;
            if (v < n_vecs) {
              r[u] = s_from[v / kVecs][v % kVecs];
              if constexpr (CfgMxExpand<Cfg>::value)
                sw[u] = reinterpret_cast<const uint32_t* const*>(smem)[kBatch + v / kVecs][(v % kVecs) / 8];
            }
          }
#pragma unroll
          for (int u = 0; u < kPullUnroll; ++u) {
            const int v = v0 + u * 32;
            if (v >= n_vecs) continue;
            if constexpr (CfgMxExpand<Cfg>::value) {
              // the vector's 16 codes (one k16 step, half of a 32-block) as their bf16 MX values,
              // k permuted as the bf16 MX weights are (mx_tile.cuh, mx_expand16)
              uint4 lo, hi;
              sm90::mx_expand16(r[u], (sw[u] >> (8 * ((v % kVecs) / 2 % 4))) & 0xffu, lo, hi);
              to[2 * v] = lo;
              to[2 * v + 1] = hi;
            } else {
              to[v] = r[u];
            }
          }
        }
        __syncthreads();  // s_from is reused by the next batch
      }
      // ring rows: read next by the TMA; and, in a compute CTA, the generic stores of s_from
      // precede the TMA writes and wgmma reads of the same shared-memory bytes (stage 0)
      if constexpr (Cfg::kWgmma) sm90::fence_proxy_async_all();
      if constexpr (Cfg::kFlow) {
        // the slot's dependency counters start over (this part's share of them); nobody reads
        // them for chunk c - R any more: its slot was freed after its last down tile finished
        const int zpart = int(ceil_div(C, n_parts));
        for (int i = part * zpart + tid; i < min(C, (part + 1) * zpart); i += kEpThreads) blk_done[int64_t(slot) * C + i] = 0;
        if (part == 0 && tid == 0) chk_done[slot] = 0;
      }
      __syncthreads();
      if (tid == 0) {
        if (q1 > q0) atomicAdd(reinterpret_cast<unsigned long long*>(st + kStatRowsPulled), (unsigned long long)(q1 - q0));
        __threadfence();
        if (atomicAdd(&arrived[slot], 1ull) + 1 == (unsigned long long)n_parts) {  // the last part landed
          arrived[slot] = 0;  // next use: after freed(c), which follows landed(c)
          atomicMax(reinterpret_cast<unsigned long long*>(st + kStatTimePullLast), globaltimer_ns());
          __threadfence();
#if defined(MOKGEN_FAULT_STAGE) && MOKGEN_FAULT_STAGE == 4
          // fault build: no chunk is ever marked landed (the compute's waits for it time out)
#else
          st_release_gpu(&landed[slot], tag(epoch, c + 1));
#endif
        }
      }
    };
    auto count_remote = [&]() {
      remote = __reduce_add_sync(0xffffffffu, remote);
      if (lane == 0 && remote) atomicAdd(reinterpret_cast<unsigned long long*>(st + kStatRowsRemote), (unsigned long long)remote);
    };
    // Chunk 0 is shared by all G CTAs of the rank: the compute CTAs have nothing to do until it
    // lands (the start-up bubble). One call site for every CTA (the smem it uses is free: a
    // compute CTA sets up its pipeline after it).
    if (ok && num_chunks > 0) {
      MOKGEN_FWD_TRACE_ONLY(if (tid == 0 && cta < P) { fwd_trace::put(0, 0, 0, fwd_trace::timer()); fwd_trace::put(0, 0, 1, fwd_trace::timer()); })
      pull_chunk(0, cta, G);
      MOKGEN_FWD_TRACE_ONLY(if (tid == 0 && cta < P) fwd_trace::put(0, 0, 2, fwd_trace::timer());)
    }
    if (ok && cta < P) {
      // Dispatch: pull chunk c into slot c % R once chunk c - R is consumed. All P dispatch CTAs
      // share every later chunk (CTA q pulls the q-th of P contiguous parts), so a chunk lands
      // at the rate of P SMs, not one.
      MOKGEN_FWD_TRACE_ONLY(if (tid == 0) fwd_trace::phase(5, 1);)
      for (int c = 1; c < num_chunks; ++c) {
        const int slot = c % R;
        MOKGEN_FWD_TRACE_ONLY(if (tid == 0) fwd_trace::put(c, 0, 0, fwd_trace::timer());)
        if (tid == 0) s_flag = c < R || w.wait_geq<false>(&freed[slot], tag(epoch, c - R + 1), kStageRingFree, -1);
        __syncthreads();
        MOKGEN_FWD_TRACE_ONLY(if (tid == 0) fwd_trace::put(c, 0, 1, fwd_trace::timer());)
        if (!s_flag) { ok = false; break; }
        pull_chunk(c, cta, P);
        MOKGEN_FWD_TRACE_ONLY(if (tid == 0) fwd_trace::put(c, 0, 2, fwd_trace::timer());)
      }
    }
    count_remote();
    if (ok && (cta >= P || kJoin)) {
      // Compute: chunks in order, tiles of a chunk dealt round-robin over the Gc compute CTAs
      // (phased) or claimed in order (flow). kJoin: a dispatch CTA comes here after its last
      // pull and claims tiles like the others from then on; its index among the compute CTAs,
      // cc, follows theirs (P and G are even with pairs, so a pair's two CTAs keep their ranks
      // in the pair).
      // The region pointers and the plan's sizes, derived again from the parameters (opaque:
      // the compiler cannot reuse the values from before the dispatch loop). With kJoin those
      // would stay live across the dispatch's copy loop, and it spilled (qwen3.5-397b-a17b's
      // local stand-in: 32 / 244 bytes).
      loc = p.local[opaque(g)];
      mine = p.sym[opaque(rank)];
      r_eoff = at<int32_t>(loc, L.recv_expert_offset);
      landed = at<unsigned long long>(loc, L.chunk_landed);
      freed = at<unsigned long long>(loc, L.chunk_free);
      chk_done = at<unsigned long long>(loc, L.chunk_done);
      blk_done = at<unsigned long long>(loc, L.block_done);
      meta = at<int2>(loc, L.ring_meta);
      ring_x = at<bf16>(loc, L.ring_x);
      ring_h = at<bf16>(loc, L.ring_h);
      bar_comp = at<unsigned long long>(loc, L.bar_compute);
      const int n_rows = r_eoff[e_loc];  // ok: the plan was read
      const int C = p.chunk_rows, R = p.ring_chunks;
      const int num_chunks = int(ceil_div(n_rows, C));
      const int cc = cta >= P ? cta - P : cta - P + G;
      // Calls fn(le, rows, row0, n) for this CTA's tiles of `phase` (0 = up, 1 = down) in chunk c.
      auto for_my_tiles = [&](int c, int phase, auto&& fn) {
        const int r0 = c * C, r1 = min(n_rows, r0 + C);
        const int64_t slot_row0 = int64_t(c % R) * C;
        walk_group<1>(r_eoff, e_loc, find_expert(r_eoff, e_loc, r0), r0, r1, phase, c,
                      phase == 0 ? Up::kNTiles : Down::kNTiles, cc, Gc, 0, 0,
                      [&](int, int, int le, int rows, int m, int n, int) { fn(le, rows, slot_row0 + m, n); });
      };
      // Output-row functors. They capture only pointers: a by-value capture of `p` would copy
      // the whole parameter block into local memory.
      char* const* sym = p.sym;
      const size_t slots_off = S.slots;
      auto h_row = [ring_h](int64_t row0) { return [ring_h, row0](int r) { return ring_h + (row0 + r) * kI; }; };
      // MXFP8: the up tiles' h as codes and blocked scales (mx_tile.cuh), and the A operands
      // (codes' map, scales) of the up and down tiles
      [[maybe_unused]] auto mx_h_rows = [ring_h, loc, &L, C, R](int64_t row0) {
        if constexpr (CfgMxCodes<Cfg>::value)
          return sm90::MxRowsBlocked{reinterpret_cast<uint8_t*>(ring_h), at<uint8_t>(loc, L.ring_h_scales), kI, C * R,
                                     int(row0)};
        else
          return row0;
      };
      [[maybe_unused]] auto a_operand = [](const CUtensorMap* map, const CUtensorMap* scales) {
        if constexpr (CfgMxCodes<Cfg>::value)
          return sm90::MxA{map, scales};
        else
          return map;
      };
      auto slot_row = [meta, sym, slots_off](int64_t row0) {
        return [meta, sym, slots_off, row0](int r) {
          const int2 d = meta[row0 + r];
          return at<bf16>(sym[d.x], slots_off) + int64_t(d.y) * kH;
        };
      };
      auto count_pushed = [&](int rows) {  // rows pushed, counted once per row (by its n = 0 tile)
        unsigned long long* st = reinterpret_cast<unsigned long long*>(at<long long>(loc, L.stats));
        atomicAdd(st + kStatRowsPushed, (unsigned long long)rows);
        atomicMin(st + kStatTimePushFirst, globaltimer_ns());  // the push window's start
      };
      // Both roles of a CTA go through the same sequence of CTA-wide barriers: per chunk, one for
      // the landed wait and two per phase (group_barrier).
      auto chunk_loop = [&](auto&& phase_work) {
        for (int c = 0; c < num_chunks && ok; ++c) {
          const int slot = c % R;
          if (tid == 0) s_flag = w.wait_geq<false>(&landed[slot], tag(epoch, c + 1), kStageChunkLanded, -1);
          __syncthreads();
          if (!s_flag) { ok = false; break; }
          for (int phase = 0; phase < 2 && ok; ++phase) {
            phase_work(c, phase);
            ok = group_barrier(bar_comp, tag(epoch, ++n_comp * Gc), w, &s_flag);
          }
#if defined(MOKGEN_FAULT_STAGE) && MOKGEN_FAULT_STAGE == 3
          // fault build: no ring slot is ever freed (the dispatch's wait for chunk R times out)
#else
          if (ok && cc == 0 && tid == 0) st_release_gpu(&freed[slot], tag(epoch, c + 1));
#endif
        }
      };
      if constexpr (Cfg::kWgmma && Cfg::kFlow) {
        // Flow schedule: no barrier between phases or chunks. One global tile order, claimed in
        // order by the compute CTAs (or CTA pairs; see for_each_tile): step s holds the up tiles
        // of chunk s, then the down tiles of chunk s - 1 (of chunk s when the ring has one slot). A down tile
        // waits only for the up tiles of its own 128-row block (blk_done), an up tile only for
        // its chunk to land; the last down tile of a chunk frees its slot. Every dependency points
        // to an earlier tile of the order and each CTA takes its tiles in order, so the earliest
        // unfinished tile can always run (every compute CTA is resident; a claimed tile is run by
        // its claimer): no deadlock, and no wave quantization per phase.
        // Clusters of two (Cfg::kCluster == 2): the order is over pair-tiles, claimed by the
        // Gc / 2 CTA pairs; a pair-tile is two tiles that share an operand (hopper_gemm.cuh):
        // row blocks m and m + 1 of an expert's segment with the same column tile (kShareB), and
        // for the odd last block of a segment, column tiles n and n + 1 (kShareA); a missing
        // n + 1 (odd column-tile count) becomes a tile of zero rows that writes nothing.
        constexpr int kPair = Cfg::kCluster;
        const int lag = R >= 2 ? 1 : 0;
        // Fused shared expert (Cfg::kFuseShared, p.shared_w set): its tiles come first, kind 2
        // (up: the rank's own published x rows, no transfer) then kind 3 (down), m = token row:
        // they overlap the wait for the first chunk (the rest of it, after this CTA's own part).
        // Dealing (tile_order.cuh): each CTA (or pair) claims its next running index from a
        // counter of the rank (tile_next), so tile t starts at about the same time on whichever
        // CTA, and the tiles that share an operand run together (v0.17: round-robin dealing let
        // the CTAs drift apart, and a shared operand was read from DRAM again). The counter hands
        // indices out in order: each CTA's are increasing and every tile is claimed once, so the
        // deadlock argument above holds as it did for the round-robin deal. A pair's leader
        // (crank 0) claims for both and passes each index to its peer (the walker, below).
        // `next(want)`: the index after `want`.
        auto for_each_tile = [&](auto&& fn, auto&& next) {  // fn(kind, c, le, rows, m (row in chunk), n, share)
          const int crank = cc % kPair;
          int t = 0;
          int want = next(-1);
          if constexpr (Cfg::kFuseShared) {
            if (has_shared) {
              if constexpr (kPair == 1) {  // tiles t = 0 .. n_all - 1: up (block-major, then column), then down
                const int blocks = (T + 127) / 128;
                const int n_up = blocks * Up::kNTiles, n_all = n_up + blocks * Down::kNTiles;
                for (; want < n_all; want = next(want)) {
                  const bool up = want < n_up;
                  const int qq = up ? want : want - n_up, nt = up ? Up::kNTiles : Down::kNTiles;
                  const int m = qq / nt * 128;
                  fn(up ? 2 : 3, -1, 0, min(128, T - m), m, qq % nt, int(sm90::kShareNone));
                }
                t = n_all;
              } else {
                // CTA pairs: pair-tiles over the T token rows, block pairs in turn (tile_order.cuh)
                t = walk_shared_pairs_dealt(T, Up::kNTiles, Down::kNTiles, crank, t, want, next, fn);
              }
            }
          }
          static_assert(int(sm90::kShareNone) == 0 && int(sm90::kShareB) == 1 && int(sm90::kShareA) == 2,
                        "tile_order.cuh's share codes");
          walk_flow_tiles_dealt<kPair>(r_eoff, e_loc, n_rows, C, num_chunks, lag, Up::kNTiles, Down::kNTiles, crank, t,
                                       want, next, fn);
        };
        auto down_tiles = [&](int c) {  // down tiles of chunk c (all CTAs)
          return (unsigned long long)group_tiles(r_eoff, e_loc, c * C, min(n_rows, c * C + C), Down::kNTiles);
        };
        // Signalling a finished tile to other CTAs needs a gpu-scope fence after the epilogue's
        // stores; a consumer thread doing it would stall its warpgroup's next wgmma. A signaller
        // thread of the producer warpgroup does it instead: the consumers arrive on sig_done[j]
        // (j = tile % kSig) and go on; the signaller waits for it, fences, publishes the
        // tile's counters, and arrives on sig_free[j] before the consumers reuse slot j.
        constexpr int kSig = 4;
        __shared__ uint64_t sig_done[kSig], sig_free[kSig];
        __shared__ int s_abort;  // set by the producer when a wait failed; the pipeline drains
        // The tile queue: one walker thread (thread 64, warp 2 of the producer warpgroup, which
        // has no other role) walks the order once and writes each tile's arguments to entry
        // i % kQueue; the producer, the signaller and the 256 consumer threads read them from
        // there instead of each walking the order themselves (the walk cost the consumers 2-8k
        // cycles between tiles on qwen3.5-35b-a3b, docs/perf-notes.md v0.15). q_full[j]: the
        // walker's arrival; q_empty[j]: the producer's, the signaller's and one per consumer warp
        // (lane 0 after the warp's __syncwarp, which orders its lanes' reads before the arrive:
        // 256 arrivals on one barrier serialize). An entry of kind -1 ends the queue.
        constexpr int kQueue = 32, kQueueReaders = 2 + 8;
        // entry: (kind & 15 | share << 4 | rows << 8, c, le, m) and n; kind -1 (the whole word) ends
        __shared__ int4 s_queue[kQueue];
        __shared__ int s_queue_n[kQueue];
        __shared__ uint64_t q_full[kQueue], q_empty[kQueue];
        // CTA pairs: the leader's claims, passed to the peer's walker (claim_full: the leader's
        // remote arrival; claim_empty: the peer's, once it has read the index)
        constexpr int kClaimRing = 4;
        __shared__ int s_claim[kClaimRing];
        __shared__ uint64_t claim_full[kClaimRing], claim_empty[kClaimRing];
        const int wgi = tid / 128;
        if (tid == 0) {
          for (int j = 0; j < kSig; ++j) {
            sm90::mbar_init(&sig_done[j], 8);  // one arrival per consumer warp
            sm90::mbar_init(&sig_free[j], 1);
          }
          for (int j = 0; j < kQueue; ++j) {
            sm90::mbar_init(&q_full[j], 1);
            sm90::mbar_init(&q_empty[j], kQueueReaders);
          }
          if constexpr (kPair == 2)
            for (int j = 0; j < kClaimRing; ++j) {
              sm90::mbar_init(&claim_full[j], 1);
              sm90::mbar_init(&claim_empty[j], 1);
            }
          if constexpr (Cfg::kStagger > 0) sm90::mbar_init(&sm90::s_stagger_bar, 1);  // warpgroup 1's start
          Up::init_barriers(Up::carve(smem));  // ends with the mbarrier-init fence
          s_abort = 0;
        }
        if constexpr (kPair == 2)
          cute::cluster_sync();  // the peer's barriers are initialized before any multicast or remote arrive
        else
          __syncthreads();
        volatile int* abort_flag = &s_abort;
        // Calls fn(i, kind, c, le, rows, m, n, share) for this CTA's tiles i = 0, 1, ... in order,
        // read from the tile queue (each reader once per entry).
        // kWarp: the caller is a whole warp (the consumers), which arrives once, by lane 0.
        auto for_each_queued = [&](auto&& fn, auto warp_reader) {
          constexpr bool kWarp = decltype(warp_reader)::value;
          for (int i = 0;; ++i) {
            const int j = i % kQueue;
            sm90::mbar_wait(&q_full[j], uint32_t(i / kQueue) & 1u);
            const int4 a = s_queue[j];
            const int n = s_queue_n[j];
            if constexpr (kWarp) {
              __syncwarp();
              if (lane == 0) sm90::mbar_arrive(&q_empty[j]);  // release: the warp read the entry
            } else {
              sm90::mbar_arrive(&q_empty[j]);  // release: the entry was read
            }
            if (a.x < 0) break;
            fn(i, a.x & 15, a.y, a.z, a.x >> 8, a.w, n, (a.x >> 4) & 15);
          }
        };
        MOKGEN_FWD_TRACE_ONLY(int tr_sig_n = 0;)  // the signaller's tiles
        if (wgi == 0) {
          cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
          if (tid == 64) {  // the walker
            int i = 0;
            auto enqueue = [&](int kind, int c, int le, int rows, int m, int n, int share) {
              const int j = i % kQueue;
              if (i >= kQueue) sm90::mbar_wait(&q_empty[j], uint32_t(i / kQueue - 1) & 1u);
              s_queue[j] = make_int4(kind < 0 ? -1 : kind | share << 4 | rows << 8, c, le, m);
              s_queue_n[j] = n;
              sm90::mbar_arrive(&q_full[j]);  // release: the entry's stores
              ++i;
            };
            // The claim for entry i waits until entry i - kClaimAhead has been read by all: a
            // claim made as the CTA nears the tile keeps the start times of a tile's index in
            // step across CTAs (a claim made 32 entries ahead would not); the producer needs
            // entry i about one tile before the consumers start it, so 3 entries leave it about
            // two tiles for the claim's round trip.
            constexpr int kClaimAhead = 3;
            unsigned int* tile_next = at<unsigned int>(loc, L.tile_next);
            int n_claims = 0;
            auto claim = [&](int) {
              if (i >= kClaimAhead) {
                const int e = i - kClaimAhead;
                sm90::mbar_wait(&q_empty[e % kQueue], uint32_t(e / kQueue) & 1u);
              }
              if constexpr (kPair == 1) {
                return int(atomicAdd(tile_next, 1u));
              } else {
                const int j = n_claims % kClaimRing;
                const uint32_t ph = uint32_t(n_claims / kClaimRing) & 1u;
                ++n_claims;
                int v;
                if (cc % 2 == 0) {  // the leader: claim, then hand the index to the peer
                  if (n_claims > kClaimRing) sm90::mbar_wait_acquire_cluster(&claim_empty[j], ph ^ 1u);
                  v = int(atomicAdd(tile_next, 1u));
                  sm90::st_cluster_u32(&s_claim[j], 1u, uint32_t(v));
                  sm90::mbar_arrive_release_cluster(&claim_full[j], 1u);
                } else {
                  sm90::mbar_wait_acquire_cluster(&claim_full[j], ph);
                  v = s_claim[j];
                  sm90::mbar_arrive_release_cluster(&claim_empty[j], 0u);
                }
                return v;
              }
            };
            for_each_tile(enqueue, claim);
            enqueue(-1, 0, 0, 0, 0, 0, 0);
          }
          if (tid == 32) {  // the signaller
            int total_c = -1;
            unsigned long long total = 0;
            MOKGEN_FWD_TRACE_ONLY(long long tr_wait = 0, tr_pub = 0, tr_pub_max = 0;)
            for_each_queued([&](int i, int kind, int c, int le, int rows, int m, int n, int) {
              const int j = i % kSig;
              MOKGEN_FWD_TRACE_ONLY(const long long tr0 = fwd_trace::clock();)
              sm90::mbar_wait(&sig_done[j], uint32_t(i / kSig) & 1u);
              MOKGEN_FWD_TRACE_ONLY(const long long tr1 = fwd_trace::clock(); tr_wait += tr1 - tr0;)
              const int slot = c % R;
              if (!*abort_flag && rows > 0) {  // a zero-row tile of a pair finishes nothing
                __threadfence();  // the consumers' stores (acquired through sig_done) -> gpu scope
                if (Cfg::kFuseShared && kind >= 2) {
                  // shared up tiles release their block's down tiles; shared down tiles are
                  // ordered before the combine by the compute CTAs' final barrier
                  if (kind == 2) atomicAdd(at<unsigned long long>(mine, S.shared_blk) + m / 128, 1ull);
                } else if (kind == 0) {
#if defined(MOKGEN_FAULT_STAGE) && MOKGEN_FAULT_STAGE == 6
                  // fault build: no up tile is ever counted (every down tile's wait times out)
#else
                  atomicAdd(&blk_done[int64_t(slot) * C + m], 1ull);
#endif
                } else {
                  if (n == 0) count_pushed(rows);
                  if (total_c != c) {
                    total = down_tiles(c);
                    total_c = c;
                  }
#if defined(MOKGEN_FAULT_STAGE) && MOKGEN_FAULT_STAGE == 3
                  // fault build: no ring slot is ever freed (the dispatch's wait for chunk R times out)
                  atomicAdd(&chk_done[slot], 1ull);
                  (void)total;
#else
                  if (atomicAdd(&chk_done[slot], 1ull) + 1 == total) st_release_gpu(&freed[slot], tag(epoch, c + 1));
#endif
                }
              }
              MOKGEN_FWD_TRACE_ONLY(const long long tr2 = fwd_trace::clock() - tr1; tr_pub += tr2;
                                    tr_pub_max = tr2 > tr_pub_max ? tr2 : tr_pub_max;)
              sm90::mbar_arrive(&sig_free[j]);
              MOKGEN_FWD_TRACE_ONLY(fwd_trace::flush_consumers(i); tr_sig_n = i + 1;)
            }, std::false_type{});
            MOKGEN_FWD_TRACE_ONLY(fwd_trace::phase(0, tr_wait, 1); fwd_trace::phase(1, tr_pub, 1);
                                  fwd_trace::phase(2, tr_pub_max, 1); fwd_trace::phase(3, tr_sig_n, 1);)
          }
          if (tid == 0) {
            typename Up::Pipe pipe;
            int acquired = -1;  // chunks 0..acquired have landed (acquired by this thread)
            MOKGEN_FWD_TRACE_ONLY(fwd_trace::phase(1, fwd_trace::timer()); fwd_trace::phase(6, 1); int tr_i = 0;)
            for_each_queued([&](int, int kind, int c, int le, int rows, int m, int n, int share) {
              // the tile's record, located once (each put() reads the buffer's address and size
              // from global memory: three of them here cost the v0.16 traces ~5k cycles of
              // "dependency wait" per tile)
              MOKGEN_FWD_TRACE_ONLY(
                  const int tr_me = tr_i++;
                  const long long tr_t0 = fwd_trace::timer(), tr_c0 = fwd_trace::clock();
                  long long* tr_rec = fwd_trace::tile_record(tr_me, 0);
                  fwd_trace::set(tr_rec, 0, tr_t0); fwd_trace::set(tr_rec, 1, tr_c0);
                  fwd_trace::set(tr_rec, 4, kind); fwd_trace::set(tr_rec, 5, c);
                  fwd_trace::set(tr_rec, 6, (long long)(rows | (n << 16)) | ((long long)m << 32));)
              if (Cfg::kFuseShared && kind >= 2) {  // fused shared expert: up tiles read the published x rows
                if (kind == 3 && !*abort_flag) {
                  if (!w.wait_geq<false>(at<unsigned long long>(mine, S.shared_blk) + m / 128, Up::kNTiles,
                                         kStageBlockReady, -1))
                    *abort_flag = 1;
                }
                sm90::fence_proxy_async_global();  // x / shared h rows: generic writes -> TMA reads
              }
              const int slot = c % R;
              if (!*abort_flag && acquired < c) {
                while (acquired < c && !*abort_flag) {
                  ++acquired;
                  if (!w.wait_geq<false>(&landed[acquired % R], tag(epoch, acquired + 1), kStageChunkLanded, -1))
                    *abort_flag = 1;
                }
                sm90::fence_proxy_async_global();  // ring rows: generic writes -> TMA reads
              }
              const int64_t row0 = int64_t(slot) * C + m;
              MOKGEN_FWD_TRACE_ONLY(if (kind != 1) fwd_trace::set(tr_rec, 2, fwd_trace::clock());)
              if constexpr (Cfg::kFuseShared) {
                if (kind == 2) {
                  Up::produce(Up::carve(smem), pipe, &maps.sym_x[g], m, &maps.sh_gate, &maps.sh_up, n * Up::kBN, share,
                              cc % kPair);
                  return;
                }
                if (kind == 3) {
                  Down::produce(Down::carve(smem), pipe, &maps.shared_h[g], m, &maps.sh_down, nullptr, n * Down::kBN,
                                share, cc % kPair);
                  return;
                }
              }
              if (kind == 0) {
                Up::produce(Up::carve(smem), pipe, a_operand(&maps.ring_x[g], &maps.sym_x[g]), int(row0), &maps.w_gate[g],
                            &maps.w_up[g], le * kI + n * Up::kBN, share, cc % kPair);
              } else {
                if (!*abort_flag) {
                  if (!w.wait_geq<false>(&blk_done[row0], Up::kNTiles, kStageBlockReady, -1)) *abort_flag = 1;
                  sm90::fence_proxy_async_global();  // h rows of the block: generic writes -> TMA reads
                }
                MOKGEN_FWD_TRACE_ONLY(fwd_trace::set(tr_rec, 2, fwd_trace::clock());)
                Down::produce(Down::carve(smem), pipe, a_operand(&maps.ring_h[g], &maps.shared_h[g]), int(row0),
                              &maps.w_down[g],
                              nullptr, le * kH + n * Down::kBN, share, cc % kPair);
              }
              MOKGEN_FWD_TRACE_ONLY(
                  fwd_trace::set(tr_rec, 3, fwd_trace::clock()); fwd_trace::set(tr_rec, 7, fwd_trace::s_waited[0]);)
            }, std::false_type{});
          }
          __syncwarp();  // warps 0-2 reconverge before the warpgroup-wide barrier and setmaxnreg
          // Warp 3 (and warp 2 after the walk) has no role: parked on a named barrier (blocked,
          // issuing nothing) until the producer and the signaller are done. Without it they spin in setmaxnreg.inc (it
          // retries until the consumers give their registers back, at their end) for the whole
          // kernel, taking issue slots from the consumer warps of their sub-partitions (v0.5
          // profile: 14% of all warp samples). Barrier 1 is used nowhere else.
          asm volatile("bar.sync 1, 128;" ::: "memory");
          cutlass::arch::warpgroup_reg_alloc<Cfg::kUniformRegs>();
        } else {
          cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
          typename Up::Pipe pipe;
          if constexpr (Cfg::kStagger > 0) {  // hopper_gemm.cuh StaggerPipe: warpgroup 2 starts after 1's lead
            const int wgu = __shfl_sync(0xffffffffu, tid / 128, 0);  // warp-uniform for ptxas (bwd_gemm.cuh)
            if (wgu == 2) sm90::mbar_wait(&sm90::s_stagger_bar, 0u);
            pipe.stagger_todo = wgu == 1 ? 1 : 0;
          }
          for_each_queued([&](int i, int kind, int c, int le, int rows, int m, int n, int share) {
            const int64_t row0 = int64_t(c % R) * C + m;
            const int crank = cc % kPair;  // the producer's (share, crank: a split B's halves, hopper_gemm.cuh)
            MOKGEN_FWD_TRACE_ONLY(
                fwd_trace::stage(i, wgi, 0, fwd_trace::timer()); fwd_trace::stage(i, wgi, 1, fwd_trace::clock());
                fwd_trace::stage(i, wgi, 6, kind); fwd_trace::stage(i, wgi, 7, rows);)
            if constexpr (Cfg::kFuseShared) {
              // one call site per tile type for routed and shared tiles (one inlined mainloop
              // each): output rows through SharedOrSlotRows
              if (kind == 0 || kind == 2) {  // the shared expert has no clamp (as the reference's)
                bf16* base = kind == 2 ? at<bf16>(mine, S.shared_h) + int64_t(m) * kI : ring_h + row0 * kI;
                Up::consume(Up::carve(smem), pipe, wgi - 1, rows, n * Up::kBN, StridedRows<kI>{base},
                            kind == 2 ? 3.0e38f : Cfg::kClampLimit, abort_flag,
                            SaveRows<kI>{p.save_gu, meta + row0, kind == 0}, share, crank);
                sm90::fence_proxy_async_global();  // h rows are read by TMA loads of down tiles
              } else {
                const SharedOrSlotRows<kH> out{kind == 3 ? at<bf16>(mine, S.shared_y) + int64_t(m) * kH : nullptr,
                                               meta + row0, sym, slots_off};
                Down::consume(Down::carve(smem), pipe, wgi - 1, rows, n * Down::kBN, out, 0.f, abort_flag,
                              sm90::NoSaveRows{}, share, crank);
              }
            } else if (kind == 0) {
              // MOKGEN_MX_NO_SAVE (measuring builds only: MXFP8 training then fails its launch, the
              // host refusing save_gu): the MX up tiles without the save's code, as before v0.64
              // (docs/perf-notes.md v0.64: the code costs the expanded pairs nothing, the codes
              // form in single CTAs 0.4%)
#if defined(MOKGEN_MX_NO_SAVE)
              const sm90::NoSaveRows mx_save{};
#else
              const SaveRingRows<kI> mx_save{p.save_gu, loc, L.ring_meta, int(row0)};
#endif
              if constexpr (CfgMxCodes<Cfg>::value)
                Up::consume(Up::carve(smem), pipe, wgi - 1, rows, n * Up::kBN, mx_h_rows(row0), Cfg::kClampLimit,
                            abort_flag, mx_save);
              else if constexpr (CfgMxExpand<Cfg>::value)
                Up::consume(Up::carve(smem), pipe, wgi - 1, rows, n * Up::kBN, sm90::MxRoundedRows<kI>{ring_h + row0 * kI},
                            Cfg::kClampLimit, abort_flag, mx_save, share, crank);
              else
                Up::consume(Up::carve(smem), pipe, wgi - 1, rows, n * Up::kBN, h_row(row0), Cfg::kClampLimit, abort_flag,
                            SaveRows<kI>{p.save_gu, meta + row0, true}, share, crank);
              sm90::fence_proxy_async_global();  // h rows are read by TMA loads of down tiles
            } else {
              Down::consume(Down::carve(smem), pipe, wgi - 1, rows, n * Down::kBN, slot_row(row0), 0.f, abort_flag,
                            sm90::NoSaveRows{}, share, crank);
            }
            MOKGEN_FWD_TRACE_ONLY(
                fwd_trace::stage(i, wgi, 2, fwd_trace::s_kloop_end[wgi]); fwd_trace::stage(i, wgi, 3, fwd_trace::clock());
                fwd_trace::stage(i, wgi, 4, fwd_trace::s_waited[wgi]);)
            const int j = i % kSig;
            if (i >= kSig) sm90::mbar_wait(&sig_free[j], uint32_t(i / kSig - 1) & 1u);
            __syncwarp();  // the warp's stores before lane 0's arrive (256 arrivals serialize)
            if (lane == 0) sm90::mbar_arrive(&sig_done[j]);  // release (CTA scope): this tile's stores
            MOKGEN_FWD_TRACE_ONLY(fwd_trace::stage(i, wgi, 5, fwd_trace::clock());)
          }, std::true_type{});
          if constexpr (Cfg::kStagger > 0) {
            if (pipe.stagger_todo) {  // fewer k-blocks than the lead (a CTA with no tile): warpgroup 2 still waits
              if ((tid & 127) == 0) sm90::mbar_arrive(&sm90::s_stagger_bar);
              pipe.stagger_todo = 0;
            }
          }
          cutlass::arch::warpgroup_reg_dealloc<Cfg::kUniformRegs>();
        }
        if constexpr (kPair == 2)
          cute::cluster_sync();  // no multicast or remote arrive targets a CTA after this
        else
          __syncthreads();
        MOKGEN_FWD_TRACE_ONLY(if (tid == 0) fwd_trace::phase(2, fwd_trace::timer());
                              if (tid == 32 && tr_sig_n > 0) fwd_trace::flush_consumers(tr_sig_n - 1, true);)
        ok = ok && !*abort_flag;
      } else if constexpr (Cfg::kWgmma) {
        // Phased schedule (MOKGEN_SCHEDULE=phased): per chunk, the up tiles, a barrier of all
        // compute CTAs, the down tiles, a barrier, the slot freed.
        // Warp-specialized: warpgroup 0's thread 0 issues TMA loads, warpgroups 1 and 2 run wgmma
        // and the epilogues. Disjoint code per role, so setmaxnreg can rebalance the registers.
        const int wgi = tid / 128;
        if (tid == 0) Up::init_barriers(Up::carve(smem));
        __syncthreads();
        if (wgi == 0) {
          cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
          typename Up::Pipe pipe;
          chunk_loop([&](int c, int phase) {
            sm90::fence_proxy_async_global();  // ring rows / h rows: generic writes -> TMA reads
            if (tid != 0) return;
            if (phase == 0)
              for_my_tiles(c, 0, [&](int le, int rows, int64_t row0, int n) {
                Up::produce(Up::carve(smem), pipe, &maps.ring_x[g], int(row0), &maps.w_gate[g], &maps.w_up[g],
                            le * kI + n * Up::kBN);
              });
            else
              for_my_tiles(c, 1, [&](int le, int rows, int64_t row0, int n) {
                Down::produce(Down::carve(smem), pipe, &maps.ring_h[g], int(row0), &maps.w_down[g], nullptr,
                              le * kH + n * Down::kBN);
              });
          });
          cutlass::arch::warpgroup_reg_alloc<Cfg::kUniformRegs>();
        } else {
          cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
          typename Up::Pipe pipe;
          chunk_loop([&](int c, int phase) {
            if (phase == 0)
              for_my_tiles(c, 0, [&](int le, int rows, int64_t row0, int n) {
                Up::consume(Up::carve(smem), pipe, wgi - 1, rows, n * Up::kBN, h_row(row0), Cfg::kClampLimit, nullptr,
                            SaveRows<kI>{p.save_gu, meta + row0, true});
              });
            else
              for_my_tiles(c, 1, [&](int le, int rows, int64_t row0, int n) {
                if (n == 0 && tid == 128) count_pushed(rows);
                Down::consume(Down::carve(smem), pipe, wgi - 1, rows, n * Down::kBN, slot_row(row0), 0.f);
              });
            sm90::fence_proxy_async_global();  // h rows are read by the TMA in the down phase
          });
          cutlass::arch::warpgroup_reg_dealloc<Cfg::kUniformRegs>();
        }
      } else {
        chunk_loop([&](int c, int phase) {
          if (phase == 0)
            for_my_tiles(c, 0, [&](int le, int rows, int64_t row0, int n) {
              Up::run(smem, rows, n * Up::kBN, p.w_gate[g] + int64_t(le) * kI * kH, p.w_up[g] + int64_t(le) * kI * kH,
                      [&](int r) { return ring_x + (row0 + r) * kH; }, h_row(row0), Cfg::kClampLimit);
            });
          else
            for_my_tiles(c, 1, [&](int le, int rows, int64_t row0, int n) {
              if (n == 0 && tid == 0) count_pushed(rows);
              Down::run(smem, rows, n * Down::kBN, p.w_down[g] + int64_t(le) * kH * kI, nullptr, h_row(row0),
                        slot_row(row0), 0.f);
            });
        });
      }
      // The rank's region pointers, read again from the parameters: kept in registers across the
      // GEMM roles above they spill (the consumers' accumulators take most of the registers).
      loc = p.local[opaque(g)];
      bar_comp = at<unsigned long long>(loc, L.bar_compute);
      // All pushes of this CTA visible system-wide, then one CTA tells every owner.
      if (ok) {
        __threadfence_system();
        ok = group_barrier(bar_comp, tag(epoch, ++n_comp * Gj), w, &s_flag);
        if (ok && cc == 0 && tid == 0) {
          __threadfence_system();
          at<long long>(loc, L.stats)[kStatTimeDone] = (long long)globaltimer_ns();
#if defined(MOKGEN_FAULT_STAGE) && MOKGEN_FAULT_STAGE == 5
          // fault build: rank 0 tells only itself, never its peers (their combine waits time out)
          for (int o = 0; o < W; ++o)
            if (rank != 0 || o == 0) st_release_sys(at<unsigned long long>(p.sym[o], S.done) + rank, tag(epoch, 1));
#else
          for (int o = 0; o < W; ++o) st_release_sys(at<unsigned long long>(p.sym[o], S.done) + rank, tag(epoch, 1));
#endif
        }
      }
    }

    // ---- 4. combine ------------------------------------------------------------------------------
    mine = p.sym[opaque(rank)];  // read again, as loc above
    MOKGEN_FWD_TRACE_ONLY(if (tid == 0) fwd_trace::phase(3, fwd_trace::timer());)
    if (ok) {
      if (tid == 0) {
        bool all = true;
        for (int s = 0; s < W && all; ++s)
          all = w.wait_geq<true>(at<unsigned long long>(mine, S.done) + s, tag(epoch, 1), kStageCombineDone, s);
        s_flag = all;
      }
      __syncthreads();
      if (s_flag) {
        const bf16* shared_y = nullptr;
        if constexpr (Cfg::kFuseShared)
          if (p.shared_w[0] != nullptr) shared_y = at<const bf16>(mine, S.shared_y);
        combine_tokens<kH, kK, kE, kEpThreads, Cfg::kFuseShared>(at<const bf16>(mine, S.slots), p.ids[g], p.weights[g],
                                                                  T, cta, G, shared_y, p.shared_scale[g], p.out[g]);
      }
    }
    MOKGEN_FWD_TRACE_ONLY(__syncthreads(); if (tid == 0) fwd_trace::phase(4, fwd_trace::timer());)
  }

  // ---- exit: the last CTA of the launch re-bases the counters and advances the epoch ----------
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    if (atomicAdd(&ctl->finished, 1u) == gridDim.x - 1) {
      __threadfence();  // acquire: every CTA's updates of the counters come before the re-base
      const LocalLayout<Cfg>& L = lay.L;
      for (int r = 0; r < p.launch_ranks; ++r) {
        *at<unsigned long long>(p.local[r], L.bar_rank) = tag(epoch + 1, 0);
        *at<unsigned long long>(p.local[r], L.bar_compute) = tag(epoch + 1, 0);
        *at<unsigned int>(p.local[r], L.tile_next) = 0;
        for (int q = 0; q < p.ring_chunks; ++q)  // an aborted launch may leave parts counted
          at<unsigned long long>(p.local[r], L.chunk_arrived)[q] = 0;
      }
      ctl->abort = 0;
      ctl->finished = 0;
      __threadfence();
      atomicExch(&ctl->epoch, epoch + 1);
    }
  }
}

template <class Cfg>
struct EpLauncher {
  static constexpr int kThreads = EpForward<Cfg>::kThreads;

  // TMA descriptors of every rank of the launch (Hopper core).
  static cudaError_t encode_maps(const EpParams& p, EpMaps& m) {
    if constexpr (Cfg::kWgmma) {
      const int e_loc = Cfg::kExperts / p.world;
      const LocalLayout<Cfg> L(p.world, p.chunk_rows, p.ring_chunks);
      const uint64_t ring_rows = uint64_t(p.chunk_rows) * p.ring_chunks;
      using Up = typename EpForward<Cfg>::Up;
      using Down = typename EpForward<Cfg>::Down;
      for (int r = 0; r < p.launch_ranks; ++r) {
        // the A operands: bf16 rows, or (MXFP8) E4M3 codes in 64-byte boxes and their scale planes
        // (in sym_x / shared_h, unused by these builds)
        bool a_ok = true;
        if constexpr (CfgMxCodes<Cfg>::value)
          a_ok = sm90::encode_scales_2d(&m.sym_x[r], p.local[r] + L.ring_x_scales, ring_rows, Cfg::kHidden / 128) ==
                     CUDA_SUCCESS &&
                 sm90::encode_scales_2d(&m.shared_h[r], p.local[r] + L.ring_h_scales, ring_rows, Cfg::kInter / 128) ==
                     CUDA_SUCCESS;
        a_ok = a_ok &&
            (CfgMxCodes<Cfg>::value ? sm90::encode_codes_2d(&m.ring_x[r], p.local[r] + L.ring_x, ring_rows, Cfg::kHidden, Up::kBK,
                                             Up::kABox) == CUDA_SUCCESS &&
                           sm90::encode_codes_2d(&m.ring_h[r], p.local[r] + L.ring_h, ring_rows, Cfg::kInter, Down::kBK,
                                                 Down::kABox) == CUDA_SUCCESS
                     : sm90::encode_map_2d(&m.ring_x[r], p.local[r] + L.ring_x, ring_rows, Cfg::kHidden, Up::kABox,
                                           Up::kBK) == CUDA_SUCCESS &&
                           sm90::encode_map_2d(&m.ring_h[r], p.local[r] + L.ring_h, ring_rows, Cfg::kInter, Down::kABox,
                                               Up::kBK) == CUDA_SUCCESS);
        const bool ok =
            a_ok &&
            sm90::encode_map_2d(&m.w_gate[r], p.w_gate[r], uint64_t(e_loc) * Cfg::kInter, Cfg::kHidden, Up::kBBox, Up::kBK) == CUDA_SUCCESS &&
            sm90::encode_map_2d(&m.w_up[r], p.w_up[r], uint64_t(e_loc) * Cfg::kInter, Cfg::kHidden, Up::kBBox, Up::kBK) == CUDA_SUCCESS &&
            sm90::encode_map_2d(&m.w_down[r], p.w_down[r], uint64_t(e_loc) * Cfg::kHidden, Cfg::kInter,
                                Down::kBBox, Up::kBK) == CUDA_SUCCESS;
        if (!ok) return cudaErrorInvalidValue;
        if constexpr (Cfg::kFuseShared) {
          if (p.shared_w[0] != nullptr) {
            const SymLayout<Cfg> S(p.max_tokens);
            char* mine = p.sym[p.rank_base + r];
            const bool sh_ok =
                sm90::encode_map_2d(&m.sym_x[r], mine + S.x, uint64_t(p.max_tokens), Cfg::kHidden, Up::kABox, Up::kBK) == CUDA_SUCCESS &&
                sm90::encode_map_2d(&m.shared_h[r], mine + S.shared_h, uint64_t(p.max_tokens), Cfg::kInter, Down::kABox, Up::kBK) ==
                    CUDA_SUCCESS;
            if (!sh_ok) return cudaErrorInvalidValue;
          }
        }
      }
      if constexpr (Cfg::kFuseShared) {
        if (p.shared_w[0] != nullptr) {
          const bool ok =
              sm90::encode_map_2d(&m.sh_gate, p.shared_w[0], Cfg::kInter, Cfg::kHidden, Up::kBBox, Up::kBK) == CUDA_SUCCESS &&
              sm90::encode_map_2d(&m.sh_up, p.shared_w[1], Cfg::kInter, Cfg::kHidden, Up::kBBox, Up::kBK) == CUDA_SUCCESS &&
              sm90::encode_map_2d(&m.sh_down, p.shared_w[2], Cfg::kHidden, Cfg::kInter, Down::kBBox, Up::kBK) == CUDA_SUCCESS;
          if (!ok) return cudaErrorInvalidValue;
        }
      }
    }
    return cudaSuccess;
  }

  static_assert(Cfg::kCluster == 1 || (Cfg::kCluster == 2 && Cfg::kWgmma && Cfg::kFlow),
                "clusters of two need the Hopper core and the flow schedule");
  static_assert(!Cfg::kFuseShared || (Cfg::kWgmma && Cfg::kFlow),
                "the fused shared expert needs the Hopper core's flow schedule");

  // How the last launch went: 1 cooperative, 2 cooperative with clusters, 3 clusters without the
  // cooperative attribute (co-residency then rests on max_ctas(); every wait is bounded anyway).
  static int& last_mode() {
    static int mode = 0;
    return mode;
  }

  // What encode_maps reads from EpParams: the launch's TMA descriptors are a function of these
  // alone (the weights, the private and symmetric regions and the ring's shape; not x, the
  // routing or the outputs, which change from call to call).
  struct MapKey {
    char* sym[kMaxWorld];
    char* local[kMaxLaunchRanks];
    const bf16* w[3][kMaxLaunchRanks];
    const bf16* shared_w[3];
    int world, rank_base, launch_ranks, max_tokens, chunk_rows, ring_chunks;
  };

  static void map_key(const EpParams& p, MapKey& k) {
    memset(&k, 0, sizeof(k));
    for (int r = 0; r < p.world && r < kMaxWorld; ++r) k.sym[r] = p.sym[r];
    for (int r = 0; r < p.launch_ranks && r < kMaxLaunchRanks; ++r) {
      k.local[r] = p.local[r];
      k.w[0][r] = p.w_gate[r];
      k.w[1][r] = p.w_up[r];
      k.w[2][r] = p.w_down[r];
    }
    for (int i = 0; i < 3; ++i) k.shared_w[i] = p.shared_w[i];
    k.world = p.world;
    k.rank_base = p.rank_base;
    k.launch_ranks = p.launch_ranks;
    k.max_tokens = p.max_tokens;
    k.chunk_rows = p.chunk_rows;
    k.ring_chunks = p.ring_chunks;
  }

  // The last launch's descriptors on this host thread, and the device whose function attribute
  // it set: a call with the same MapKey (a layer called again) reuses them, which saves the
  // encodes and the attribute call, host time before each launch that an idle GPU waits for
  // (docs/perf-notes.md v0.29). Thread-local, so threads driving different GPUs never share one.
  struct LaunchCache {
    bool valid = false;
    int device = -1;
    MapKey key;
    EpMaps maps;
  };

  static LaunchCache& launch_cache() {
    static thread_local LaunchCache cache;
    return cache;
  }

  static cudaError_t launch(const EpParams& p, cudaStream_t stream) {
    auto kernel = ep_forward_kernel<Cfg>;
    const int smem = int(EpForward<Cfg>::kSmemBytes);
    LaunchCache& cache = launch_cache();
    int device = -1;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    if (device != cache.device) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (err != cudaSuccess) return err;
      cache.device = device;
    }
    if (Cfg::kCluster == 2 && (p.ctas_per_rank % 2 || p.dispatch_ctas % 2)) return cudaErrorInvalidValue;
    // saved pre-activations: the Hopper core's gated epilogues write them (HopperTile's, and the MX
    // tile's for MXFP8 builds, from the same float32 sums), into every source's buffer
    if (p.save_gu[0] != nullptr && (!Cfg::kWgmma || p.launch_ranks != p.world || p.rank_base != 0))
      return cudaErrorInvalidValue;
#if defined(MOKGEN_MX_NO_SAVE)
    if (p.save_gu[0] != nullptr && Cfg::kMx) return cudaErrorInvalidValue;
#endif
    MapKey key;
    map_key(p, key);
    if (!cache.valid || memcmp(&key, &cache.key, sizeof(key)) != 0) {
      cache.valid = false;
      memset(&cache.maps, 0, sizeof(cache.maps));
      if ((err = encode_maps(p, cache.maps)) != cudaSuccess) return err;
      cache.key = key;
      cache.valid = true;
    }
    EpLayouts<Cfg> lay{SymLayout<Cfg>(p.max_tokens), LocalLayout<Cfg>(p.world, p.chunk_rows, p.ring_chunks)};
    void* args[] = {const_cast<EpParams*>(&p), &cache.maps, &lay};
    const unsigned grid = unsigned(p.launch_ranks * p.ctas_per_rank);
    if constexpr (Cfg::kCluster == 1) {
      last_mode() = 1;
      return cudaLaunchCooperativeKernel(reinterpret_cast<void*>(kernel), dim3(grid), dim3(kThreads), args,
                                         size_t(smem), stream);
    } else {
      cudaLaunchAttribute attrs[2];
      attrs[0].id = cudaLaunchAttributeClusterDimension;
      attrs[0].val.clusterDim.x = 2;
      attrs[0].val.clusterDim.y = 1;
      attrs[0].val.clusterDim.z = 1;
      attrs[1].id = cudaLaunchAttributeCooperative;
      attrs[1].val.cooperative = 1;
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(grid);
      cfg.blockDim = dim3(kThreads);
      cfg.dynamicSmemBytes = size_t(smem);
      cfg.stream = stream;
      cfg.attrs = attrs;
      cfg.numAttrs = 2;
      err = cudaLaunchKernelExC(&cfg, reinterpret_cast<const void*>(kernel), args);
      if (err == cudaSuccess) {
        last_mode() = 2;
        return err;
      }
      (void)cudaGetLastError();  // a refused launch configuration is not sticky
      // A grid too large to be co-resident stays an error; otherwise the attribute combination
      // itself may be what was refused: retry as a plain cluster launch (mode 3).
      if (err == cudaErrorCooperativeLaunchTooLarge) return err;
      cfg.numAttrs = 1;
      err = cudaLaunchKernelExC(&cfg, reinterpret_cast<const void*>(kernel), args);
      if (err == cudaSuccess) last_mode() = 3;
      return err;
    }
  }

  // CTAs of this kernel that can be co-resident on the current device (whole clusters).
  static int max_ctas() {
    auto kernel = ep_forward_kernel<Cfg>;
    const int smem = int(EpForward<Cfg>::kSmemBytes);
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) return -1;
    int dev = 0, sms = 0, per_sm = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return -1;
    if constexpr (Cfg::kCluster == 2) {
      cudaLaunchAttribute attr;
      attr.id = cudaLaunchAttributeClusterDimension;
      attr.val.clusterDim.x = 2;
      attr.val.clusterDim.y = 1;
      attr.val.clusterDim.z = 1;
      cudaLaunchConfig_t cfg = {};
      if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return -1;
      cfg.gridDim = dim3(unsigned(sms));
      cfg.blockDim = dim3(kThreads);
      cfg.dynamicSmemBytes = size_t(smem);
      cfg.attrs = &attr;
      cfg.numAttrs = 1;
      int clusters = 0;
      if (cudaOccupancyMaxActiveClusters(&clusters, reinterpret_cast<const void*>(kernel), &cfg) != cudaSuccess) return -1;
      return 2 * clusters;
    }
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return -1;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem) != cudaSuccess) return -1;
    return sms * per_sm;
  }
};

}  // namespace mokgen
