#pragma once
// The V:2:M sparse-wgmma SpMM's X^T path (sm_90a only; spmm_vnm_sm90 takes it where its plan says so:
// spmm_vnm_sm90_takes_xt, from tile_config.h sm90_vnm_xt): X transposed first (X^T, K rows x ld tokens,
// token-contiguous), so a kept column is one contiguous row and only the kept columns cross L2 -> SM. Same arguments
// and layouts as spmm_vnm_sm90.cu (the packed V:2:M weight: the 2:4 layout over the 4 kept columns of each group, per
// 64-row slab).
//
// Why: gathering 4 of every M columns out of row-major X brings every raw byte through L2 -> SM (32-byte sectors
// hold 16 columns), which is what bounds a row-major V:2:M kernel: at M = 8 a k-tile then moves 1.12x fewer bytes
// than 2:4 for the same original columns, at M = 16 1.20x (benchmarks/RESULTS.md, "the ceilings that bound the
// sparse-wgmma SpMMs"). From X^T a k-tile of 64 condensed columns moves the bytes of one 2:4 k-tile (32 KB of X at
// 256 tokens, 9 KB of A) for M / 4 times the original columns; the feed skeleton of that design
// (benchmarks/roofline_sm90.cu, rows_cp) runs at the 2:4 skeleton's cycles per k-tile.
//
// Kernel: tiles of 128 weight rows x BN (256, 128 or 64) tokens (tile_config.h sm90_vnm_xt_plan, split along K where
// the tiles are few), one persistent CTA per SM walking the work units, launched as the transpose's programmatic
// dependent (its launch and set-up overlap the transpose's end; the producers wait for the transpose's grid).
// Producer warpgroup (warps 8-11; at 64 and 128 tokens a second one, warps 12-15, and the two take alternate steps):
// per step, warp w copies kept column w of each of the k-tile's 16 groups (64 rows of X^T), lane l its 16-byte chunk
// l (tokens 8l ..), by cp.async into the B tile (64 condensed k x BN tokens, MN-major, 128-byte swizzle: BN / 64
// blocks of 64 tokens, k-row r of a block at r x 128 bytes, chunk c at c ^ (r & 7)), plus the k-tile's A fragments
// and metadata of the CTA's 8 m16 tiles; each thread's cp.async.mbarrier.arrive.noinc completes the stage's "full"
// barrier.
// Consumer warpgroups (0, 1: slabs 0, 1): wait, fence.proxy.async (cp.async writes through the generic proxy), read
// their A fragments and metadata from the stage, two sparse wgmmas with B transposed (WgmmaSpT), release the
// previous stage per warp. Where the CTA's two slabs keep the same columns (V = 128, checked at the start) one B
// tile feeds both; otherwise a k-tile takes two steps, one per slab, and each consumer warpgroup skips the other's.
// Tokens past n_tokens are zeros of X^T's padding or zero-filled (src-size 0); groups past G read group G - 1's
// columns (their A values are zero); a missing second k-step of an odd step count multiplies zeros with valid
// metadata.
//
// This header holds the kernel, its launch and its dispatch over M and the tile width for one dtype (dispatch_m<T>),
// in an anonymous namespace; each dtype's kernels compile in a translation unit of their own, so the build compiles
// them in parallel: spmm_vnm_xt_sm90.cu (bf16, and the host entry points of kernels.h) and spmm_vnm_xt_sm90_fp16.cu
// (fp16).

#include <algorithm>

#include "common.cuh"
#include "kernels.h"
#include "launch.h"
#include "tensor_map.h"
#include "tile_config.h"
#include "transpose_tokens.cuh"
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "sm90_common.cuh"
#include "tma_sm90.cuh"  // mbarrier wrappers, setmaxnreg, named barriers
#include "wgmma_sp.cuh"
#endif

namespace hf_sparse {
namespace {
// DEEP (128- and 256-token tiles, tile_config.h sm90_vnm_xt_deep_ring): eight stages instead of six at 128 tokens,
// five instead of four at 256, the staged epilogue in 64-token chunks so that they fit.
template <int M, int BN, bool DEEP = false>
struct XtCfg {
  static_assert(!DEEP || BN >= 128, "the deeper ring is a 128- or 256-token tile's");
  static constexpr int B_BYTES = BN * 128;         // 64 condensed k-rows x BN tokens
  static constexpr int A_OFF = B_BYTES;
  static constexpr int A_BYTES = 8 * 2 * 32 * 16;  // 8 m16 tiles x 2 k-steps x 32 lanes x 16 bytes
  static constexpr int E_OFF = A_OFF + A_BYTES;
  static constexpr int E_BYTES = 8 * 2 * 16 * 4;   // 8 m16 tiles x 2 k-steps x 16 words
  static constexpr int STAGE = E_OFF + E_BYTES;
  // Narrower stages: more of them in flight in the same memory. The 64-token tile fits 12: measured faster than 8 at
  // M >= 16 and slower at M = 8 (benchmarks/RESULTS.md, "12 stages for the 64-token tile at M >= 16"). DEEP: as many
  // as fit beside a 64-token staged epilogue (a multiple of PRODUCERS at 128 tokens).
  static constexpr int STAGES = BN == 256 ? (DEEP ? 5 : 4) : BN == 128 ? (DEEP ? 8 : 6) : M >= 16 ? 12 : 8;
  // Producer warpgroups: at 64 and 128 tokens a step's copies are few and its wgmmas short, so one warpgroup's chain
  // of address arithmetic per step is what the consumers wait for; two take alternate steps (their accumulators, 32
  // or 64 floats a thread, leave the consumers registers to spare). At 256 tokens one, for the consumers' 208.
  static constexpr int PRODUCERS = BN <= 128 ? 2 : 1, THREADS = 128 * (2 + PRODUCERS);
  static_assert(STAGES % PRODUCERS == 0, "a producer warpgroup's ring slot steps by PRODUCERS and must wrap to 0");
  static constexpr int PRODUCER_REGS = PRODUCERS == 2 ? 104 : 88, CONSUMER_REGS = PRODUCERS == 2 ? 152 : 208;
  // setmaxnreg only moves registers within what the CTA was launched with: THREADS x the per-thread count ptxas
  // compiles to under __launch_bounds__(THREADS, 1) (the register file over THREADS, in steps of 8; ptxas reports it
  // as "Used"). A split above that would leave the consumers' setmaxnreg.inc waiting forever.
  static constexpr int LAUNCH_REGS = 65536 / THREADS / 8 * 8;
  static_assert(2 * CONSUMER_REGS + PRODUCERS * PRODUCER_REGS <= (2 + PRODUCERS) * LAUNCH_REGS,
                "the register split must fit the registers the CTA is launched with");
  // The staged epilogue (sm90_common.cuh store_tile_staged): per consumer warpgroup one buffer of 64 rows x 128
  // tokens, so a 256-token tile takes two chunks, each with its own pair of warpgroup barriers (the fewer chunks,
  // the fewer barriers; a whole tile staged does not fit beside four stages); DEEP: 64-token chunks (four at 256
  // tokens, two at 128), which leave room for the deeper ring's stages.
  static constexpr int EPI_N = DEEP ? 64 : BN < 128 ? BN : 128, EPI_BUFS = 1, EPI_CHUNK = EPI_N * 128;
  static constexpr int EPI_OFF = STAGES * STAGE;
  // The timeline build's issue clock per stage (XtCycles::stamp), after the step info; none in the product build.
#if defined(HF_SPARSE_TIMELINE)
  static constexpr int STAMP_BYTES = 8 * STAGES;
#else
  static constexpr int STAMP_BYTES = 0;
#endif
  // + the staging buffers, full / empty barriers, 16 bytes of step info per stage, stamps, alignment slack
  static constexpr int SMEM = EPI_OFF + 2 * EPI_BUFS * EPI_CHUNK + 2 * 8 * STAGES + 16 * STAGES + STAMP_BYTES + 1024;
  static_assert(STAGE % 1024 == 0, "stages must start on 1024-byte boundaries (128-byte swizzle atoms)");
  static_assert(SMEM <= 227 * 1024, "over the sm_90 shared-memory limit");
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
// OR of `v` over the `threads` threads of named barrier `id` (all of them must call it).
__device__ __forceinline__ bool bar_red_or(int id, int threads, bool v) {
  uint32_t r;
  asm volatile(
      "{\n.reg .pred p, q;\nsetp.ne.u32 q, %1, 0;\nbar.red.or.pred p, %2, %3, q;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(r)
      : "r"((uint32_t)v), "r"(id), "r"(threads)
      : "memory");
  return r != 0;
}
#endif

// Timeline build (nvcc -DHF_SPARSE_TIMELINE through HF_SPARSE_NVCC_FLAGS; benchmarks/timeline_xt.py): each CTA sums
// SM cycles (clock64) by what its roles wait on over all its work units: the producer (thread 0 of its warpgroup) in
// each unit's set-up before its first copy and waiting for free stages; the consumers (thread 0 of warpgroup 0)
// waiting for full stages, draining the last wgmmas, in split-K and in the epilogue. And how long a stage takes from
// the producer's first copy into it to the consumer's full-wait returning (the copies' flight, or more where the
// consumer came later), summed over the steps the consumer computed, and their count. The product build compiles
// none of it.
enum XtCounter { kXcUnits, kXcProducerTotal, kXcSetUp, kXcEmptyWait, kXcConsumerTotal, kXcFullWait, kXcDrain,
                 kXcSplit, kXcEpilogue, kXcStageFlight, kXcSteps, kXtCounters };
#if defined(HF_SPARSE_TIMELINE)
constexpr int kXtTimelineCtas = 1024;
__device__ unsigned long long g_xt_counters[kXtTimelineCtas][kXtCounters];
#endif
// One role's cycle sums in a CTA (timeline build only: in the product build every member is empty code): add(c,
// since) adds the cycles since `since` (a now() value) to counter c, store() writes them into the CTA's row. The sums
// of one call are held in 32 bits (2^32 cycles: over 2 s), half the registers of 64, which the consumers lack.
struct XtCycles {
#if defined(HF_SPARSE_TIMELINE)
  unsigned sum[kXtCounters] = {};
#endif
  __device__ __forceinline__ long long now() const {
#if defined(HF_SPARSE_TIMELINE) && defined(__CUDA_ARCH__)
    return clock64();
#else
    return 0;
#endif
  }
  __device__ __forceinline__ void add(int c, long long since) {
#if defined(HF_SPARSE_TIMELINE) && defined(__CUDA_ARCH__)
    sum[c] += (unsigned)(clock64() - since);
#endif
  }
  __device__ __forceinline__ void count(int c) {
#if defined(HF_SPARSE_TIMELINE)
    ++sum[c];
#endif
  }
  // The now() of the producer's first copy into a stage, into that stage's stamp (clock64 is per SM: both roles of a
  // CTA read the same clock). The stage's full barrier, which the consumer waits on before reading it, completes
  // only after this thread's arrive, which follows the store.
  __device__ __forceinline__ void stamp(volatile long long* at) const {
#if defined(HF_SPARSE_TIMELINE) && defined(__CUDA_ARCH__)
    *at = clock64();
#endif
  }
  __device__ __forceinline__ void add_since_stamp(int c, const volatile long long* at) {
#if defined(HF_SPARSE_TIMELINE) && defined(__CUDA_ARCH__)
    add(c, *at);
#endif
  }
  // Thread `writer`'s sums of counters [first, last) into this CTA's row.
  __device__ __forceinline__ void store(bool writer, int first, int last) const {
#if defined(HF_SPARSE_TIMELINE) && defined(__CUDA_ARCH__)
    if (!writer || blockIdx.x >= kXtTimelineCtas) return;
    for (int c = first; c < last; ++c) g_xt_counters[blockIdx.x][c] = sum[c];
#endif
  }
};

// What the producer tells the consumers with every stage (16 bytes copied into the stage's info slot by cp.async, so
// the stage's "full" barrier covers it): whether the tile's two slabs share one B tile. Defined in every compile pass:
// the host pass's registration stub names it.
[[maybe_unused]] __device__ const uint4 kXtShareWord[2] = {{0u, 0u, 0u, 0u}, {1u, 1u, 1u, 1u}};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
// p + a x b bytes, the product 64-bit: one mad.wide.u32.
__device__ __forceinline__ const unsigned char* mad_wide(uint32_t a, uint32_t b, const unsigned char* p) {
  unsigned long long r;
  asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(r) : "r"(a), "r"(b), "l"(reinterpret_cast<unsigned long long>(p)));
  return reinterpret_cast<const unsigned char*>(r);
}
#endif

// Persistent: CTA b takes tiles b, b + gridDim.x, ... (row blocks fastest); the ring, its barriers and the step
// count run on across tiles, so the producer fills the next tile's first stages while the consumers store the last.
template <typename T, int M, int BN, bool DEEP>
__global__ void __launch_bounds__(XtCfg<M, BN, DEEP>::THREADS, 1)
spmm_vnm_sm90_xt_kernel(const T* __restrict__ xt, int ld, const uint4* __restrict__ values,
                        const uint32_t* __restrict__ meta, const uint32_t* __restrict__ columns,
                        const T* __restrict__ bias, T* __restrict__ y, int n_tokens, int rows, int rows_padded, int k,
                        int steps, int splits, float* __restrict__ split_ws, int* __restrict__ split_counters,
                        const __grid_constant__ CUtensorMap y_map, bool staged) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = XtCfg<M, BN, DEEP>;
  constexpr int STAGES = Cfg::STAGES, BLOCKS = BN / 64;  // BLOCKS: 64-token blocks of the B tile
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw_u32 = (uint32_t)__cvta_generic_to_shared(smem_raw);
  const uint32_t pad = pad_to_1024(raw_u32);
  unsigned char* smem = smem_raw + pad;
  const uint32_t base = raw_u32 + pad;
  const uint32_t epi = base + Cfg::EPI_OFF;
  const uint32_t full = epi + 2 * Cfg::EPI_BUFS * Cfg::EPI_CHUNK, empty = full + 8 * STAGES;
  const uint32_t info = empty + 8 * STAGES;  // 16 bytes per stage, after the barriers
  volatile long long* stamps = reinterpret_cast<volatile long long*>(smem + (info - base) + 16 * STAGES);  // timeline
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
  const int row_blocks = (rows_padded + 127) >> 7, n_tiles = row_blocks * ((n_tokens + BN - 1) / BN);
  const int n_units = n_tiles * splits;
  const int mt_last = (rows_padded >> 4) - 1;
  const int all_k_tiles = (steps + 1) >> 1, groups = k / M, groups_padded = 8 * steps;
  const int kt_per_split = (all_k_tiles + splits - 1) / splits;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + 8 * s, 128);  // one cp.async arrival per producer thread
      mbar_init(empty + 8 * s, 8);   // one per consumer warp
    }
    mbar_fence_init();
  }
  __syncthreads();

  if (wg >= 2) {  // producer warpgroup p: the steps p, p + PRODUCERS, .. of every unit
    setmaxnreg_dec<Cfg::PRODUCER_REGS>();
    constexpr int P = Cfg::PRODUCERS;
    const int p = wg - 2;
    const int t = tid & 127, w = warp & 3;
    XtCycles cycles;
    const long long start = cycles.now();
    // Launched as the transpose's programmatic dependent: X^T is complete and visible only after this wait (what came
    // before, the CTA's launch and barrier set-up, overlaps the transpose's end). At once where launched plainly.
    asm volatile("griddepcontrol.wait;" ::: "memory");
    int gs = 0;  // the steps of every unit before this one, over all tiles
    for (int unit = blockIdx.x; unit < n_units; unit += gridDim.x) {
      const long long unit_start = cycles.now();
      const int tile = unit % n_tiles, kt0 = (unit / n_tiles) * kt_per_split;
      const int k_tiles = min(all_k_tiles, kt0 + kt_per_split) - kt0;
      const int cta_row0 = (tile % row_blocks) * 128, n_base = (tile / row_blocks) * BN;
      const int mt_cta = cta_row0 >> 4;
      const uint32_t* col0 = columns + (size_t)(cta_row0 >> 6) * groups_padded;
      const bool two_slabs = ((rows_padded - cta_row0) >> 4) > 4;
      const uint32_t* col1 = two_slabs ? col0 + groups_padded : col0;
      // Whether the slabs share columns, from the columns themselves although the launch knows V: these loads also
      // bring the column words into L1 for the row addresses below, and taking it from V with an L1 prefetch instead
      // was slower (benchmarks/RESULTS.md, "two producer warpgroups": 0.81-1.01x).
      bool differ = false;
      if (two_slabs)  // groups_padded is a multiple of 8: whole 16-byte words
        for (int i = t; i < groups_padded / 4; i += 128) {
          const uint4 a = reinterpret_cast<const uint4*>(col0)[i], b = reinterpret_cast<const uint4*>(col1)[i];
          differ |= a.x != b.x || a.y != b.y || a.z != b.z || a.w != b.w;
        }
      const bool share = !bar_red_or(p == 0 ? 1 : 5, 128, differ);  // named barriers 1, 5: one per warpgroup
      const int n_steps = share ? k_tiles : 2 * k_tiles;
      // Roles: warp w copies B rows 16w .. 16w + 15 (groups 4w .. 4w + 3 of the k-tile, their 4 kept columns each),
      // lane l rows 16w + 4s + l / 8 for s = 0..3 (group 4w + s, kept column l / 8), 16-byte chunks l % 8 + 8q of
      // them (q < BLOCKS: tokens 64q ..): a warp instruction covers 4 rows x 128 contiguous bytes, and each lane works
      // out 4 row addresses per step. Chunks past X^T's tokens copy 0 bytes (zero fill) from addresses inside its
      // padding (spmm_vnm_xt_sm90_elems).
      const int kept = lane >> 3, part = lane & 7;
      const int n = n_base + part * 8;  // the first token of this lane's chunks (+ 64q)
      uint32_t bytes[BLOCKS], dst_off[4];
#pragma unroll
      for (int q = 0; q < BLOCKS; ++q) bytes[q] = n + 64 * q < ld ? 16u : 0u;
#pragma unroll
      for (int s4 = 0; s4 < 4; ++s4) {
        const int r = 16 * w + 4 * s4 + kept;  // the B row of this lane's s4-th group
        dst_off[s4] = (uint32_t)(r * 128 + ((part ^ (r & 7)) << 4));
      }
      const unsigned char* xt_lane = reinterpret_cast<const unsigned char*>(xt + n);
      const uint32_t ld_bytes = (uint32_t)ld * sizeof(T);  // a row of X^T; a column's offset is one 32x32->64 multiply
      // A fragments and metadata: chunk c = t + 128u (u = 0..4) of the stage's 576 (c < 512: m16 tile c / 64, k-step
      // (c / 32) % 2, lane c % 32; then metadata: m16 tile / 8, k-step / 4 % 2, words 4 x (/ 1 % 4) ..). a_src[u]:
      // the chunk of the unit's first k-tile; k-tile i of the unit lies i x 2 k-steps further (1024 bytes of A, 128 of
      // metadata), so a step adds one offset per kind instead of working out each address. A k-step past `steps`
      // (k-step 1 of the last k-tile where steps is odd) copies 0 bytes from a_src[u], which is inside the pack.
      const unsigned char* a_src[5];
      // Whether this thread's A chunks (u < 4: all of them the same k-step) and metadata chunk are k-step 1 of a unit
      // whose last k-tile has no k-step 1.
      const bool odd_tail = (steps & 1) != 0 && kt0 + k_tiles == all_k_tiles;
      const bool odd_a = odd_tail && ((t >> 5) & 1) != 0, odd_e = odd_tail && ((t >> 2) & 1) != 0;
#pragma unroll
      for (int u = 0; u < 5; ++u) {
        const int c = t + 128 * u, e = c - 512;
        const bool is_a = c < 512;
        const int mt = min(mt_cta + (is_a ? c >> 6 : max(e, 0) >> 3), mt_last);
        const int second = is_a ? (c >> 5) & 1 : (e >> 2) & 1;
        const uint32_t stride = is_a ? 32u : 4u;
        const uint32_t st0 = min(2 * kt0 + second, steps - 1);
        const uint32_t word = (is_a ? (uint32_t)mt * steps * 32 + (c & 31) : (uint32_t)mt * steps * 4 + (e & 3)) +
                              st0 * stride;
        a_src[u] = reinterpret_cast<const unsigned char*>(is_a ? values + word
                                                              : reinterpret_cast<const uint4*>(meta) + word);
      }
      // Lane s < 4 holds the column word of group 4w + s of a step's k-tile, loaded three of this warpgroup's steps
      // ahead into one of three registers that the unrolled loop names statically (a register rotation would wait for
      // each load at once).
      auto column_word = [&](int ls) -> uint32_t {
        if (ls >= n_steps || lane >= 4) return 0u;
        const int kt = kt0 + (share ? ls : ls >> 1);
        const uint32_t* col = share || (ls & 1) == 0 ? col0 : col1;
        return col[min(kt * 16 + 4 * w + lane, groups - 1)];
      };
      // This warpgroup's next ring slot and its phase, kept as the steps go (STAGES is a multiple of P).
      int slot = (gs + p) % STAGES;
      uint32_t phase = ((gs + p) / STAGES) & 1;
      const int g_last = groups - 1, g_lane = kt0 * 16 + 4 * w;
      auto issue = [&](int ls, uint32_t cw) {
        const int i = share ? ls : ls >> 1;  // the unit's k-tile
        const uint32_t stage = base + slot * Cfg::STAGE;
        const long long wait_start = cycles.now();
        mbar_wait(empty + 8 * slot, phase ^ 1);
        cycles.add(kXcEmptyWait, wait_start);
        if (t == 0) cycles.stamp(stamps + slot);
#pragma unroll
        for (int s4 = 0; s4 < 4; ++s4) {
          const uint32_t word = __shfl_sync(0xffffffffu, cw, s4);
          const uint32_t column = (uint32_t)min(g_lane + i * 16 + s4, g_last) * M + ((word >> (8 * kept)) & 0xFFu);
          const unsigned char* src = mad_wide(column, ld_bytes, xt_lane);
#pragma unroll
          for (int q = 0; q < BLOCKS; ++q) cp_async_16_bytes(stage + dst_off[s4] + q * 8192, src + q * 128, bytes[q]);
        }
        // A step of one slab (its own columns) copies that slab's A fragments (u = 2 x slab, + 1) and metadata
        // (threads 32 x slab ..) only: the other consumer warpgroup skips the step.
        const int slab = share ? -1 : ls & 1;
        const bool last = i == k_tiles - 1, none_a = last && odd_a, none_e = last && odd_e;
        // a k-tile further: 2 k-steps x 32 16-byte words of A, x 4 of metadata
        const uint32_t off_a = none_a ? 0u : (uint32_t)i * 1024u, off_e = none_e ? 0u : (uint32_t)i * 128u;
#pragma unroll
        for (int u = 0; u < 5; ++u) {
          if (u == 4 && t >= 64) break;
          if (slab >= 0 && (u < 4 ? u >> 1 : t >> 5) != slab) continue;
          cp_async_16_bytes(stage + Cfg::A_OFF + (t + 128 * u) * 16, a_src[u] + (u < 4 ? off_a : off_e),
                            (u < 4 ? none_a : none_e) ? 0u : 16u);
        }
        if (t == 0) cp_async_16_bytes(info + slot * 16, &kXtShareWord[share ? 1 : 0], 16u);
        cp_async_arrive_noinc(full + 8 * slot);
        slot += P;
        if (slot >= STAGES) slot -= STAGES, phase ^= 1;
      };
      uint32_t cw0 = column_word(p), cw1 = column_word(p + P), cw2 = column_word(p + 2 * P);
      cycles.add(kXcSetUp, unit_start);
      for (int ls = p; ls < n_steps; ls += 3 * P) {
        issue(ls, cw0);
        cw0 = column_word(ls + 3 * P);
        if (ls + P < n_steps) {
          issue(ls + P, cw1);
          cw1 = column_word(ls + 4 * P);
        }
        if (ls + 2 * P < n_steps) {
          issue(ls + 2 * P, cw2);
          cw2 = column_word(ls + 5 * P);
        }
      }
      gs += n_steps;
    }
    cp_async_wait_all();
    cycles.add(kXcProducerTotal, start);
    cycles.store(p == 0 && t == 0, kXcProducerTotal, kXcConsumerTotal);
    return;
  }

  setmaxnreg_inc<Cfg::CONSUMER_REGS>();
  constexpr uint32_t kMetaPad = 0x44444444u;
  const int wq = warp & 3, g = lane >> 2, t4 = lane & 3;
  const int mt = wg * 4 + wq;
  float acc[BN / 2];
  XtCycles cycles;
  const long long start = cycles.now();
  int gs = 0;     // steps consumed so far, over all tiles
  int held = -1;  // the slot of this warpgroup's last step, released once its wgmmas are done
  auto compute = [&](int s, int kt) {
    const int slot = s % STAGES;
    const long long wait_start = cycles.now();
    mbar_wait(full + 8 * slot, (s / STAGES) & 1);
    cycles.add(kXcFullWait, wait_start);
    cycles.add_since_stamp(kXcStageFlight, stamps + slot);
    cycles.count(kXcSteps);
    fence_proxy_async();  // the stage was written by cp.async (generic proxy); the wgmmas read it (async proxy)
    const unsigned char* stage = smem + slot * Cfg::STAGE;
    uint4 a[2];
    uint32_t e[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      a[j] = *reinterpret_cast<const uint4*>(stage + Cfg::A_OFF + mt * 1024 + j * 512 + lane * 16);
      const uint32_t ev = *reinterpret_cast<const uint32_t*>(stage + Cfg::E_OFF + mt * 128 + j * 64 +
                                                             (g * 2 + (t4 & 1)) * 4);
      e[j] = 2 * kt + j < steps ? ev : kMetaPad;
    }
    const uint64_t desc = desc_mn128(base + slot * Cfg::STAGE, 8192);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 2; ++j) WgmmaSpT<BN, T>::run(acc, a[j], desc + j * (4096 >> 4), e[j]);
    wgmma_commit();
    wgmma_wait<1>();
    if (held >= 0 && lane == 0) mbar_arrive(empty + 8 * held);
    held = slot;
  };
  // The other slab's step (two slabs with their own columns): wait for it, so every phase of its barrier is waited
  // in order, and release it at once.
  auto pass = [&](int s) {
    const long long wait_start = cycles.now();
    mbar_wait(full + 8 * (s % STAGES), (s / STAGES) & 1);
    cycles.add(kXcFullWait, wait_start);
    if (lane == 0) mbar_arrive(empty + 8 * (s % STAGES));
  };
  for (int unit = blockIdx.x; unit < n_units; unit += gridDim.x) {
    const int tile = unit % n_tiles, split = unit / n_tiles, kt0 = split * kt_per_split;
    const int k_tiles = min(all_k_tiles, kt0 + kt_per_split) - kt0;
    const int cta_row0 = (tile % row_blocks) * 128, n_base = (tile / row_blocks) * BN;
#pragma unroll
    for (int j = 0; j < BN / 2; ++j) acc[j] = 0.f;
    cycles.count(kXcUnits);
    // The tile's first step is slab 0's first k-tile either way; its info slot says how the rest goes.
    const long long first_wait = cycles.now();
    mbar_wait(full + 8 * (gs % STAGES), (gs / STAGES) & 1);
    cycles.add(kXcFullWait, first_wait);
    const bool share = *reinterpret_cast<const uint32_t*>(smem + (info - base) + (gs % STAGES) * 16) != 0u;
    // Each path drains its wgmmas before the paths join (ptxas serializes wgmmas whose accumulators a join moves).
    if (share) {
      for (int kt = 0; kt < k_tiles; ++kt) compute(gs + kt, kt0 + kt);
      const long long drain_start = cycles.now();
      wgmma_wait<0>();
      cycles.add(kXcDrain, drain_start);
      gs += k_tiles;
    } else {
      for (int kt = 0; kt < k_tiles; ++kt) {
        if (wg == 1) pass(gs + 2 * kt);
        compute(gs + 2 * kt + wg, kt0 + kt);
        if (wg == 0) pass(gs + 2 * kt + 1);
      }
      const long long drain_start = cycles.now();
      wgmma_wait<0>();
      cycles.add(kXcDrain, drain_start);
      gs += 2 * k_tiles;
    }
    if (lane == 0) mbar_arrive(empty + 8 * held);
    held = -1;
#pragma unroll
    for (int j = 0; j < BN / 2; ++j) asm volatile("" : "+f"(acc[j])::"memory");  // reads after the wgmma wait
    if (splits > 1) {  // split-K: the last split of the tile to arrive adds every split's partial sums and stores
      const long long split_start = cycles.now();
      const SplitK<BN / 2, 256> sk(split_ws, split_counters, tile, split, splits, tid);
      sk.store(acc, 0);
      if (!sk.last([] { named_bar_sync(4, 256); })) {  // named barrier 4: both consumer warpgroups
        cycles.add(kXcSplit, split_start);
        continue;
      }
      sk.sum(acc, 0);
      cycles.add(kXcSplit, split_start);
    }
    const long long epilogue_start = cycles.now();
    if (wg * 4 < ((rows_padded - cta_row0) >> 4)) {
      const int row0 = cta_row0 + 64 * wg + 16 * wq;
      if (staged) {  // named barriers 2, 3: one per consumer warpgroup (1 and 5 are the producers', 4 the split sum's)
        // Y with an L2 evict-first policy: this kernel never reads it back, while the X^T rows it re-reads (every row
        // block of a token tile) and the next kernel's inputs keep their L2 lines (benchmarks/RESULTS.md, "evict-first
        // Y stores": faster at 768 -> 3072 and 1024 -> 4096, level at 4096 <-> 11008).
        store_tile_staged<T, BN, Cfg::EPI_N, Cfg::EPI_BUFS, true>(
            acc, row0, cta_row0 + 64 * wg, n_base, lane, wq, epi + wg * Cfg::EPI_BUFS * Cfg::EPI_CHUNK, 2 + wg, bias,
            rows, n_tokens, &y_map);
      } else {
        store_tile<T, BN>(acc, row0, n_base, lane, bias, y, rows, n_tokens);
      }
    }
    cycles.add(kXcEpilogue, epilogue_start);
  }
  if (staged && (tid & 127) == 0) bulk_wait_group<0>();  // the last stores have left shared memory
  cycles.add(kXcConsumerTotal, start);
  cycles.store(tid == 0, kXcConsumerTotal, kXtCounters);
  cycles.store(tid == 0, kXcUnits, kXcProducerTotal);
#elif defined(__CUDA_ARCH__)
  __trap();  // built without sm_90a: the host never launches this (spmm_sm90_available() is false)
#endif
}

// X^T's leading dimension: the tokens rounded up to 8 (16-byte rows).
inline int xt_ld(const SpmmArgs& a) { return (a.n_tokens + 7) / 8 * 8; }

template <typename T, int M, int BN, bool DEEP = false>
cudaError_t launch_xt(const SpmmArgs& a, const Sm90SplitPlan& plan, cudaStream_t stream) {
  constexpr auto kernel = spmm_vnm_sm90_xt_kernel<T, M, BN, DEEP>;
  using Cfg = XtCfg<M, BN, DEEP>;
  cudaError_t err = raise_smem_limit_once<kernel>(Cfg::SMEM);
  if (err != cudaSuccess) return err;
  const int ld = xt_ld(a);
  T* xt = static_cast<T*>(a.xt);
  const dim3 tgrid((a.k + 63) / 64, (ld + 63) / 64);
  if (tgrid.y > 65535) return cudaErrorInvalidConfiguration;
  transpose_tokens_kernel<T><<<tgrid, 256, 0, stream>>>(static_cast<const T*>(a.x), xt, a.n_tokens, a.k, ld);
  err = cudaGetLastError();  // the GEMM's own launch returns only its own error
  if (err != cudaSuccess) return err;
  int sms = 0;
  err = current_sm_count(&sms);
  if (err != cudaSuccess) return err;
  const int splits = a.split_ws != nullptr && a.split_counters != nullptr ? plan.splits : 1;  // see SpmmArgs
  CUtensorMap y_map{};
  const bool staged = encode_y_map(a, Cfg::EPI_N, &y_map);  // else the direct epilogue (rows % 8 != 0)
  // A programmatic dependent of the transpose: its CTAs' launch and set-up overlap the transpose's end (the producers
  // wait for the transpose's grid before their first copy of X^T).
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)std::min<long long>(plan.tiles * splits, sms));
  cfg.blockDim = dim3(Cfg::THREADS);
  cfg.dynamicSmemBytes = Cfg::SMEM;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<const T*>(xt), ld, static_cast<const uint4*>(a.values),
                            static_cast<const uint32_t*>(a.meta), reinterpret_cast<const uint32_t*>(a.columns),
                            static_cast<const T*>(a.bias), static_cast<T*>(a.y), a.n_tokens, a.rows, a.rows_padded,
                            a.k, a.steps, splits, a.split_ws, a.split_counters, y_map, staged);
}

template <typename T, int M>
cudaError_t dispatch_width(const SpmmArgs& a, const Sm90SplitPlan& plan, cudaStream_t stream) {
  if (plan.bn == kVnmXtFewBN) return launch_xt<T, M, kVnmXtFewBN>(a, plan, stream);
  if constexpr (M <= kVnmXtDeepRingMaxM) {  // the deeper ring is compiled only where it can be taken
    if (sm90_vnm_xt_deep_ring(M, plan.bn, a.n_tokens, a.v)) {
      if (plan.bn == kVnmXtBN) return launch_xt<T, M, kVnmXtBN, true>(a, plan, stream);
      return launch_xt<T, M, 128, true>(a, plan, stream);
    }
  }
  if (plan.bn == kVnmXtBN) return launch_xt<T, M, kVnmXtBN>(a, plan, stream);
  return launch_xt<T, M, 128>(a, plan, stream);
}

template <typename T>
cudaError_t dispatch_m(const SpmmArgs& a, const Sm90SplitPlan& plan, cudaStream_t stream) {
  return with_group_size<8>(a.m, [&](auto m) { return dispatch_width<T, decltype(m)::value>(a, plan, stream); });
}

}  // namespace

// The fp16 unit's entry points (spmm_vnm_xt_sm90_fp16.cu), called by the bf16 unit's host functions: the launch of
// dispatch_m<__half> and, in the timeline build, that unit's counters (read_and_clear_rows).
cudaError_t spmm_vnm_xt_sm90_fp16(const SpmmArgs& a, const Sm90SplitPlan& plan, cudaStream_t stream);
#if defined(HF_SPARSE_TIMELINE)
int spmm_vnm_xt_sm90_fp16_timeline(unsigned long long* host, int ctas);
#endif

}  // namespace hf_sparse
