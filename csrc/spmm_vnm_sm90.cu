// SpMM for V:2:M weights (M >= 8) on sm_90a with sparse wgmma: Y (N x R) = X (N x K) * W^T (+ bias), gathering the
// kept columns from row-major X. From 65 tokens and 1024 weight rows (tile_config.h sm90_vnm_xt) spmm_vnm_sm90 runs
// the X^T path instead (spmm_vnm_xt_sm90.cu: X transposed first, whole kept rows copied).
//
// Why: the mma.sp kernel (spmm.cu) is capped by warp-level mma.sp's peak and by its two 16-bit shared loads per B
// register; sparse wgmma has twice dense wgmma's peak, and at V:2:M it runs on the condensed columns only (4 of
// every M), i.e. half the MMAs of 2:4 at M = 8.
//
// Operands (as spmm_sm90.cu, which computes tiles of Y^T = W * X^T):
//  * A = 64 weight rows per warpgroup, straight from global memory into registers. The packed values / meta of a
//    V:2:M weight have exactly the 2:4 layout over the *condensed* columns (the 4 kept columns of each group of M,
//    per 64-row slab), so the fragments and metadata are the 2:4 kernel's.
//  * B = the condensed X tile of the warpgroup's slab in shared memory: token rows of 64 condensed k (16 groups x 4
//    kept columns, 128 bytes), 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r & 7)): group g of the
//    k-tile is the 8 bytes X[n, g*M + columns[slab, g, 0..3]] at chunk g/2, byte 8*(g&1).
// The gather (X is tokens x K row-major; TMA cannot gather 2-byte elements) runs in every thread, in registers, and
// each thread keeps one group of every k-tile, so its selection constants (byte-permute selectors, made from the 4
// packed uint8 offsets with a few integer ops) are computed once per k-tile and reused for all its tokens:
//  * M = 8 ("chunk" gather): a group is one aligned 16-byte chunk. Thread (group tid % 16, tokens tid / 16 + 16i)
//    loads it once for both slabs of the CTA (a warp reads 2 token rows x 256 contiguous bytes), then per slab and
//    output word 2 prmt (the word's columns lie in 3 of the chunk's 4 words) and one 8-byte shared store.
//  * M >= 16 ("word" gather): most of a group's chunks hold no kept column, so each lane owns one kept column (of
//    one slab) and loads the aligned 32-bit word holding it, for 32 tokens; a warp's load covers 4 groups of one
//    token row (1-8 cache lines, few L1 wavefronts), partner lanes pair their halves with one shuffle + prmt.
// Pipeline (128 weight rows = 2 slabs / 2 consumer warpgroups x BN tokens, 256 threads, two B buffers): per k-tile
// each thread first issues the loads of k-tile kt+2 (X) and kt+1 (A fragments, metadata), then the wgmmas of kt, then
// selects and stores k-tile kt+1 (loaded one iteration earlier) into the other buffer, waits for its wgmmas and
// publishes the stores with fence.proxy.async + one CTA barrier. Two register sets (named, loop unrolled by two) hold
// the X words of kt+1 and kt+2. Measured on the H200 (ncu, 64:2:8, 4096->11008, 8192 tokens): ~1660 cycles per
// k-tile against 256 for its wgmmas at the sparse peak, 6 cycles per issued instruction with 2 warps per scheduler,
// L2 52% and L1 59% busy: latency-bound. Loading X two k-tiles ahead is no faster than one, which fits the fence
// (MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC in SASS) waiting for the thread's in-flight loads; neither the staged pipeline
// nor L1 prefetches (below) help. At few tokens the same wait makes each CTA's time its number of k-tiles: split-K
// (tile_config.h) divides them, and the 16-token tiles hold few enough registers for three CTAs per SM.
// Tails: tokens past n_tokens read the last token's row (chunk) or are not loaded (word); their outputs are never
// stored. Groups past G (the padded groups up to 8*steps, whose A values are zero) read group G-1's columns, so
// nothing past K is ever read.
//
// Only the sm_90a pass compiles the body; other device passes get a trap and the host launches it only where
// spmm_sm90_available() (cc 9.0 and an sm_90a build).

#include "common.cuh"
#include "kernels.h"
#include "launch.h"
#include "tile_config.h"
#if defined(HF_SPARSE_LAB)
#include "lab.h"
#endif
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "sm90_common.cuh"
#include "wgmma_sp.cuh"
#if defined(HF_SPARSE_LAB)
#include "tma_sm90.cuh"  // mbarrier wrappers and setmaxnreg of the warp-specialised pipelines
#endif
#endif

namespace hf_sparse {
namespace {

constexpr int kVnmThreads = 256;  // two consumer warpgroups, which also gather
template <int M, int BN>
struct VnmCfg {
  static constexpr int B_BYTES = BN * 128;          // one slab's B tile: BN token rows x 64 condensed k
  static constexpr int STAGE = 2 * B_BYTES;         // both slabs
  static constexpr int SMEM = 2 * STAGE + 1024;     // two buffers + alignment slack for the swizzle atoms
  static_assert(B_BYTES % 1024 == 0, "B tiles must start on 1024-byte boundaries");
  static_assert(M == 8 || M == 16 || M == 32 || M == 64 || M == 128, "M must be 8..128");
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Registers of one k-tile's gather, loaded one k-tile before their shared stores.
template <int M, int BN, bool CHUNK = (M == 8)>
struct GatherRegs;
template <int M, int BN>
struct GatherRegs<M, BN, true> {
  uint4 x[BN / 16];  // group g's 16-byte chunk of each of my tokens
  uint32_t cw[2];    // the 4 offsets of group g, per slab (packed uint8)
};
template <int M, int BN>
struct GatherRegs<M, BN, false> {
  uint32_t w[BN / 2];  // the word holding my kept column, per token
  uint32_t sel;        // prmt selector pairing my half with my partner lane's (j ^ 1)
};
#endif

// Grid: (row tiles, token tiles, splits); split z of gridDim.z computes k-tiles [z * kt_per_split, (z + 1) *
// kt_per_split) of its tile (split-K, as spmm_sm90.cu's few-token tiles; tile_config.h).
template <typename T, int M, int BN, bool PF>
__global__ void __launch_bounds__(kVnmThreads, sm90_vnm_ctas_per_sm(M, BN))
spmm_vnm_sm90_kernel(const T* __restrict__ x, const uint4* __restrict__ values, const uint32_t* __restrict__ meta,
                     const uint32_t* __restrict__ columns, const T* __restrict__ bias, T* __restrict__ y,
                     int n_tokens, int rows, int rows_padded, int k, int steps, int kt_per_split,
                     float* __restrict__ split_ws, int* __restrict__ split_counters, bool shared_sum) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = VnmCfg<M, BN>;
  using Regs = GatherRegs<M, BN>;
  constexpr int ND = BN / 2;  // accumulators per thread
  constexpr bool CHUNK = M == 8;
  static_assert(CHUNK || BN == 16 || BN == 32 || BN == 64, "the word gather's lane roles cover 16, 32 or 64 tokens");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + pad_to_1024((uint32_t)__cvta_generic_to_shared(smem_raw));
  const uint32_t smem_u32 = (uint32_t)__cvta_generic_to_shared(smem);

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wq = warp & 3;
  const int g = lane >> 2, t = lane & 3;
  const int n_base = blockIdx.y * BN;
  const int cta_row0 = blockIdx.x * 128;
  const int mt_cta = cta_row0 >> 4;
  const int mt_valid = (rows_padded - cta_row0) >> 4;
  // This CTA's k-tiles (16 groups, 2 k-steps, each): kt0 .. kt0 + k_tiles - 1, local index kt from 0.
  const int kt0 = blockIdx.z * kt_per_split;
  const int k_tiles = min((steps + 1) >> 1, kt0 + kt_per_split) - kt0;
  const int groups = k / M, groups_padded = 8 * steps;
  const int slabs = rows_padded >> 6;
  const uint32_t* colp[2];
#pragma unroll
  for (int s = 0; s < 2; ++s) colp[s] = columns + (size_t)min((cta_row0 >> 6) + s, slabs - 1) * groups_padded;

  // Gather roles.
  //  chunk (M = 8): thread (gg = tid % 16, t0 = tid / 16) owns group gg of every k-tile, tokens t0 + 16i, both slabs;
  //    a warp reads 2 token rows x 16 consecutive 16-byte chunks. Its 8 bytes of token row r of a slab's tile sit at
  //    chunk (gg/2) ^ (r & 7), byte 8(gg & 1): the same offset + 2048i for every i.
  //  word (M >= 16): lane (q = lane / 8, slab sl = lane / 4 % 2, jj = lane % 4) of warp w owns kept column jj of
  //    slab sl in group gg = 4(w % 4) + q, tokens (BN/2)(w / 4) + i; a warp reads the 4 groups x 8 words of one token
  //    row (1-8 cache lines: few L1 wavefronts per load). Lanes jj and jj^1 pair their halves with one shuffle;
  //    lanes jj = 0, 2 store output words 0, 1 (4 bytes each).
  const int gg = CHUNK ? (tid & 15) : (4 * (warp & 3) + (lane >> 3));
  const int sl = (lane >> 2) & 1, jj = lane & 3;
  constexpr int TI = CHUNK ? BN / 16 : BN / 2;  // tokens per thread per k-tile
  const int tok0 = CHUNK ? (tid >> 4) : (BN / 2) * (warp >> 2);
  const T* rowp[CHUNK ? TI : 1];  // chunk: each token's row (rows past n_tokens read the last); word: the first's
#pragma unroll
  for (int i = 0; i < (CHUNK ? TI : 1); ++i)
    rowp[i] = x + (size_t)min(n_base + tok0 + 16 * i, n_tokens - 1) * k;
  const int last_tok = n_tokens - 1 - (n_base + tok0);  // word: tokens i > last_tok are not loaded (never stored)
  uint32_t st_off[CHUNK ? 1 : 8];
  if constexpr (CHUNK) {
    st_off[0] = tok0 * 128 + ((((uint32_t)gg >> 1) ^ (tok0 & 7)) << 4) + 8 * (gg & 1);
  } else {
#pragma unroll
    for (int r = 0; r < 8; ++r)  // token row tok0 + r (+ 8 * 128 per further 8 rows); slab sl's tile
      st_off[r] = sl * Cfg::B_BYTES + (tok0 + r) * 128 + ((((uint32_t)gg >> 1) ^ r) << 4) + 8 * (gg & 1) + 2 * jj;
  }

  auto group_of = [&](int kt) { return min((kt0 + kt) * 16 + gg, groups - 1); };  // clamped: never past K
  const uint32_t* colp_mine = sl ? colp[1] : colp[0];  // word mode: my slab's offsets (no dynamic array index)
  auto load_cw = [&](int kt) { return colp_mine[group_of(kt)]; };
  // Issue the global loads of k-tile kt (word mode: cw = its offsets, loaded one k-tile earlier).
  auto load_x = [&](int kt, uint32_t cw, Regs& r) {
    const int grp = group_of(kt);
    if constexpr (CHUNK) {
#pragma unroll
      for (int i = 0; i < TI; ++i) r.x[i] = *reinterpret_cast<const uint4*>(rowp[i] + grp * M);
#pragma unroll
      for (int s = 0; s < 2; ++s) r.cw[s] = colp[s][grp];
    } else {
      const uint32_t mine = cw >> (8 * jj), partner = cw >> (8 * (jj ^ 1));
      // bytes 2h, 2h+1 of my word (h: my column's half), then bytes 2h', 2h'+1 of the partner's
      r.sel = 0x5410u + (mine & 1u) * 0x22u + (partner & 1u) * 0x2200u;
      const T* p = rowp[0] + grp * M + (int)(mine & 0xFEu);
      if (last_tok >= TI - 1) {
#pragma unroll
        for (int i = 0; i < TI; ++i) r.w[i] = *reinterpret_cast<const uint32_t*>(p + (size_t)i * k);
      } else {
#pragma unroll
        for (int i = 0; i < TI; ++i)
          if (i <= last_tok) r.w[i] = *reinterpret_cast<const uint32_t*>(p + (size_t)i * k);
      }
    }
  };
  // Select the 4 kept halves of each group and store them into buffer `buf`'s B tiles (both slabs).
  // PF (lab build, vnm_pipe = 2): prefetch into L1 the lines the loads of the next step will read (X of
  // k-tile kt+3, A and metadata of kt+2, column offsets), so that the loads the fence waits for hit L1 instead of L2.
  // Measured 1.05-1.15x slower than without at 8192 tokens (the prefetch instructions cost more than they hide).
  auto prefetch_l1 = [&](const void* ptr) { asm volatile("prefetch.global.L1 [%0];\n" ::"l"(ptr)); };
  auto prefetch_x = [&](int kt) {
    const int grp = group_of(kt);
    if constexpr (CHUNK) {
#pragma unroll
      for (int i = 0; i < TI; ++i) prefetch_l1(rowp[i] + grp * M);
#pragma unroll
      for (int s = 0; s < 2; ++s) prefetch_l1(colp[s] + grp);
    } else {
      // The 8 lanes of a group (per token: its M/64 lines, or 1) share the prefetches of its TI tokens.
      constexpr int L = M >= 128 ? 2 : 1, PER = TI * L / 8;
#pragma unroll
      for (int u = 0; u < PER; ++u) {
        const int idx = 8 * u + (lane & 7), i = idx / L, l = idx % L;
        if (i <= last_tok) prefetch_l1(rowp[0] + (size_t)i * k + grp * M + l * 64);
      }
      prefetch_l1(colp_mine + group_of(kt + 1));
    }
  };
  auto store_b = [&](const Regs& r, int buf) {
    unsigned char* base = smem + buf * Cfg::STAGE;
    if constexpr (CHUNK) {
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const KeptOf8 kept(r.cw[s]);  // sm90_common.cuh
#pragma unroll
        for (int i = 0; i < TI; ++i)
          *reinterpret_cast<uint2*>(base + st_off[0] + s * Cfg::B_BYTES + i * 2048) = kept(r.x[i]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < TI; ++i) {
        const uint32_t other = __shfl_xor_sync(0xffffffffu, r.w[i], 1);
        const uint32_t o = __byte_perm(r.w[i], other, r.sel);
        if ((jj & 1) == 0) *reinterpret_cast<uint32_t*>(base + st_off[i & 7] + (i >> 3) * 1024) = o;
      }
    }
  };

  // A fragments and metadata of this warp (m16 tile wq of slab wg), from global memory; an inactive warpgroup (the
  // 64 padded rows past the packed weight) and the missing second k-step of an odd step count multiply zeros with
  // valid metadata (fetch_a_tile), never stored.
  const bool active = wg * 4 < mt_valid;
  const int mt = active ? wg * 4 + wq : 0;
  const uint4* ag = values + (size_t)(mt_cta + mt) * steps * 32 + lane;
  const uint32_t* eg = meta + (size_t)(mt_cta + mt) * steps * 16 + g * 2 + (t & 1);
  auto fetch_a = [&](int kt, uint4 (&a)[2], uint32_t (&e)[2]) {
    fetch_a_tile(ag, eg, active, kt0 + kt, steps, a, e);
  };

  float acc[ND];
#pragma unroll
  for (int j = 0; j < ND; ++j) acc[j] = 0.f;

  // Prologue: k-tile 0 stored into buffer 0, k-tile 1 loaded, the offsets of k-tile 2 loaded (word mode).
  Regs r0, r1;
  uint4 a0[2], a1[2];
  uint32_t e0[2], e1[2];
  fetch_a(0, a0, e0);
  uint32_t cw = CHUNK ? 0u : load_cw(0);
  load_x(0, cw, r0);
  if (!CHUNK) cw = load_cw(1);
  if (1 < k_tiles) load_x(1, cw, r1);
  if (!CHUNK) cw = load_cw(2);
  store_b(r0, 0);
  fence_proxy_async();
  __syncthreads();

  // K-tile kt (buffer buf = kt & 1, A set a/e, X of k-tile kt+1 in `cur`): first issue the loads of k-tile kt+2
  // (into `nxt`) and the A fragments of kt+1, so they land while this k-tile's wgmmas run and `cur` is selected and
  // stored into the other buffer; the fence.proxy.async that publishes the stores waits for this thread's
  // outstanding loads, so loads issued earlier than this iteration would not help.
  auto step = [&](int kt, int buf, const uint4 (&a)[2], const uint32_t (&e)[2], uint4 (&a_nx)[2],
                  uint32_t (&e_nx)[2], const Regs& cur, Regs& nxt) {
    if constexpr (PF) {
      if (kt + 3 < k_tiles) prefetch_x(kt + 3);
      if (kt + 2 < k_tiles && active) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          prefetch_l1(ag + (size_t)min(2 * (kt0 + kt + 2) + j, steps - 1) * 32);
          prefetch_l1(eg + (size_t)min(2 * (kt0 + kt + 2) + j, steps - 1) * 16);
        }
      }
    }
    if (kt + 2 < k_tiles) load_x(kt + 2, cw, nxt);
    if (!CHUNK) cw = load_cw(kt + 3);
    if (kt + 1 < k_tiles) fetch_a(kt + 1, a_nx, e_nx);
    const uint64_t desc = desc_k128(smem_u32 + buf * Cfg::STAGE + wg * Cfg::B_BYTES);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 2; ++j) WgmmaSp<BN, T>::run(acc, a[j], desc + j * (64 >> 4), e[j]);
    wgmma_commit();
    if (kt + 1 < k_tiles) store_b(cur, buf ^ 1);
    wgmma_wait<0>();
    fence_proxy_async();
    __syncthreads();
  };
  for (int kt = 0; kt < k_tiles; kt += 2) {
    step(kt, 0, a0, e0, a1, e1, r1, r0);
    if (kt + 1 < k_tiles) step(kt + 1, 1, a1, e1, a0, e0, r0, r1);
  }
#pragma unroll
  for (int j = 0; j < ND; ++j) asm volatile("" : "+f"(acc[j])::"memory");  // reads after the wgmma wait
  uint32_t mine = ~0u;  // the chunks of the tile this CTA stores (SplitK::sum_owned)
  if (gridDim.z > 1) {  // split-K: the last split of the tile to arrive, or each split its own chunks, sums and stores
    const auto split = SplitK<ND, kVnmThreads>::of_grid(split_ws, split_counters);
    split.store(acc, 0);
    if (!split.arrive(shared_sum, [] { __syncthreads(); })) return;
    if (shared_sum) {
      mine = split.sum_owned(acc, 0);
      split.leave();
    } else {
      split.sum(acc, 0);
    }
  }
  if (active) store_tile<T, BN>(acc, cta_row0 + 64 * wg + 16 * wq, n_base, lane, bias, y, rows, n_tokens, mine);
#elif defined(__CUDA_ARCH__)
  __trap();  // built without sm_90a: the host never launches this (spmm_sm90_available() is false)
#endif
}

#if defined(HF_SPARSE_LAB)
// Staged pipeline (lab build, vnm_pipe = 1): every global read goes through cp.async into a ring of S
// shared-memory stages (the X words / chunks each thread will select, in per-thread slots, plus the A fragments and
// metadata of the k-tile), and the column offsets of both slabs are copied into shared memory once.
// Why it was tried: if the fence.proxy.async of every k-tile (MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC in SASS) waits for
// the thread's in-flight loads, the register pipeline pays a full L2 round trip per k-tile, while cp.async copies
// are completed by cp.async.wait_group and S-1 k-tiles stay in flight. Measured 1.13-1.8x slower than the register
// pipeline: one more shared-memory write and read of every loaded X byte, on top of the B tile's store and the
// wgmmas' reads, costs more than it hides.
template <int M, int BN, int S>
struct VnmStagedCfg {
  static constexpr int TI = M == 8 ? BN / 16 : BN / 2;                    // tokens per thread per k-tile
  static constexpr int X_BYTES = TI * kVnmThreads * (M == 8 ? 16 : 4);    // slot (i, tid): 16-byte chunk / word
  static constexpr int A_BYTES = 2 * 8 * 512, E_BYTES = 2 * 8 * 64;       // 2 k-steps x 8 m16 tiles
  static constexpr int STAGE = X_BYTES + A_BYTES + E_BYTES;
  static constexpr int B_BYTES = BN * 128, B_STAGE = 2 * B_BYTES;         // both slabs' B tiles, two buffers
  static constexpr int COL_BYTES = 16 << 10;                              // up to 2048 padded groups, 2 slabs
  static constexpr int SMEM = 2 * B_STAGE + S * STAGE + COL_BYTES + 1024;
  static_assert(SMEM <= 227 * 1024, "over the sm_90 shared-memory limit");
  static_assert(B_STAGE % 1024 == 0 && STAGE % 16 == 0, "alignment of the B tiles and the stages");
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
// 4-byte global->shared copy; valid == false writes zeros (src must still be a mapped address).
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool valid) {
  const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 4 : 0));
}
#endif

template <typename T, int M, int BN, int S>
__global__ void __launch_bounds__(kVnmThreads, 1)
spmm_vnm_sm90_staged_kernel(const T* __restrict__ x, const uint4* __restrict__ values,
                            const uint32_t* __restrict__ meta, const uint32_t* __restrict__ columns,
                            const T* __restrict__ bias, T* __restrict__ y, int n_tokens, int rows, int rows_padded,
                            int k, int steps) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = VnmStagedCfg<M, BN, S>;
  constexpr int ND = BN / 2, TI = Cfg::TI;
  constexpr bool CHUNK = M == 8;
  static_assert(CHUNK || BN == 64, "the word gather's lane roles cover 64 tokens");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + pad_to_1024((uint32_t)__cvta_generic_to_shared(smem_raw));
  const uint32_t smem_u32 = (uint32_t)__cvta_generic_to_shared(smem);
  unsigned char* ring = smem + 2 * Cfg::B_STAGE;
  uint32_t* cols_s = reinterpret_cast<uint32_t*>(ring + S * Cfg::STAGE);

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wq = warp & 3;
  const int g = lane >> 2, t = lane & 3;
  const int n_base = blockIdx.y * BN;
  const int cta_row0 = blockIdx.x * 128;
  const int mt_cta = cta_row0 >> 4;
  const int mt_valid = (rows_padded - cta_row0) >> 4;
  const int k_tiles = (steps + 1) >> 1;
  const int groups = k / M, groups_padded = 8 * steps;
  const int slabs = rows_padded >> 6;

  // Column offsets of both slabs into shared memory (plain loads: once, before the pipeline starts).
  for (int i = tid; i < 2 * groups_padded; i += kVnmThreads) {
    const int s = i >= groups_padded;
    cols_s[i] = columns[(size_t)min((cta_row0 >> 6) + s, slabs - 1) * groups_padded + (i - s * groups_padded)];
  }

  // Gather roles: as the register kernel (chunk: group tid % 16, tokens tid / 16 + 16i; word: lane (q, sl, jj)).
  const int gg = CHUNK ? (tid & 15) : (4 * (warp & 3) + (lane >> 3));
  const int sl = (lane >> 2) & 1, jj = lane & 3;
  const int tok0 = CHUNK ? (tid >> 4) : 32 * (warp >> 2);
  const T* rowp[CHUNK ? TI : 1];
#pragma unroll
  for (int i = 0; i < (CHUNK ? TI : 1); ++i)
    rowp[i] = x + (size_t)min(n_base + tok0 + 16 * i, n_tokens - 1) * k;
  const int last_tok = n_tokens - 1 - (n_base + tok0);
  uint32_t st_off[CHUNK ? 1 : 8];
  if constexpr (CHUNK) {
    st_off[0] = tok0 * 128 + ((((uint32_t)gg >> 1) ^ (tok0 & 7)) << 4) + 8 * (gg & 1);
  } else {
#pragma unroll
    for (int r = 0; r < 8; ++r)
      st_off[r] = sl * Cfg::B_BYTES + (tok0 + r) * 128 + ((((uint32_t)gg >> 1) ^ r) << 4) + 8 * (gg & 1) + 2 * jj;
  }
  auto group_of = [&](int kt) { return min(kt * 16 + gg, groups - 1); };  // clamped: never past K
  constexpr uint32_t kMetaPad = 0x44444444u;
  const bool active = wg * 4 < mt_valid;
  const int mt_me = wg * 4 + wq;

  // cp.async copies of k-tile kt into ring slot kt % S: my X chunks / words, and a share of A and metadata.
  auto issue = [&](int kt) {
    unsigned char* st = ring + (kt % S) * Cfg::STAGE;
    const int grp = group_of(kt);
    if constexpr (CHUNK) {
#pragma unroll
      for (int i = 0; i < TI; ++i) cp_async_16(st + (i * kVnmThreads + tid) * 16, rowp[i] + grp * M, true);
    } else {
      const uint32_t cw = cols_s[sl * groups_padded + grp];
      const T* p = rowp[0] + grp * M + (int)((cw >> (8 * jj)) & 0xFEu);
      if (last_tok >= TI - 1) {  // all my tokens exist (every tile but the last)
#pragma unroll
        for (int i = 0; i < TI; ++i) cp_async_4(st + (i * kVnmThreads + tid) * 4, p + (size_t)i * k, true);
      } else {
#pragma unroll
        for (int i = 0; i < TI; ++i) {
          const bool ok = i <= last_tok;
          cp_async_4(st + (i * kVnmThreads + tid) * 4, ok ? p + (size_t)i * k : p, ok);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // A: 512 chunks (k-step j, m16 tile mt, lane)
      const int c = tid + i * kVnmThreads;
      const int j = c >> 8, mt = (c >> 5) & 7, s = 2 * kt + j;
      const bool ok = mt < mt_valid && s < steps;
      cp_async_16(st + Cfg::X_BYTES + c * 16, ok ? values + ((size_t)(mt_cta + mt) * steps + s) * 32 + (c & 31) : values,
                  ok);
    }
    if (tid < 64) {  // metadata: 64 chunks (k-step j, m16 tile mt, quarter)
      const int j = tid >> 5, mt = (tid >> 2) & 7, s = 2 * kt + j;
      const bool ok = mt < mt_valid && s < steps;
      cp_async_16(st + Cfg::X_BYTES + Cfg::A_BYTES + tid * 16,
                  ok ? meta + ((size_t)(mt_cta + mt) * steps + s) * 16 + (tid & 3) * 4 : meta, ok);
    }
  };
  // Select k-tile kt's kept halves from my ring slots and store them into B buffer buf.
  auto gather = [&](int kt, int buf) {
    const unsigned char* st = ring + (kt % S) * Cfg::STAGE;
    unsigned char* base = smem + buf * Cfg::B_STAGE;
    const int grp = group_of(kt);
    if constexpr (CHUNK) {
      const KeptOf8 kept[2] = {KeptOf8(cols_s[grp]), KeptOf8(cols_s[groups_padded + grp])};
#pragma unroll
      for (int i = 0; i < TI; ++i) {
        const uint4 v = reinterpret_cast<const uint4*>(st)[i * kVnmThreads + tid];
#pragma unroll
        for (int s = 0; s < 2; ++s)
          *reinterpret_cast<uint2*>(base + st_off[0] + s * Cfg::B_BYTES + i * 2048) = kept[s](v);
      }
    } else {
      const uint32_t cw = cols_s[sl * groups_padded + grp];
      const uint32_t mine = cw >> (8 * jj), partner = cw >> (8 * (jj ^ 1));
      const uint32_t sel = 0x5410u + (mine & 1u) * 0x22u + (partner & 1u) * 0x2200u;
#pragma unroll
      for (int i = 0; i < TI; ++i) {
        const uint32_t w = reinterpret_cast<const uint32_t*>(st)[i * kVnmThreads + tid];
        const uint32_t other = __shfl_xor_sync(0xffffffffu, w, 1);
        const uint32_t o = __byte_perm(w, other, sel);
        if ((jj & 1) == 0) *reinterpret_cast<uint32_t*>(base + st_off[i & 7] + (i >> 3) * 1024) = o;
      }
    }
  };

  float acc[ND];
#pragma unroll
  for (int j = 0; j < ND; ++j) acc[j] = 0.f;

  __syncthreads();  // the columns in shared memory
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < k_tiles) issue(st);
    cp_async_commit();
  }
  cp_async_wait<S - 2>();  // k-tile 0: my copies landed
  __syncthreads();         // everyone's (A and metadata are read by other threads)
  gather(0, 0);
  fence_proxy_async();
  __syncthreads();

  // K-tile kt: its A fragments and metadata from the ring, its wgmmas on B buffer kt & 1, the copies of k-tile
  // kt+S-1 into the slot k-tile kt-1 used, then k-tile kt+1 selected into the other B buffer; one fence + barrier.
  for (int kt = 0; kt < k_tiles; ++kt) {
    const unsigned char* st = ring + (kt % S) * Cfg::STAGE;
    uint4 a[2];
    uint32_t e[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      a[j] = reinterpret_cast<const uint4*>(st + Cfg::X_BYTES)[(j * 8 + mt_me) * 32 + lane];
      const uint32_t ev = reinterpret_cast<const uint32_t*>(st + Cfg::X_BYTES + Cfg::A_BYTES)[(j * 8 + mt_me) * 16 +
                                                                                             g * 2 + (t & 1)];
      e[j] = (active && 2 * kt + j < steps) ? ev : kMetaPad;
    }
    const int buf = kt & 1;
    const uint64_t desc = desc_k128(smem_u32 + buf * Cfg::B_STAGE + wg * Cfg::B_BYTES);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 2; ++j) WgmmaSp<BN, T>::run(acc, a[j], desc + j * (64 >> 4), e[j]);
    wgmma_commit();
    if (kt + S - 1 < k_tiles) issue(kt + S - 1);
    cp_async_commit();
    cp_async_wait<S - 2>();  // my copies of k-tile kt+1
    if (kt + 1 < k_tiles) gather(kt + 1, buf ^ 1);
    wgmma_wait<0>();
    fence_proxy_async();
    __syncthreads();
  }
  cp_async_wait<0>();
#pragma unroll
  for (int j = 0; j < ND; ++j) asm volatile("" : "+f"(acc[j])::"memory");  // reads after the wgmma wait
  if (active) store_tile<T, BN>(acc, cta_row0 + 64 * wg + 16 * wq, n_base, lane, bias, y, rows, n_tokens);
#elif defined(__CUDA_ARCH__)
  __trap();  // built without sm_90a: the host never launches this (spmm_sm90_available() is false)
#endif
}

// Warp-specialised pipeline (lab build, vnm_pipe = 3). The register pipeline above is latency-bound because the
// fence.proxy.async that publishes a k-tile's gathered stores (MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC in SASS, also for the
// sync_restrict form) waits for every load the thread has in flight, and every thread of the CTA both gathers and
// issues wgmmas. Here the roles are split: kWsProducers producer warpgroups gather X into a ring of S stages (both
// slabs' B tiles per stage, the register kernel's layout), taking the k-tiles in turn (producer p: k-tiles p,
// p + kWsProducers, ...), so each pays its fence once per own k-tile while the others' loads are in flight; two
// consumer warpgroups (slab 0, slab 1) only load their A fragments and metadata and issue sparse wgmmas. Stage s has
// a "full" mbarrier (the 128 threads of its producer arrive after their stores and fence) and an "empty" one (each of
// the 8 consumer warps arrives once its wgmmas on the stage are done). No split-K: launched at 64 and more tokens only.
constexpr int kWsProducers = 2;
constexpr int kWsThreads = 128 * (kWsProducers + 2);

// The shared-memory ring of the warp-specialised kernels: S stages of STAGE bytes (1024-aligned), then S "full"
// mbarriers (`full_count` producer threads arrive) and S "empty" ones (the 8 consumer warps arrive).
template <int S, int STAGE>
struct WsRing {
  static constexpr int BARS = S * STAGE;
  static constexpr int SMEM = BARS + 16 * S + 1024;  // + alignment slack for the swizzle atoms
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  unsigned char* smem;
  uint32_t smem_u32;
  __device__ __forceinline__ explicit WsRing(unsigned char* raw) {
    smem = raw + pad_to_1024((uint32_t)__cvta_generic_to_shared(raw));
    smem_u32 = (uint32_t)__cvta_generic_to_shared(smem);
  }
  __device__ __forceinline__ uint32_t full(int s) const { return smem_u32 + BARS + 8 * s; }
  __device__ __forceinline__ uint32_t empty(int s) const { return smem_u32 + BARS + 8 * (S + s); }
  __device__ __forceinline__ void init(int full_count) const {  // thread 0; a CTA barrier must follow
    for (int s = 0; s < S; ++s) {
      mbar_init(full(s), full_count);
      mbar_init(empty(s), 8);
    }
    mbar_fence_init();
  }
#endif
};

// SHARE (vnm_pipe = 4, M = 8): where the CTA's two slabs keep the same columns (every V:2:M weight with V = 128),
// checked by the CTA before its first k-tile, the producers gather one B tile for both and both consumers read it.
template <int M, int BN, int S>
struct VnmWsCfg {
  static constexpr int B_BYTES = BN * 128;  // one slab's B tile: BN token rows x 64 condensed k
  static constexpr int STAGE = 2 * B_BYTES;
  using Ring = WsRing<S, STAGE>;
  static constexpr int SMEM = Ring::SMEM;
  static_assert(S % kWsProducers == 0, "a stage is always filled by the same producer warpgroup");
  static_assert(SMEM <= 227 * 1024, "over the sm_90 shared-memory limit");
};

template <typename T, int M, int BN, int S, bool SHARE>
__global__ void __launch_bounds__(kWsThreads, 1)
spmm_vnm_sm90_ws_kernel(const T* __restrict__ x, const uint4* __restrict__ values, const uint32_t* __restrict__ meta,
                        const uint32_t* __restrict__ columns, const T* __restrict__ bias, T* __restrict__ y,
                        int n_tokens, int rows, int rows_padded, int k, int steps) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = VnmWsCfg<M, BN, S>;
  constexpr int ND = BN / 2;
  constexpr bool CHUNK = M == 8;
  static_assert(CHUNK || (BN == 64 && !SHARE), "the word gather's roles cover 64 tokens");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const typename Cfg::Ring ring(smem_raw);
  unsigned char* smem = ring.smem;
  const uint32_t smem_u32 = ring.smem_u32;
  auto full_bar = [&](int s) { return ring.full(s); };
  auto empty_bar = [&](int s) { return ring.empty(s); };

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
  const int n_base = blockIdx.y * BN;
  const int cta_row0 = blockIdx.x * 128;
  const int mt_cta = cta_row0 >> 4;
  const int mt_valid = (rows_padded - cta_row0) >> 4;
  const int k_tiles = (steps + 1) >> 1;
  const int groups = k / M, groups_padded = 8 * steps;
  const int slabs = rows_padded >> 6;
  const uint32_t* colp[2];
#pragma unroll
  for (int s = 0; s < 2; ++s) colp[s] = columns + (size_t)min((cta_row0 >> 6) + s, slabs - 1) * groups_padded;
  if (tid == 0) ring.init(128);
  bool share = false;
  if constexpr (SHARE) {
    // The columns are (slab, group) words: a CTA-wide compare of both slabs' words (an inactive second slab reads the
    // first one's: shared, and nothing of it is stored).
    int same = 1;
    for (int i = tid; i < groups_padded; i += kWsThreads) same &= colp[0][i] == colp[1][i];
    share = __syncthreads_and(same) != 0;
  } else {
    __syncthreads();
  }
  auto tile_of = [&](int s) { return share ? 0 : s; };  // B tile of slab s in a stage

  if (wg < kWsProducers) {
    // Producer warpgroup wg: k-tiles wg, wg + kWsProducers, ... Roles (ptid = thread index in the warpgroup):
    //  chunk (M = 8): group gg = ptid % 16 of every k-tile, tokens tok0 + 8i (tok0 = ptid / 16 < 8), both slabs; the
    //    8 bytes of token row r = tok0 + 8i sit at chunk (gg/2) ^ tok0, byte 8(gg & 1), + 1024i.
    //  word (M >= 16): lane (q = lane / 8, slab sl, jj) of warp w owns kept column jj of slab sl in group 4w + q,
    //    tokens 0..63; partner lanes pair their halves with one shuffle (as the register kernel).
    const int ptid = tid - 128 * wg, pwarp = ptid >> 5;
    const int gg = CHUNK ? (ptid & 15) : (4 * pwarp + (lane >> 3));
    const int sl = (lane >> 2) & 1, jj = lane & 3;
    constexpr int TI = CHUNK ? BN / 8 : BN;
    const int tok0 = CHUNK ? (ptid >> 4) : 0;
    const T* rowp[CHUNK ? TI : 1];
#pragma unroll
    for (int i = 0; i < (CHUNK ? TI : 1); ++i) rowp[i] = x + (size_t)min(n_base + tok0 + 8 * i, n_tokens - 1) * k;
    const int last_tok = n_tokens - 1 - n_base;  // word: tokens past it are not loaded (never stored)
    const uint32_t* colp_mine = sl ? colp[1] : colp[0];
    auto group_of = [&](int kt) { return min(kt * 16 + gg, groups - 1); };  // clamped: never past K
    uint4 xc[CHUNK ? TI : 1];
    uint32_t xw[CHUNK ? 1 : TI];
    uint32_t cw[2] = {0u, 0u};
    uint32_t cw_next = CHUNK ? 0u : (wg < k_tiles ? colp_mine[group_of(wg)] : 0u);
    for (int kt = wg; kt < k_tiles; kt += kWsProducers) {
      const int st = kt % S, use = kt / S;
      const int grp = group_of(kt);
      uint32_t sel = 0;
      if constexpr (CHUNK) {
#pragma unroll
        for (int i = 0; i < TI; ++i) xc[i] = *reinterpret_cast<const uint4*>(rowp[i] + grp * M);
        cw[0] = colp[0][grp];
        if (!SHARE || !share) cw[1] = colp[1][grp];
      } else {
        const uint32_t mine = cw_next >> (8 * jj), partner = cw_next >> (8 * (jj ^ 1));
        sel = 0x5410u + (mine & 1u) * 0x22u + (partner & 1u) * 0x2200u;
        // token i's word: one pointer stepped by a row (k / 2 words), not 64 precomputed 64-bit addresses
        const uint32_t* p = reinterpret_cast<const uint32_t*>(x + (size_t)min(n_base, n_tokens - 1) * k + grp * M +
                                                              (int)(mine & 0xFEu));
        const int row_words = k >> 1;
#pragma unroll
        for (int i = 0; i < TI; ++i, p += row_words)
          if (i <= last_tok) xw[i] = *p;
        if (kt + kWsProducers < k_tiles) cw_next = colp_mine[group_of(kt + kWsProducers)];  // with this k-tile's loads
      }
      mbar_wait(empty_bar(st), (use & 1) ^ 1);  // the consumers are done with the stage's previous fill
      unsigned char* base = smem + st * Cfg::STAGE;
      if constexpr (CHUNK) {
        const uint32_t off = tok0 * 128 + ((((uint32_t)gg >> 1) ^ tok0) << 4) + 8 * (gg & 1);
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          if (SHARE && share && s == 1) break;  // one B tile serves both slabs
          const KeptOf8 kept(cw[s]);
#pragma unroll
          for (int i = 0; i < TI; ++i)
            *reinterpret_cast<uint2*>(base + off + s * Cfg::B_BYTES + i * 1024) = kept(xc[i]);
        }
      } else {
#pragma unroll
        for (int i = 0; i < TI; ++i) {
          const uint32_t other = __shfl_xor_sync(0xffffffffu, xw[i], 1);
          const uint32_t o = __byte_perm(xw[i], other, sel);
          const int r = i & 7;
          const uint32_t off = sl * Cfg::B_BYTES + r * 128 + ((((uint32_t)gg >> 1) ^ r) << 4) + 8 * (gg & 1) + 2 * jj;
          if ((jj & 1) == 0) *reinterpret_cast<uint32_t*>(base + off + (i >> 3) * 1024) = o;
        }
      }
      fence_proxy_async();
      mbar_arrive(full_bar(st));
    }
    return;
  }

  // Consumer warpgroup c = slab c: A fragments and metadata of m16 tile wq from global memory (an inactive
  // warpgroup, past the packed rows, and the missing second k-step of an odd step count multiply zeros with valid
  // metadata: fetch_a_tile), wgmmas on the stage's B tile of its slab.
  const int c = wg - kWsProducers, wq = warp & 3;
  const bool active = c * 4 < mt_valid;
  const int mt = active ? c * 4 + wq : 0;
  const int g = lane >> 2, t = lane & 3;
  const uint4* ag = values + (size_t)(mt_cta + mt) * steps * 32 + lane;
  const uint32_t* eg = meta + (size_t)(mt_cta + mt) * steps * 16 + g * 2 + (t & 1);
  float acc[ND];
#pragma unroll
  for (int j = 0; j < ND; ++j) acc[j] = 0.f;
  auto step = [&](int kt, const uint4 (&a)[2], const uint32_t (&e)[2], uint4 (&a_nx)[2], uint32_t (&e_nx)[2]) {
    if (kt + 1 < k_tiles) fetch_a_tile(ag, eg, active, kt + 1, steps, a_nx, e_nx);
    const int st = kt % S;
    mbar_wait(full_bar(st), (kt / S) & 1);
    const uint64_t desc = desc_k128(smem_u32 + st * Cfg::STAGE + tile_of(c) * Cfg::B_BYTES);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 2; ++j) WgmmaSp<BN, T>::run(acc, a[j], desc + j * (64 >> 4), e[j]);
    wgmma_commit();
    wgmma_wait<0>();
    if (lane == 0) mbar_arrive(empty_bar(st));
  };
  uint4 a0[2], a1[2];
  uint32_t e0[2], e1[2];
  fetch_a_tile(ag, eg, active, 0, steps, a0, e0);
  for (int kt = 0; kt < k_tiles; kt += 2) {
    step(kt, a0, e0, a1, e1);
    if (kt + 1 < k_tiles) step(kt + 1, a1, e1, a0, e0);
  }
#pragma unroll
  for (int j = 0; j < ND; ++j) asm volatile("" : "+f"(acc[j])::"memory");  // reads after the wgmma wait
  if (active) store_tile<T, BN>(acc, cta_row0 + 64 * c + 16 * wq, n_base, lane, bias, y, rows, n_tokens);
#elif defined(__CUDA_ARCH__)
  __trap();  // built without sm_90a: the host never launches this (spmm_sm90_available() is false)
#endif
}

#endif  // HF_SPARSE_LAB

// The register pipeline's tile and split-K plan (tile_config.h sm90_vnm_plan; the lab's vnm_tile = 64 forces 64
// tokens per CTA above 64 tokens at M = 8). At few tokens a CTA waits about one L2/DRAM round trip per k-tile, so
// its time is its number of k-tiles, which the splits divide.
Sm90SplitPlan vnm_plan(const SpmmArgs& a, int sms) {
  const long long k_tiles = (a.steps + 1) / 2;
  Sm90SplitPlan p = sm90_vnm_plan(a.m, a.rows_padded, a.n_tokens, k_tiles, sms);
#if defined(HF_SPARSE_LAB)
  if (p.bn == 128 && lab::tuning().vnm_tile.load(std::memory_order_relaxed) == 64)
    p = sm90_split_plan(a.rows_padded, a.n_tokens, 64, k_tiles, sms, sm90_vnm_ctas_per_sm(a.m, 64), kVnmSplitMinKTiles);
  p.splits = lab::split_k_or(p.splits, p.tiles, k_tiles);
#endif
  return p;
}

// The lab pipelines that do not split K (staged, warp-specialised), whose kernels take the same arguments: one CTA
// per 128 rows x BN tokens.
template <typename T, int BN, auto Kernel>
cudaError_t launch_unsplit(const SpmmArgs& a, cudaStream_t stream, int threads, int smem) {
  cudaError_t err = raise_smem_limit_once<Kernel>(smem);
  if (err != cudaSuccess) return err;
  const dim3 grid((a.rows_padded + 127) / 128, (a.n_tokens + BN - 1) / BN);
  if (grid.y > 65535) return cudaErrorInvalidConfiguration;
  Kernel<<<grid, threads, smem, stream>>>(
      static_cast<const T*>(a.x), static_cast<const uint4*>(a.values), static_cast<const uint32_t*>(a.meta),
      reinterpret_cast<const uint32_t*>(a.columns), static_cast<const T*>(a.bias), static_cast<T*>(a.y), a.n_tokens,
      a.rows, a.rows_padded, a.k, a.steps);
  return cudaGetLastError();
}

template <typename T, int M, int BN, bool PF>
cudaError_t launch_vnm(const SpmmArgs& a, const SpmmPlan& plan, cudaStream_t stream) {
  using Cfg = VnmCfg<M, BN>;
  constexpr auto kernel = spmm_vnm_sm90_kernel<T, M, BN, PF>;
  cudaError_t err = raise_smem_limit_once<kernel>(Cfg::SMEM);
  if (err != cudaSuccess) return err;
  // Row blocks vary fastest: CTAs resident together share a token tile of X (read once from L2) and walk W.
  const int splits = a.split_ws != nullptr && a.split_counters != nullptr ? plan.split.splits : 1;  // see SpmmArgs
  const dim3 grid((a.rows_padded + 127) / 128, (a.n_tokens + BN - 1) / BN, splits);
  if (grid.y > 65535) return cudaErrorInvalidConfiguration;  // the binding slices larger inputs
  const int k_tiles = (a.steps + 1) / 2, kt_per_split = (k_tiles + splits - 1) / splits;
  bool shared_sum = false;
  err = split_sum_shared<kernel>(grid, kVnmThreads, Cfg::SMEM, sm90_vnm_ctas_per_sm(M, BN), &shared_sum);
  if (err != cudaSuccess) return err;
  kernel<<<grid, kVnmThreads, Cfg::SMEM, stream>>>(
      static_cast<const T*>(a.x), static_cast<const uint4*>(a.values), static_cast<const uint32_t*>(a.meta),
      reinterpret_cast<const uint32_t*>(a.columns), static_cast<const T*>(a.bias), static_cast<T*>(a.y), a.n_tokens,
      a.rows, a.rows_padded, a.k, a.steps, kt_per_split, a.split_ws, a.split_counters, shared_sum);
  return cudaGetLastError();
}

// Tokens per CTA: vnm_plan.
// Pipeline: X into registers one k-tile ahead. The lab build (HF_SPARSE_LAB) adds, by lab::tuning(), 64-token tiles
// at M = 8 above 64 tokens (vnm_tile = 64) and four pipelines (vnm_pipe): 1 staged (where the column offsets of the
// CTA's two slabs fit its 16 KB, i.e. K / M <= 2048; registers otherwise), 2 registers + L1 prefetch, 3
// warp-specialised (at 64 tokens and more), 4 = 3 with the slab-pair gather (M = 8); what they measured is in
// benchmarks/RESULTS.md. 256-row warp-specialised CTAs (four producer warpgroups) were slower than 3 and are not kept.
template <typename T, int M, int BN, int S>
cudaError_t launch_pipe(const SpmmArgs& a, const SpmmPlan& plan, cudaStream_t stream) {
#if defined(HF_SPARSE_LAB)
  const int pipe = lab::tuning().vnm_pipe.load(std::memory_order_relaxed);
  if (pipe == 1 && 2 * 8 * a.steps * 4 <= (16 << 10))
    return launch_unsplit<T, BN, spmm_vnm_sm90_staged_kernel<T, M, BN, S>>(a, stream, kVnmThreads,
                                                                           VnmStagedCfg<M, BN, S>::SMEM);
  if (pipe == 2) return launch_vnm<T, M, BN, true>(a, plan, stream);
  if (pipe == 4 && M == 8 && a.n_tokens >= 64)
    return launch_unsplit<T, BN, spmm_vnm_sm90_ws_kernel<T, M, BN, 4, M == 8>>(a, stream, kWsThreads,
                                                                             VnmWsCfg<M, BN, 4>::SMEM);
  if (pipe == 3 && a.n_tokens >= 64)
    return launch_unsplit<T, BN, spmm_vnm_sm90_ws_kernel<T, M, BN, 4, false>>(a, stream, kWsThreads,
                                                                            VnmWsCfg<M, BN, 4>::SMEM);
#endif
  return launch_vnm<T, M, BN, false>(a, plan, stream);
}

template <typename T, int M>
cudaError_t dispatch_tile(const SpmmArgs& a, const SpmmPlan& plan, cudaStream_t stream) {
  const int bn = plan.split.bn;
  if (bn == 16) return launch_vnm<T, M, 16, false>(a, plan, stream);  // the register pipeline only
  if (bn == 32) return launch_vnm<T, M, 32, false>(a, plan, stream);
  if constexpr (M == 8) {
    if (bn == 64) return launch_pipe<T, M, 64, 3>(a, plan, stream);  // 33-64 tokens; above, the lab's vnm_tile = 64
    return launch_pipe<T, M, 128, 3>(a, plan, stream);
  }
  return launch_pipe<T, M, 64, 4>(a, plan, stream);
}

template <typename T>
cudaError_t dispatch_m(const SpmmArgs& a, const SpmmPlan& plan, cudaStream_t stream) {
  return with_group_size<8>(a.m, [&](auto m) { return dispatch_tile<T, decltype(m)::value>(a, plan, stream); });
}

}  // namespace

cudaError_t spmm_vnm_sm90_plan(const SpmmArgs& a, SpmmPlan* plan) {
  *plan = SpmmPlan{};
  if (a.m < 8) return cudaErrorInvalidValue;
  if (a.n_tokens <= 0) return cudaSuccess;  // nothing to launch
  int sms = 0;
  const cudaError_t err = current_sm_count(&sms);
  if (err != cudaSuccess) return err;
  if (sm90_vnm_gemv(a.m, a.n_tokens, a.k, a.rows_padded, sms)) {
    plan->gemv = true;
    return cudaSuccess;
  }
  plan->xt = spmm_vnm_sm90_takes_xt(a);
  plan->split = plan->xt ? spmm_vnm_xt_sm90_split(a, sms) : vnm_plan(a, sms);
  plan->xt_elems = plan->xt ? spmm_vnm_xt_sm90_elems(a) : 0;
  return cudaSuccess;
}

cudaError_t spmm_vnm_sm90(const SpmmArgs& a, const SpmmPlan& plan, cudaStream_t stream) {
  if (a.m < 8) return cudaErrorInvalidValue;
  if (!spmm_sm90_available()) return cudaErrorNoKernelImageForDevice;
  if (a.n_tokens == 0) return cudaSuccess;
  if (plan.gemv) return spmv_vnm(a, stream);
  if (plan.split.tiles <= 0) return cudaErrorInvalidValue;  // not spmm_vnm_sm90_plan's plan of these arguments
  if (plan.xt) return spmm_vnm_xt_sm90(a, plan, stream);     // (which refuses a call without its X^T scratch)
  return a.is_bf16 ? dispatch_m<__nv_bfloat16>(a, plan, stream) : dispatch_m<__half>(a, plan, stream);
}

}  // namespace hf_sparse
