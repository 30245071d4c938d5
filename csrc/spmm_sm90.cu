// SpMM for plain 2:4 weights on sm_90a with sparse wgmma: Y (N x R) = X (N x K) * W^T (+ bias).
//
// Why a second SpMM: warp-level mma.sp peaks near 960 dense-equivalent TFLOP/s on an H200, so it cannot reach 1.3x
// of cuBLAS (which uses dense wgmma, ~700). Sparse wgmma (wgmma.mma_async.sp, m64nNk32) has twice dense wgmma's
// peak.
//
// Operands. wgmma takes the sparse operand as A, so the kernel computes tiles of Y^T = W * X^T:
//  * A = 64 weight rows per warpgroup, from registers. The packed layout of hf_sparse/ops/_layout.py is already
//    the register fragment of sparse wgmma: PTX ISA 9.7.15.6.2 gives each warp of the warpgroup 16 rows
//    (warp w % 4 -> rows 16w..16w+15) with the same per-warp fragment as mma.sp.m16n8k32 (.f16/.bf16: a0,a1 row g,
//    a2,a3 row g+8, a4..a7 the next 4-wide chunk), and its metadata figure for m64nNk32 .f16/.bf16 is the
//    mma.sp.m16n8k32 one (selector 0: lanes 4g and 4g+1 give rows g and g+8 over chunks 0-3 and 4-7). So the m16
//    tile 4*blk+w of `values`/`meta` is warp w's operand as it is: no new pack.
//  * B = X tile (BN tokens x 64 k) in shared memory, K-major as X is stored, 128-byte swizzle (16-byte chunk c of
//    token row r at chunk c ^ (r & 7)), copied by cp.async with zero-fill past K and past the last token;
//    a descriptor per k-step of 32 (start address + 64 bytes for the second).
// Kernels and configurations (numbered as in csrc/README.md; the product build compiles those marked *):
//  * spmm_sm90_kernel (configs 0-5, and the few-token tiles: 128 rows x 16* or 64* tokens at <= 64 tokens; the lab
//    forces a 128-token one up to 256):
//    all 256 threads copy X (and in some configs A and metadata) with cp.async into a ring of shared-memory
//    stages, both consumer warpgroups compute (rows 0-63 and 64-127) on the shared B tile. Config 4*: 128 x 256, 6
//    stages, A fragments and metadata from global memory straight into registers two k-tiles ahead (the fallback of
//    the TMA configurations where a tensor map cannot be made).
//  * spmm_sm90_tma_kernel (configs 6-12, lab build only): a producer warp streams the X tiles with TMA into a
//    full/empty-mbarrier ring; A from global memory as in config 4.
//  * spmm_sm90_tma_a_kernel (configs 13-35; 15*, 19*, 20*, 23*, 27*): the producer streams the A fragments and
//    metadata by TMA too, into the same ring stage as X; persistent CTAs (one per SM walking the output tiles); full
//    tiles take a check-free epilogue. 20* / 23* / 27* (128 x 256 / 128 / 192 tiles) add a staged epilogue
//    (stmatrix into a token-major shared buffer, TMA stores of Y overlapping the next tile's main loop); 15* / 19*
//    (256 / 128 tokens) take direct stores, where Y has no tensor map (rows % 8 != 0): 15 for 20, 19 for 23 and 27.
// Where the few-token tiles do not run (sm90_sparse24_plan in tile_config.h), the product runs 20, 27 or 23, split K
// where their tiles leave half the SMs idle (sm90_large_plan). The lab build (HF_SPARSE_LAB) adds every other
// configuration, run by number (launch_lab); what each measured is in benchmarks/RESULTS.md.
// Epilogue of configs 0-19: accumulators (row r, token n) are written straight to Y[n, r] (+ bias), as spmm.cu does.
//
// Only the sm_90a pass compiles the body (__CUDA_ARCH_FEAT_SM90_ALL); other device passes get a trap so a wrong
// build fails loudly, and the host only launches it on cc 9.0 when the build included sm_90a (HF_SPARSE_HAS_SM90A,
// set by hf_sparse/ops/_build.py).
#include <algorithm>
#include <atomic>

#include "common.cuh"
#include "kernels.h"
#include "launch.h"
#include "tensor_map.h"
#include "tile_config.h"
#if defined(HF_SPARSE_LAB)
#include "lab.h"
#endif
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "sm90_common.cuh"
#include "tma_sm90.cuh"
#include "wgmma_sp.cuh"
#endif

namespace hf_sparse {
namespace {

constexpr int kSm90Threads = 256;  // two consumer warpgroups

// Timeline build (nvcc -DHF_SPARSE_TIMELINE through HF_SPARSE_NVCC_FLAGS; benchmarks/timeline_spmm.py): one thread
// of each CTA stamps the global timer at the phases of its first work unit, so a call's time can be cut into launch,
// set-up, pipeline fill, main loop, split-K and epilogue. The product build compiles none of it.
enum TimelineMark { kTlEntry, kTlSetUp, kTlFirstIssued, kTlFirstReady, kTlLoopDone, kTlArrived, kTlSummed, kTlEnd,
                    kTlSm, kTlLast, kTimelineMarks };
#if defined(HF_SPARSE_TIMELINE)
constexpr int kTimelineCtas = 4096;
__device__ unsigned long long g_timeline[kTimelineCtas][kTimelineMarks];
#endif
__device__ __forceinline__ void timeline_mark(int mark, unsigned long long value = ~0ull) {
#if defined(HF_SPARSE_TIMELINE) && defined(__CUDA_ARCH__)
  const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (cta >= kTimelineCtas) return;
  if (value == ~0ull) asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(value));
  g_timeline[cta][mark] = value;
#endif
}
__device__ __forceinline__ void timeline_sm() {
#if defined(HF_SPARSE_TIMELINE) && defined(__CUDA_ARCH__)
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;\n" : "=r"(sm));
  timeline_mark(kTlSm, sm);
#endif
}

// CTA tile: 128*WGM weight rows (each warpgroup WGM m64 tiles) x BN tokens, STAGES pipeline stages, and INFLIGHT
// = 1 keeps one k-tile of wgmmas in flight while the next is issued (0: each iteration waits for its own).
// AREG = 1: each warp loads its A fragments and metadata straight from global memory into registers, two k-tiles
// ahead, instead of through the shared-memory stages (which then hold only X: less shared-memory traffic).
// MINB: CTAs per SM the registers must allow (__launch_bounds__), and the split-K plan counts on.
template <int BN_, int WGM_, int STAGES_, int INFLIGHT_, int AREG_ = 0, int MINB_ = 1>
struct Sm90Cfg {
  static constexpr int BN = BN_, WGM = WGM_, STAGES = STAGES_, INFLIGHT = INFLIGHT_, AREG = AREG_, MINB = MINB_;
  static_assert(!AREG || !INFLIGHT, "register-prefetched A relies on each k-tile's wgmmas finishing in its iteration");
  static constexpr int ROWS = 128 * WGM;
  static constexpr int MT = ROWS / 16;                  // m16 tiles per CTA
  static constexpr int B_BYTES = BN * 128;             // BN token rows x 64 k, bf16/fp16
  static constexpr int A_BYTES = AREG ? 0 : 2 * MT * 512;  // 2 k-steps x MT m16 tiles x 32 lanes x 16 B
  static constexpr int E_BYTES = AREG ? 0 : 2 * MT * 64;   // 2 k-steps x MT m16 tiles x 16 words
  static constexpr int STAGE = B_BYTES + A_BYTES + E_BYTES;
  static constexpr int SMEM = STAGES * STAGE + 1024;   // + alignment slack for the 1024-byte swizzle atoms
  static_assert(STAGE % 1024 == 0, "each stage's B tile must start on a 1024-byte boundary");
  static_assert(STAGES - 1 - INFLIGHT >= 1, "need at least one stage loading ahead");
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
// K-tiles 0..k_tiles-1 with the A fragments and metadata in three register sets used in rotation, fetched two
// k-tiles ahead: fetch(kt, a, e) fills a set; step(kt, a, e, a_next, e_next) computes k-tile kt from (a, e) and
// refills (a_next, e_next) for kt + 2, the set k-tile kt - 1 read (its wgmmas are done by then). The loop is unrolled
// by three so every set is a named register array (never indexed dynamically, which would spill it to local memory).
template <typename ASet, typename ESet, typename Fetch, typename Step>
__device__ __forceinline__ void k_tiles_with_register_rotation(int k_tiles, Fetch&& fetch, Step&& step) {
  ASet a0, a1, a2;
  ESet e0, e1, e2;
  fetch(0, a0, e0);
  fetch(1, a1, e1);
  for (int kt = 0; kt < k_tiles; kt += 3) {
    step(kt, a0, e0, a2, e2);
    if (kt + 1 < k_tiles) step(kt + 1, a1, e1, a0, e0);
    if (kt + 2 < k_tiles) step(kt + 2, a2, e2, a1, e1);
  }
}
#endif

// Grid: (row tiles, token tiles, splits), or (token tiles, row tiles, splits) where tokens_fastest. Split z of
// gridDim.z computes k-tiles [z * kt_per_split, (z + 1) * kt_per_split) of its tile (split-K, tile_config.h).
template <typename T, typename Cfg>
__global__ void __launch_bounds__(kSm90Threads, Cfg::MINB)
spmm_sm90_kernel(const T* __restrict__ x, const uint4* __restrict__ values, const uint32_t* __restrict__ meta,
                 const T* __restrict__ bias, T* __restrict__ y, int n_tokens, int rows, int rows_padded, int k,
                 int steps, int act, bool tokens_fastest, int kt_per_split, float* __restrict__ split_ws,
                 int* __restrict__ split_counters, bool shared_sum) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BN = Cfg::BN, WGM = Cfg::WGM, STAGES = Cfg::STAGES, INFLIGHT = Cfg::INFLIGHT;
  constexpr int THREADS = kSm90Threads, MT = Cfg::MT;
  constexpr int ND = BN / 2;                    // accumulators per thread per m64 tile
  constexpr int AHEAD = STAGES - 1 - INFLIGHT;  // k-tiles being copied while one is computed

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + pad_to_1024((uint32_t)__cvta_generic_to_shared(smem_raw));
  const uint32_t smem_u32 = (uint32_t)__cvta_generic_to_shared(smem);

  const int tid = threadIdx.x;
  if (tid == 0) {
    timeline_mark(kTlEntry);
    timeline_sm();
  }
  const int lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wq = warp & 3;  // warpgroup, warp within it
  const int g = lane >> 2, t = lane & 3;
  const int n_base = (tokens_fastest ? blockIdx.x : blockIdx.y) * BN;
  const int cta_row0 = (tokens_fastest ? blockIdx.y : blockIdx.x) * Cfg::ROWS;
  const int mt_cta = cta_row0 >> 4;
  const int mt_valid = (rows_padded - cta_row0) >> 4;  // m16 tiles of this CTA inside the packed weight
  // This CTA's k-tiles (2 k-steps, 64 columns of X, each): kt0 .. kt0 + k_tiles - 1, local index kt from 0.
  const int kt0 = blockIdx.z * kt_per_split;
  const int k_tiles = min((steps + 1) >> 1, kt0 + kt_per_split) - kt0;

  // Copy roles, fixed across stages. B: token row r = tid/8 + 32i, 16-byte chunk c = tid%8 (swizzled: r%8 is the
  // same for every i), by the first BN * 8 threads where that is fewer than all. A: 16-byte chunks (j, mt, lane).
  // Metadata: one 16-byte chunk (j, mt, quarter) per thread.
  constexpr int B_ITERS = BN * 8 >= THREADS ? BN * 8 / THREADS : 1;
  static_assert(BN * 8 % THREADS == 0 || THREADS % (BN * 8) == 0, "B chunks must split evenly over the threads");
  const bool b_thread = tid < BN * 8;
  const int b_r0 = tid >> 3, b_c = tid & 7;
  const T* b_src = x + (size_t)(n_base + b_r0) * k + b_c * 8;
  uint32_t b_tok_ok = 0;
#pragma unroll
  for (int i = 0; i < B_ITERS; ++i) b_tok_ok |= (uint32_t)(n_base + b_r0 + 32 * i < n_tokens) << i;
  const uint32_t b_dst = b_r0 * 128 + ((b_c ^ (b_r0 & 7)) << 4);

  constexpr int A_CHUNKS = 2 * MT * 32, A_ITERS = A_CHUNKS / THREADS;
  static_assert(A_CHUNKS % THREADS == 0, "A chunks must split evenly over the threads");
  const uint4* a_src[A_ITERS];
  bool a_ok[A_ITERS];
  int a_j[A_ITERS];
#pragma unroll
  for (int i = 0; i < A_ITERS; ++i) {
    const int chunk = tid + i * THREADS;
    const int j = chunk / (MT * 32), mt = (chunk / 32) % MT;
    a_j[i] = j;
    a_ok[i] = mt < mt_valid;
    a_src[i] = values + ((size_t)(mt_cta + (a_ok[i] ? mt : 0)) * steps + j) * 32 + (chunk & 31);
  }
  static_assert(2 * MT * 4 <= THREADS, "one metadata chunk per thread at most");
  const bool e_thread = tid < 2 * MT * 4;
  const int e_j = tid / (MT * 4), e_mt = (tid / 4) % MT, e_q = tid & 3;
  const bool e_ok = e_thread && e_mt < mt_valid;
  const uint32_t* e_src = meta + ((size_t)(mt_cta + (e_ok ? e_mt : 0)) * steps + e_j) * 16 + e_q * 4;

  auto load_stage = [&](int slot, int kt) {
    unsigned char* base = smem + slot * Cfg::STAGE;
    const int col = kt * 64 + b_c * 8;
    const bool col_ok = col < k;
    if (b_thread) {
#pragma unroll
      for (int i = 0; i < B_ITERS; ++i) {
        const bool ok = col_ok && ((b_tok_ok >> i) & 1u);
        cp_async_16(base + b_dst + i * 32 * 128, ok ? b_src + (size_t)i * 32 * k + kt * 64 : x, ok);
      }
    }
    if constexpr (!Cfg::AREG) {
      unsigned char* ad = base + Cfg::B_BYTES;
#pragma unroll
      for (int i = 0; i < A_ITERS; ++i) {
        const bool ok = a_ok[i] && 2 * kt + a_j[i] < steps;
        cp_async_16(ad + (tid + i * THREADS) * 16, ok ? a_src[i] + (size_t)kt * 64 : values, ok);
      }
      if (e_thread) {
        const bool ok = e_ok && 2 * kt + e_j < steps;
        cp_async_16(ad + Cfg::A_BYTES + tid * 16, ok ? e_src + (size_t)kt * 32 : meta, ok);
      }
    }
  };

  float acc[WGM][ND];
#pragma unroll
  for (int i = 0; i < WGM; ++i)
#pragma unroll
    for (int j = 0; j < ND; ++j) acc[i][j] = 0.f;

#pragma unroll
  for (int st = 0; st < AHEAD; ++st) {
    if (st < k_tiles) load_stage(st, kt0 + st);
    cp_async_commit();
  }

  // No branches around the wgmmas (ptxas serializes wgmmas across control flow): an inactive m64 tile (the 64
  // padded rows past the packed weight) and the missing second k-step of an odd step count multiply zeros
  // (zero-filled A) with valid metadata (positions 0 and 1), and their results are never stored.
  constexpr uint32_t kMetaPad = 0x44444444u;
  bool active[WGM];
#pragma unroll
  for (int i = 0; i < WGM; ++i) active[i] = (wg * WGM + i) * 4 < mt_valid;
  // One k-tile: wait for its stage, load this warp's A fragments and metadata into `a`/`e`, issue its wgmmas, start
  // the copy of the k-tile AHEAD stages on, and leave at most INFLIGHT wgmma groups unfinished. With INFLIGHT = 1
  // the previous k-tile's wgmmas still read their A and metadata registers during this one's loads (reading a
  // register an unfinished wgmma uses is undefined), so the loop is unrolled by two with separate register sets
  // for even and odd k-tiles.
  // Both k-steps of one k-tile for every m64 tile of this warpgroup, from the stage in `slot`, as one wgmma group.
  auto issue_wgmmas = [&](int slot, const uint4 (&a)[WGM][2], const uint32_t (&e)[WGM][2]) {
    const uint64_t desc = desc_k128(smem_u32 + slot * Cfg::STAGE);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int i = 0; i < WGM; ++i) WgmmaSp<BN, T>::run(acc[i], a[i][j], desc + j * (64 >> 4), e[i][j]);
    wgmma_commit();
  };
  auto k_tile = [&](int kt, uint4 (&a)[WGM][2], uint32_t (&e)[WGM][2]) {
    const int slot = kt % STAGES;
    cp_async_wait<AHEAD - 1>();
    fence_proxy_async();  // this thread's cp.async writes, visible to the async proxy (wgmma) after the barrier
    __syncthreads();
    if (kt == 0 && tid == 0) timeline_mark(kTlFirstReady);
    const unsigned char* base = smem + slot * Cfg::STAGE;
    const uint4* as = reinterpret_cast<const uint4*>(base + Cfg::B_BYTES);
    const uint32_t* es = reinterpret_cast<const uint32_t*>(base + Cfg::B_BYTES + Cfg::A_BYTES);
    const bool second = 2 * (kt0 + kt) + 1 < steps;
#pragma unroll
    for (int i = 0; i < WGM; ++i) {
      const int mt = (wg * WGM + i) * 4 + wq;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        a[i][j] = as[(j * MT + mt) * 32 + lane];
        const uint32_t ev = es[(j * MT + mt) * 16 + g * 2 + (t & 1)];
        e[i][j] = (active[i] && (j == 0 || second)) ? ev : kMetaPad;
      }
    }
    issue_wgmmas(slot, a, e);
    const int nxt = kt + AHEAD;  // its slot was read by k-tile kt - 1 - INFLIGHT, retired before the barrier
    if (nxt < k_tiles) load_stage(nxt % STAGES, kt0 + nxt);
    cp_async_commit();
    wgmma_wait<INFLIGHT>();
  };
  if constexpr (!Cfg::AREG) {
    uint4 a_even[WGM][2], a_odd[WGM][2];
    uint32_t e_even[WGM][2], e_odd[WGM][2];
    int kt = 0;
    for (; kt + 1 < k_tiles; kt += 2) {
      k_tile(kt, a_even, e_even);
      k_tile(kt + 1, a_odd, e_odd);
    }
    if (kt < k_tiles) k_tile(kt, a_even, e_even);
  } else {
    // A fragments and metadata from global memory (one coalesced 512-byte load per warp and k-step), fetched two
    // k-tiles ahead into three register sets used in rotation: the set being refilled was read by the previous
    // k-tile's wgmmas, which finished (wgmma.wait_group 0) before this k-tile started.
    const uint4* ag[WGM];
    const uint32_t* eg[WGM];
#pragma unroll
    for (int i = 0; i < WGM; ++i) {
      const int mt = active[i] ? (wg * WGM + i) * 4 + wq : 0;
      ag[i] = values + (size_t)(mt_cta + mt) * steps * 32 + lane;
      eg[i] = meta + (size_t)(mt_cta + mt) * steps * 16 + g * 2 + (t & 1);
    }
    auto fetch = [&](int kt, uint4 (&a)[WGM][2], uint32_t (&e)[WGM][2]) {
#pragma unroll
      for (int i = 0; i < WGM; ++i) fetch_a_tile(ag[i], eg[i], active[i], kt0 + kt, steps, a[i], e[i]);
    };
    auto k_tile_reg = [&](int kt, const uint4 (&a)[WGM][2], const uint32_t (&e)[WGM][2], uint4 (&a_next)[WGM][2],
                          uint32_t (&e_next)[WGM][2]) {
      const int slot = kt % STAGES;
      cp_async_wait<AHEAD - 1>();
      fence_proxy_async();
      __syncthreads();
      issue_wgmmas(slot, a, e);
      fetch(kt + 2, a_next, e_next);  // past this split's k-tiles: the next split's A, unused (within the weight)
      const int nxt = kt + AHEAD;
      if (nxt < k_tiles) load_stage(nxt % STAGES, kt0 + nxt);
      cp_async_commit();
      wgmma_wait<0>();
    };
    k_tiles_with_register_rotation<uint4[WGM][2], uint32_t[WGM][2]>(k_tiles, fetch, k_tile_reg);
  }
  wgmma_wait<0>();
  cp_async_wait<0>();
#pragma unroll
  for (int i = 0; i < WGM; ++i)
#pragma unroll
    for (int j = 0; j < ND; ++j) asm volatile("" : "+f"(acc[i][j])::"memory");  // reads after the wgmma wait

  if (tid == 0) timeline_mark(kTlLoopDone);
  // The shared sum where the launch says so, in the few-token tiles (the configuration-4 fallback, 256 tokens, runs
  // unsplit and keeps its registers without it).
  const bool shared = BN <= 128 && shared_sum;
  uint32_t mine[WGM];  // the chunks of each m64 tile this CTA stores (SplitK::sum_owned)
#pragma unroll
  for (int i = 0; i < WGM; ++i) mine[i] = ~0u;
  if (gridDim.z > 1) {  // split-K: the last split of the tile to arrive, or each split its own chunks, sums and stores
    const auto split = SplitK<WGM * ND, THREADS>::of_grid(split_ws, split_counters);
#pragma unroll
    for (int i = 0; i < WGM; ++i) split.store(acc[i], i * ND);
    const bool sums = split.arrive(shared, [] { __syncthreads(); });
    if (tid == 0) {
      timeline_mark(kTlArrived);
      timeline_mark(kTlLast, sums);
    }
    if (!sums) {
      if (tid == 0) timeline_mark(kTlEnd);
      return;
    }
    if (shared) {
#pragma unroll
      for (int i = 0; i < WGM; ++i) mine[i] = split.sum_owned(acc[i], i * ND);
      split.leave();
    } else {
#pragma unroll
      for (int i = 0; i < WGM; ++i) split.sum(acc[i], i * ND);
    }
    if (tid == 0) timeline_mark(kTlSummed);
  }

#pragma unroll
  for (int i = 0; i < WGM; ++i) {
    if (!active[i]) continue;
    const int row0 = cta_row0 + 64 * (wg * WGM + i) + 16 * wq;
    if (act == kActGelu) {
      store_tile<T, BN, kActGelu>(acc[i], row0, n_base, lane, bias, y, rows, n_tokens, mine[i]);
    } else {
      store_tile<T, BN>(acc[i], row0, n_base, lane, bias, y, rows, n_tokens, mine[i]);
    }
  }
  if (tid == 0) timeline_mark(kTlEnd);
#elif defined(__CUDA_ARCH__)
  __trap();  // built without sm_90a: the host never launches this (spmm_sm90_available() is false)
#endif
}

// splits > 1: split-K (a.split_ws / a.split_counters sized by SpmmPlan::split_floats; one split where they are null).
// tokens_fastest: token tiles vary fastest, so the CTAs of one row block run together and read its weight from DRAM
// once (few-token tiles); otherwise row blocks vary fastest: CTAs resident together share a token tile of X (read once
// from L2) and walk W.
template <typename T, typename Cfg>
cudaError_t launch_sm90(const SpmmArgs& a, cudaStream_t stream, int splits = 1, bool tokens_fastest = false) {
  constexpr auto kernel = spmm_sm90_kernel<T, Cfg>;
  cudaError_t err = raise_smem_limit_once<kernel>(Cfg::SMEM);
  if (err != cudaSuccess) return err;
  if (a.split_ws == nullptr || a.split_counters == nullptr) splits = 1;  // no scratch: see SpmmArgs
  const unsigned row_tiles = (a.rows_padded + Cfg::ROWS - 1) / Cfg::ROWS;
  const unsigned token_tiles = (a.n_tokens + Cfg::BN - 1) / Cfg::BN;
  const dim3 grid = tokens_fastest ? dim3(token_tiles, row_tiles, splits) : dim3(row_tiles, token_tiles, splits);
  if (grid.y > 65535) return cudaErrorInvalidConfiguration;  // the binding slices larger inputs
  if (splits > 1 && grid.x * grid.y > kSplitKCounters) return cudaErrorInvalidValue;
  const int k_tiles = (a.steps + 1) / 2, kt_per_split = (k_tiles + splits - 1) / splits;
  bool shared_sum = false;
  err = split_sum_shared<kernel>(grid, kSm90Threads, Cfg::SMEM, Cfg::MINB, &shared_sum);
  if (err != cudaSuccess) return err;
  kernel<<<grid, kSm90Threads, Cfg::SMEM, stream>>>(
      static_cast<const T*>(a.x), static_cast<const uint4*>(a.values), static_cast<const uint32_t*>(a.meta),
      static_cast<const T*>(a.bias), static_cast<T*>(a.y), a.n_tokens, a.rows, a.rows_padded, a.k, a.steps, a.act,
      tokens_fastest, kt_per_split, a.split_ws, a.split_counters, shared_sum);
  return cudaGetLastError();
}

// Warp-specialized variant (configs 6 and 7): 128 weight rows x BN tokens per CTA, 2 consumer warpgroups (warps
// 0-7, rows 0-63 and 64-127) and a producer warpgroup (warps 8-11) that gives its registers to the consumers
// (setmaxnreg: 9 warps would cap every thread at 168 registers, as ptxas splits the register file over 4
// sub-partitions; the consumers need ~190 without spilling). The producer's lane 0 of warp 8 streams the X tiles (BN tokens x
// 64 k, 128-byte swizzle, the layout desc_k128 describes) into a ring of STAGES stages with TMA, guarded by a "full"
// and an "empty" mbarrier per stage (tma_sm90.cuh); the consumers wait only on their stage's "full" barrier (no
// CTA-wide barrier in the main loop) and release it per warp once their wgmmas are done with it. A fragments and
// metadata come from global memory into registers, two k-tiles ahead in three rotating sets (as config 4).
// INFLIGHT = 1 leaves one k-tile of wgmmas running while the next is issued: the stage and the register set of k-tile
// kt - 1 are released / refilled only after wgmma.wait_group 1 in iteration kt.
// The token and K tails come from the tensor map's zero fill (rows past n_tokens, columns past k).
// CLUSTER = 2 (configs 8/9): the two CTAs of a cluster (adjacent 128-row blocks, same tokens) share the X tile: each
// producer loads half of it (BN/2 tokens) and multicasts it into both CTAs, so X crosses L2 once per 256 weight rows
// instead of once per 128. A stage is then refilled only after the consumer warps of both CTAs released it (each
// consumer warp arrives on the "empty" barrier of both), and both CTAs meet at a cluster barrier before exiting, so
// no remote arrive reaches a finished CTA.
constexpr int kTmaConsumerWarps = 8;
constexpr int kTmaThreads = 32 * (kTmaConsumerWarps + 4);

template <int BN, int STAGES>
struct TmaSmem {
  static constexpr int B_BYTES = BN * 128;  // one stage: BN token rows x 64 k (128 bytes), bf16/fp16
  static constexpr int BYTES = STAGES * B_BYTES + 2 * 8 * STAGES + 1024;  // + full/empty barriers + alignment slack
  static_assert(B_BYTES % 1024 == 0, "stages must start on 1024-byte boundaries (128-byte swizzle atoms)");
  static_assert(BN <= 256, "a TMA box holds at most 256 rows");
};

template <typename T, int BN, int STAGES, int INFLIGHT, int CLUSTER, int GROUP, bool SHARE>
__global__ void __launch_bounds__(kTmaThreads, 1)
spmm_sm90_tma_kernel(const __grid_constant__ CUtensorMap x_map, const uint4* __restrict__ values,
                     const uint32_t* __restrict__ meta, const T* __restrict__ bias, T* __restrict__ y, int n_tokens,
                     int rows, int rows_padded, int steps, int act) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int ND = BN / 2;
  constexpr int B_BYTES = TmaSmem<BN, STAGES>::B_BYTES;
  constexpr int kProducerRegs = 40, kConsumerRegs = 232;  // 128 x 40 + 256 x 232 <= 65536
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw_u32 = (uint32_t)__cvta_generic_to_shared(smem_raw);
  const uint32_t smem_u32 = raw_u32 + pad_to_1024(raw_u32);
  const uint32_t full_bar = smem_u32 + STAGES * B_BYTES, empty_bar = full_bar + 8 * STAGES;

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  static_assert(CLUSTER == 1 || GROUP == 1, "the grouped order would split a cluster's row-block pair");
  constexpr bool MCAST = CLUSTER > 1 && SHARE;  // false with CLUSTER 2: cluster launch and barriers only (config 12)
  int bx = blockIdx.x, by = blockIdx.y;
  if constexpr (GROUP > 1) {
    // Grouped order (configs 10/11): consecutive CTAs walk the row blocks of GROUP token tiles together, so the
    // CTAs resident at once touch ~132/GROUP row blocks of W and GROUP tiles of X instead of all of W (which does
    // not stay in L2 and is re-read from HBM for every token tile in the plain order).
    const int id = blockIdx.x + blockIdx.y * gridDim.x;
    const int per_group = GROUP * gridDim.x;
    const int first = id / per_group * GROUP;
    const int size = min((int)gridDim.y - first, GROUP);
    const int within = id % per_group;
    by = first + within % size;
    bx = within / size;
  }
  const int n_base = by * BN;
  const int cta_row0 = bx * 128;
  const int k_tiles = (steps + 1) >> 1;  // 2 k-steps (64 columns of X) per stage

  const uint32_t rank = CLUSTER > 1 ? cluster_cta_rank() : 0;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full_bar + 8 * s, 1);  // the producer's arrive.expect_tx (+ the TMA bytes)
      mbar_init(empty_bar + 8 * s, kTmaConsumerWarps * (MCAST ? CLUSTER : 1));  // per consumer warp (of the cluster)
    }
    mbar_fence_init();
  }
  // The only CTA-wide (cluster-wide) barrier before the epilogue: barriers initialised before anyone uses them.
  if constexpr (CLUSTER > 1) {
    cluster_sync();
  } else {
    __syncthreads();
  }

  if (warp >= kTmaConsumerWarps) {  // producer warpgroup: one thread issues every copy
    setmaxnreg_dec<kProducerRegs>();
    if (warp == kTmaConsumerWarps && lane == 0) {
      tma_prefetch_map(&x_map);
      for (int kt = 0; kt < k_tiles; ++kt) {
        const int slot = kt % STAGES;
        mbar_wait(empty_bar + 8 * slot, ((kt / STAGES) & 1) ^ 1);  // first pass: passes at once (fresh barrier)
        mbar_arrive_expect_tx(full_bar + 8 * slot, B_BYTES);       // the whole tile, both halves in a cluster
        if constexpr (MCAST) {
          constexpr int HALF = BN / CLUSTER;
          tma_load_2d_multicast(smem_u32 + slot * B_BYTES + rank * HALF * 128, &x_map, kt * 64, n_base + rank * HALF,
                                full_bar + 8 * slot, (uint16_t)((1u << CLUSTER) - 1));
        } else {
          tma_load_2d(smem_u32 + slot * B_BYTES, &x_map, kt * 64, n_base, full_bar + 8 * slot);
        }
      }
    }
    if constexpr (CLUSTER > 1) cluster_sync();  // stay until the peer is done arriving on this CTA's barriers
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  const int wg = warp >> 2, wq = warp & 3;
  const int g = lane >> 2, t = lane & 3;
  const int mt_cta = cta_row0 >> 4;
  const int mt_valid = (rows_padded - cta_row0) >> 4;
  // Inactive warpgroup (the 64 padded rows past the packed weight): zero A with valid metadata (fetch_a_tile), never stored; it
  // still waits and releases every stage, so the producer's empty-barrier counts stay right.
  const bool active = wg * 4 < mt_valid;
  const int mt = active ? wg * 4 + wq : 0;
  const uint4* ag = values + (size_t)(mt_cta + mt) * steps * 32 + lane;
  const uint32_t* eg = meta + (size_t)(mt_cta + mt) * steps * 16 + g * 2 + (t & 1);

  float acc[ND];
#pragma unroll
  for (int j = 0; j < ND; ++j) acc[j] = 0.f;

  auto fetch = [&](int kt, uint4 (&a)[2], uint32_t (&e)[2]) { fetch_a_tile(ag, eg, active, kt, steps, a, e); };
  // k-tile kt reads register set kt % 3 and refills set (kt + 2) % 3, last read by k-tile kt - 1.
  auto k_tile = [&](int kt, const uint4 (&a)[2], const uint32_t (&e)[2], uint4 (&a_next)[2], uint32_t (&e_next)[2]) {
    const int slot = kt % STAGES;
    mbar_wait(full_bar + 8 * slot, (kt / STAGES) & 1);
    const uint64_t desc = desc_k128(smem_u32 + slot * B_BYTES);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 2; ++j) WgmmaSp<BN, T>::run(acc, a[j], desc + j * (64 >> 4), e[j]);
    wgmma_commit();
    wgmma_wait<INFLIGHT>();  // k-tile kt - INFLIGHT is done with its stage and its registers
    if (INFLIGHT == 0 || kt > 0) {
      const int done = kt - INFLIGHT;
      if (lane == 0) mbar_arrive(empty_bar + 8 * (done % STAGES));
      if constexpr (MCAST) {
        if (lane == 1) mbar_arrive_peer<true>(empty_bar + 8 * (done % STAGES), rank ^ 1);
      }
    }
    fetch(kt + 2, a_next, e_next);
  };
  k_tiles_with_register_rotation<uint4[2], uint32_t[2]>(k_tiles, fetch, k_tile);
  wgmma_wait<0>();
#pragma unroll
  for (int j = 0; j < ND; ++j) asm volatile("" : "+f"(acc[j])::"memory");  // reads after the wgmma wait
  if (active && act == kActGelu) {
    store_tile<T, BN, kActGelu>(acc, cta_row0 + 64 * wg + 16 * wq, n_base, lane, bias, y, rows, n_tokens);
  } else if (active) {
    store_tile<T, BN>(acc, cta_row0 + 64 * wg + 16 * wq, n_base, lane, bias, y, rows, n_tokens);
  }
  if constexpr (CLUSTER > 1) cluster_sync();
#elif defined(__CUDA_ARCH__)
  __trap();  // built without sm_90a: the host never launches this (spmm_sm90_available() is false)
#endif
}

// Configs 13-16 (spmm_sm90_tma_a_kernel): what the ncu profile of configs 4 and 10 showed (benchmarks/RESULTS.md,
// "Profile"): the tensor pipe is busy 30-42% of the time and the top stall is "long scoreboard". In SASS every A
// fragment / metadata LDG of configs 4-12 sets the same scoreboard, and WARPGROUP.ARRIVE (wgmma.fence) before each
// k-tile's wgmmas waits on that scoreboard, i.e. on every LDG still in flight, including those just issued for the
// next k-tiles: the "two k-tiles ahead" prefetch is in effect at most one, and the L2 latency (~1000+ cycles under
// load) is paid per k-tile. Here the producer also streams the A fragments and metadata with TMA, into the same
// ring stage as the X tile (tensor maps over `values` and `meta` viewed as u32 matrices, one row per m16 tile), so
// they are prefetched STAGES - 1 k-tiles ahead like X; consumers read them from shared memory (ld.shared, ~30
// cycles) right before their wgmmas. One stage: X BN tokens x 64 k (BN = 256: 32 KB, 128-byte swizzle) + A 8 m16
// tiles x 2 k-steps x 512 B (8 KB) + metadata 8 x 2 x 64 B (1 KB); 5 stages (BN = 128, config 19: 8 stages).
// PERSIST = 1 (configs 15/16): one CTA per SM walks the output tiles (tile = blockIdx.x, + gridDim.x, ...). The ring
// runs on across tiles, so the producer loads the next tile's first stages while the consumers run the epilogue of
// the current one, and the CTA launch, barrier set-up and pipeline fill are paid once per SM instead of per tile.
// GROUP > 1 (14/16): grouped tile order as config 10 (GROUP token tiles walk the row blocks together).
// The token, K and row tails come from the tensor maps' zero fill; an inactive warpgroup (rows past the packed
// weight) or a missing second k-step (odd step count) multiplies zeros with valid metadata (kMetaPad) and is never
// stored.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Epilogue of a full m64 x BN accumulator tile (every row < rows, every token < n_tokens, rows even): the same
// lane-pair exchange and 32-bit stores of Y[n, r], r + 1 as store_tile, without its per-store bounds checks. The
// general store_tile compiles to ~3000 SASS instructions per warp for BN = 256 (bound predicates packed into
// registers, a branch per store), which the profile showed as the main cost of a tile at K = 768-1024; this is
// ~8 per pair of outputs.
template <typename T, int BN, int ACT = kActNone>
__device__ __forceinline__ void store_tile_full(const float (&acc)[BN / 2], int row0, int n_base, int lane,
                                                const T* __restrict__ bias, T* __restrict__ y, int rows) {
  const int g = lane >> 2, t = lane & 3;
  const bool odd = g & 1;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r_even = row0 + 8 * half + (g & ~1);
    float b0 = 0.f, b1 = 0.f;
    if (bias != nullptr) {
      b0 = MmaType<T>::to_float(bias[r_even]);
      b1 = MmaType<T>::to_float(bias[r_even + 1]);
    }
    T* dst = y + (size_t)(n_base + 2 * t + (odd ? 1 : 0)) * rows + r_even;
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
      const float v0 = acc[4 * nt + 2 * half], v1 = acc[4 * nt + 2 * half + 1];
      const float recv = __shfl_xor_sync(0xffffffffu, odd ? v0 : v1, 4);
      const float lo = odd ? recv : v0, hi = odd ? v1 : recv;
      *reinterpret_cast<uint32_t*>(dst + (size_t)nt * 8 * rows) =
          MmaType<T>::pack(MmaType<T>::from_float(activate<ACT>(lo + b0)),
                           MmaType<T>::from_float(activate<ACT>(hi + b1)));
    }
  }
}

// One sparse wgmma k-step over a BN-token B tile: the generated m64nBNk32 wrapper, or for BN = 192 (config 27, which
// wgmma_sp.cuh does not generate) an m64n128k32 on tokens 0-127 and an m64n64k32 on tokens 128-191 (16 KB further
// into the tile: whole 1024-byte swizzle atoms, so the same descriptor layout), with the same A fragment and metadata.
// The accumulator layout stays that of one m64nBN tile: d[4 nt + c] for token block nt.
template <int BN, typename T>
struct WgmmaSpTile {
  static __device__ __forceinline__ void run(float (&d)[BN / 2], const uint4& a, uint64_t desc, uint32_t e) {
    WgmmaSp<BN, T>::run(d, a, desc, e);
  }
};
template <typename T>
struct WgmmaSpTile<192, T> {
  static __device__ __forceinline__ void run(float (&d)[96], const uint4& a, uint64_t desc, uint32_t e) {
    WgmmaSp<128, T>::run(*reinterpret_cast<float(*)[64]>(&d[0]), a, desc, e);
    WgmmaSp<64, T>::run(*reinterpret_cast<float(*)[32]>(&d[64]), a, desc + ((128 * 128) >> 4), e);
  }
};

// Named barrier 1 between the two consumer warpgroups (256 threads): one side arrives, the other waits.
__device__ __forceinline__ void consumers_bar_arrive() { asm volatile("bar.arrive 1, 256;\n" ::: "memory"); }
__device__ __forceinline__ void consumers_bar_sync() { asm volatile("bar.sync 1, 256;\n" ::: "memory"); }
#endif

// Whether a configuration has the shared split-K sum compiled in (SplitK::meet): the 128-token persistent tiles only;
// in the 192- and 256-token ones its registers pushed spills into every call, split or not (benchmarks/RESULTS.md,
// "shared split-K sum"). The launcher asks it too, for the flag that turns the sum on.
template <int BN, int PERSIST, int CLUSTER>
__host__ __device__ constexpr bool has_shared_split_sum() {
  return PERSIST && CLUSTER == 1 && BN == 128;
}

// Without RUNBUF a tile's staged epilogue starts at buffer 0, so the buffers must split its chunks evenly.
constexpr bool epi_buffers_restart_ok(int bn, int epi_n, int bufs, bool runbuf) {
  return runbuf || epi_n == 0 || (bn / epi_n) % bufs == 0;
}

// EPI_N > 0 (configs 20-27): after the ring, a staging area of EPI_BUFS buffers per consumer warpgroup, each one
// chunk of the output tile (EPI_N tokens x the warpgroup's 64 rows, 128 bytes per token, 128-byte swizzle).
template <int BN, int STAGES, int EPI_N = 0, int EPI_BUFS = 0>
struct TmaASmem {
  static constexpr int X_BYTES = BN * 128;  // BN tokens x 64 k, bf16/fp16
  static constexpr int A_BYTES = 8 * 2 * 512;  // 8 m16 tiles x 2 k-steps x 32 lanes x 16 B
  static constexpr int E_BYTES = 8 * 2 * 64;   // 8 m16 tiles x 2 k-steps x 16 words
  static constexpr int STAGE = X_BYTES + A_BYTES + E_BYTES;
  static constexpr int EPI_CHUNK = EPI_N * 128;             // one staging buffer
  static constexpr int EPI_BYTES = 2 * EPI_BUFS * EPI_CHUNK;  // both consumer warpgroups
  static constexpr int BYTES = STAGES * STAGE + EPI_BYTES + 2 * 8 * STAGES + 1024;  // + barriers + alignment slack
  static_assert(STAGE % 1024 == 0, "each stage's X tile must start on a 1024-byte boundary (128-byte swizzle)");
  static_assert(EPI_CHUNK % 1024 == 0, "staging buffers must start on 1024-byte boundaries (128-byte swizzle)");
  static_assert(BYTES <= 227 * 1024, "more shared memory than an sm_90 CTA can have");
};

// Tile t of a row_blocks x token_tiles grid -> (row block, token tile): row blocks fastest, or in groups of GROUP
// token tiles that walk the row blocks together (config 10's order).
template <int GROUP>
__device__ __forceinline__ void tile_coords(int t, int row_blocks, int token_tiles, int& bx, int& by) {
  if constexpr (GROUP > 1) {
    const int per_group = GROUP * row_blocks;
    const int first = t / per_group * GROUP;
    const int size = min(token_tiles - first, GROUP);
    const int within = t % per_group;
    by = first + within % size;
    bx = within / size;
  } else {
    bx = t % row_blocks;
    by = t / row_blocks;
  }
}

template <typename T, int BN, int STAGES, int GROUP, int PERSIST, int SKEW, int EPI_N, int EPI_BUFS, bool EVICT_FIRST,
          int CLUSTER, bool XSHARE, bool TRIM, bool RUNBUF>
__global__ void __launch_bounds__(kTmaThreads, 1)
spmm_sm90_tma_a_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap x_tail_map,
                       const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap e_map,
                       const __grid_constant__ CUtensorMap y_map, const T* __restrict__ bias, T* __restrict__ y,
                       int n_tokens, int tail_tokens, int rows, int rows_padded, int steps, int act, int splits,
                       int kt_per_split, float* __restrict__ split_ws, int* __restrict__ split_counters,
                       int shared_sum) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int ND = BN / 2;
  using S = TmaASmem<BN, STAGES, EPI_N, EPI_BUFS>;
  constexpr int kProducerRegs = 40, kConsumerRegs = 232;
  constexpr uint32_t kMetaPad = 0x44444444u;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw_u32 = (uint32_t)__cvta_generic_to_shared(smem_raw);
  const uint32_t pad = pad_to_1024(raw_u32);
  const unsigned char* smem = smem_raw + pad;
  const uint32_t smem_u32 = raw_u32 + pad;
  const uint32_t epi_u32 = smem_u32 + STAGES * S::STAGE;  // staging buffers (EPI_N > 0), 1024-aligned
  const uint32_t full_bar = epi_u32 + S::EPI_BYTES, empty_bar = full_bar + 8 * STAGES;

  const int tid = threadIdx.x;
  if (tid == 0) {
    timeline_mark(kTlEntry);
    timeline_sm();
  }
  const int lane = tid & 31, warp = tid >> 5;
  const int k_tiles = (steps + 1) >> 1;
  const int row_blocks = (rows_padded + 127) / 128, token_tiles = (n_tokens + BN - 1) / BN;
  // CLUSTER = 2 (configs 28-30): a tile is CLUSTER adjacent row blocks x BN tokens, one row block per CTA of the
  // cluster (rank r: row block CLUSTER * unit + r); the cluster's CTAs walk the same tiles in the same order.
  // XSHARE = false (config 31, diagnostic): the same, but each CTA loads the whole X tile itself (no multicast); the
  // stages are still released to both CTAs, so the CTAs stay coupled as in 28.
  constexpr bool MC = CLUSTER > 1;
  const int row_units = (row_blocks + CLUSTER - 1) / CLUSTER;
  const int n_tiles = row_units * token_tiles;
  // Split-K (splits > 1, unclustered only): a work unit is split z of a tile, k-tiles [z * kt_per_split, ...) of it;
  // units walk the tiles fastest, so the splits of one tile run on different SMs at about the same time.
  const int n_units = n_tiles * splits;
  const uint32_t rank = MC ? cluster_cta_rank() : 0u;
  const int first_unit = blockIdx.x / CLUSTER, unit_step = PERSIST ? (int)gridDim.x / CLUSTER : n_units;
  constexpr bool kSharedSum = has_shared_split_sum<BN, PERSIST, CLUSTER>();

  // TRIM (configs 32/33): the fixed cost per launch, which is a third of the time at K = 1024 (benchmarks/RESULTS.md,
  // "Short-K"), gets two cuts: the tensor maps (Y's too) are prefetched before the barrier set-up, and at exit the
  // consumers wait only until the copy engine has read the last staging buffers, not until Y's writes are done (the
  // writes still land before the grid completes; CUTLASS's TMA-store epilogue ends the same way).
  if constexpr (TRIM) {
    if (tid == 32 * kTmaConsumerWarps) {
      tma_prefetch_map(&x_map);
      if (tail_tokens > 0) tma_prefetch_map(&x_tail_map);
      tma_prefetch_map(&a_map);
      tma_prefetch_map(&e_map);
      if constexpr (EPI_N > 0) tma_prefetch_map(&y_map);
    }
  }
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full_bar + 8 * s, 1);
      mbar_init(empty_bar + 8 * s, kTmaConsumerWarps * CLUSTER);  // consumer warps of every CTA of the cluster
    }
    mbar_fence_init();
  }
  // Barriers initialised before anyone uses them: in a cluster the peer's multicast and arrives too.
  if constexpr (MC) {
    cluster_sync();
  } else {
    __syncthreads();
  }
  if (tid == 0) timeline_mark(kTlSetUp);

  if (warp >= kTmaConsumerWarps) {  // producer warpgroup: one thread issues every copy, across all of its tiles
    setmaxnreg_dec<kProducerRegs>();
    if (warp == kTmaConsumerWarps && lane == 0) {
      if constexpr (!TRIM) {
        tma_prefetch_map(&x_map);
        if (tail_tokens > 0) tma_prefetch_map(&x_tail_map);
        tma_prefetch_map(&a_map);
        tma_prefetch_map(&e_map);
      }
      int it = 0;  // k-tiles issued so far (ring position and phase)
      for (int unit = first_unit; unit < n_units; unit += unit_step) {
        int bx, by;
        tile_coords<GROUP>(unit % n_tiles, row_units, token_tiles, bx, by);
        const int kt0 = unit / n_tiles * kt_per_split, kt_end = min(k_tiles, kt0 + kt_per_split);
        // A row block past the weight (odd row-block count in a cluster) loads row block 0's A: its warpgroups are
        // inactive (metadata kMetaPad, nothing stored), and no TMA box lies wholly outside the tensor.
        bx = bx * CLUSTER + (int)rank;
        const int a_row = (MC && bx >= row_blocks ? 0 : bx) * 8;
        // The last token tile, where it is partial (tail_tokens > 0, unclustered only): X comes in a box of just its
        // tokens, so the copy engine does not zero-fill the rest. The stage's rows past them keep what an earlier
        // k-tile left there; they reach only the accumulators of tokens past the last, which are never stored.
        const bool tail = !MC && tail_tokens > 0 && by == token_tiles - 1;
        const uint32_t stage_bytes = tail ? S::STAGE - (BN - tail_tokens) * 128 : S::STAGE;
        for (int kt = kt0; kt < kt_end; ++kt, ++it) {
          const int slot = it % STAGES;
          const uint32_t dst = smem_u32 + slot * S::STAGE, bar = full_bar + 8 * slot;
          // In a cluster this wait also covers the peer's consumers (they arrive here too): the multicast below
          // writes into the peer's stage.
          mbar_wait(empty_bar + 8 * slot, ((it / STAGES) & 1) ^ 1);
          mbar_arrive_expect_tx(bar, stage_bytes);  // the X tile (both halves in a cluster) + this CTA's A, meta
          if constexpr (MC && XSHARE) {
            constexpr int PART = BN / CLUSTER;  // tokens this CTA loads for the whole cluster
            tma_load_2d_multicast(dst + rank * PART * 128, &x_map, kt * 64, by * BN + (int)rank * PART, bar,
                                  (uint16_t)((1u << CLUSTER) - 1));
          } else {
            tma_load_2d(dst, tail ? &x_tail_map : &x_map, kt * 64, by * BN, bar);
          }
          tma_load_2d(dst + S::X_BYTES, &a_map, kt * 256, a_row, bar);  // 2 k-steps x 128 words, 8 m16 tiles
          tma_load_2d(dst + S::X_BYTES + S::A_BYTES, &e_map, kt * 32, a_row, bar);
          if (it == 0) timeline_mark(kTlFirstIssued);
        }
      }
    }
    if constexpr (MC) cluster_sync();  // stay until the peer has stopped writing into this CTA and arriving here
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  const int wg = warp >> 2, wq = warp & 3;
  const int g = lane >> 2, t = lane & 3;
  const int mt = wg * 4 + wq;  // this warp's m16 tile within the CTA's 8
  const int a_off = mt * 1024 + lane * 16, e_off = mt * 128 + (g * 2 + (t & 1)) * 4;

  // SKEW = 2 (configs 17/18, persistent): warpgroup 1 starts its first tile two k-tiles after warpgroup 0 and keeps
  // that distance, so each warpgroup's epilogue overlaps the other's last (or first) k-tiles of a tile instead of
  // both leaving the tensor pipe idle at once. The ring (5 stages) absorbs the distance.
  if (SKEW && wg == 1 && first_unit < n_units) consumers_bar_sync();
  float acc[ND];
  int it = 0;  // k-tiles consumed so far
  int chunks = 0;  // staged-epilogue chunks this warpgroup has stored (RUNBUF)
  // Releases the stage of k-tile `done` (ring position): this warp's arrive on this CTA's "empty" barrier and, in a
  // cluster, on the peer's (whose producer multicasts into this CTA's stage too).
  auto release = [&](int done) {
    const uint32_t bar = empty_bar + 8 * (done % STAGES);
    if (lane == 0) mbar_arrive(bar);
    if constexpr (MC) {
      if (lane == 1) mbar_arrive_peer<false>(bar, rank ^ 1u);
    }
  };
  for (int unit = first_unit; unit < n_units; unit += unit_step) {
    const int tile = unit % n_tiles, split = unit / n_tiles;
    int bx, by;
    tile_coords<GROUP>(tile, row_units, token_tiles, bx, by);
    bx = bx * CLUSTER + (int)rank;
    const int cta_row0 = bx * 128;
    const int kt0 = split * kt_per_split, unit_k_tiles = min(k_tiles, kt0 + kt_per_split) - kt0;
    const bool active = wg * 4 < ((rows_padded - cta_row0) >> 4);
#pragma unroll
    for (int j = 0; j < ND; ++j) acc[j] = 0.f;
    // One k-tile (the unit's i-th, k-tile kt0 + i of the weight): wait for its stage, read this warp's A fragments and
    // metadata from it into (a, e), issue its two wgmmas, and wait until only they are in flight: k-tile i - 1 is done
    // with its stage and its register set, so its stage goes back to the producer. Register sets alternate by k-tile
    // parity (unrolled by two below) because the wgmmas of i - 1 still read theirs while i's are loaded.
    auto k_tile = [&](int i, uint4 (&a)[2], uint32_t (&e)[2]) {
      const int slot = (it + i) % STAGES, kt = kt0 + i;
      mbar_wait(full_bar + 8 * slot, ((it + i) / STAGES) & 1);
      if (it + i == 0 && tid == 0) timeline_mark(kTlFirstReady);
      const unsigned char* st = smem + slot * S::STAGE;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        a[j] = *reinterpret_cast<const uint4*>(st + S::X_BYTES + a_off + j * 512);
        const uint32_t ev = *reinterpret_cast<const uint32_t*>(st + S::X_BYTES + S::A_BYTES + e_off + j * 64);
        e[j] = (active && 2 * kt + j < steps) ? ev : kMetaPad;
      }
      const uint64_t desc = desc_k128(smem_u32 + slot * S::STAGE);
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < 2; ++j) WgmmaSpTile<BN, T>::run(acc, a[j], desc + j * (64 >> 4), e[j]);
      wgmma_commit();
      wgmma_wait<1>();
      if (i > 0) release(it + i - 1);
    };
    uint4 a0[2], a1[2];
    uint32_t e0[2], e1[2];
    for (int i = 0; i < unit_k_tiles; i += 2) {
      k_tile(i, a0, e0);
      if (i + 1 < unit_k_tiles) k_tile(i + 1, a1, e1);
      if (SKEW && wg == 0 && i == 0 && unit == first_unit) consumers_bar_arrive();  // let warpgroup 1 start
    }
    wgmma_wait<0>();
    it += unit_k_tiles;
    release(it - 1);  // the last k-tile's stage
#pragma unroll
    for (int j = 0; j < ND; ++j) asm volatile("" : "+f"(acc[j])::"memory");  // reads after the wgmma wait
    const bool first = unit == first_unit;
    if (first && tid == 0) timeline_mark(kTlLoopDone);
    const int row0 = cta_row0 + 64 * wg + 16 * wq;
    bool direct = EPI_N == 0;  // this warp's rows stored straight from its accumulators (no staged epilogue)
    const bool full_tile = (by + 1) * BN <= n_tokens && cta_row0 + 128 <= rows && (rows & 1) == 0;
    if (kSharedSum && splits > 1 && shared_sum && full_tile) {
      // Shared split-K sum (one unit per CTA, at most one CTA per SM: every split of the tile is resident at once):
      // warp w's rows belong to split w * splits / 8, which adds them up from its own accumulators and every other
      // split's partial sums and stores them; the other splits write those rows' partial sums to the scratch. Each
      // split reads and stores 1 / splits of the tile instead of the last one reading all of it. Full tiles only:
      // their owners store with the check-free epilogue; a partial tile's checked one is thousands of instructions,
      // fetched cold when the call follows other work, and its tile goes the last-split way with the staged epilogue
      // (benchmarks/RESULTS.md, "shared split-K sum").
      const SplitK<ND, 32 * kTmaConsumerWarps> part(split_ws, split_counters, tile, split, splits, tid);
      const bool mine = warp * splits / kTmaConsumerWarps == split;
      if (!mine) part.store(acc, 0);
      part.meet([] { consumers_bar_sync(); });
      if (first && tid == 0) {
        timeline_mark(kTlArrived);
        timeline_mark(kTlLast, mine);  // thread 0's warp: the sum below is its own
      }
      if (mine) part.add_others(acc, 0);
      part.leave();
      if (!mine) continue;
      if (first && tid == 0) timeline_mark(kTlSummed);
      direct = true;
    } else if (splits > 1) {  // split-K: the last split of the tile to finish stores it, from every split's partials
      const SplitK<ND, 32 * kTmaConsumerWarps> part(split_ws, split_counters, tile, split, splits, tid);
      part.store(acc, 0);
      const bool last = part.last([] { consumers_bar_sync(); });
      if (first && tid == 0) {
        timeline_mark(kTlArrived);
        timeline_mark(kTlLast, last);
      }
      if (!last) continue;
      part.sum(acc, 0);
      if (first && tid == 0) timeline_mark(kTlSummed);
    }
    if constexpr (EPI_N > 0) {
      if (!direct) {
        if (active) {
          const uint32_t stage = epi_u32 + wg * EPI_BUFS * S::EPI_CHUNK;
          if (act == kActGelu) {
            store_tile_staged<T, BN, EPI_N, EPI_BUFS, EVICT_FIRST, kActGelu>(
                acc, row0, cta_row0 + 64 * wg, by * BN, lane, wq, stage, 2 + wg, bias, rows, n_tokens, &y_map,
                RUNBUF ? chunks : -1);
          } else {
            store_tile_staged<T, BN, EPI_N, EPI_BUFS, EVICT_FIRST>(acc, row0, cta_row0 + 64 * wg, by * BN, lane, wq,
                                                                   stage, 2 + wg, bias, rows, n_tokens, &y_map,
                                                                   RUNBUF ? chunks : -1);
          }
          chunks += BN / EPI_N;  // one bulk group per chunk, committed in this order (the rotation's invariant)
        }
        continue;
      }
    }
    if (full_tile) {
      if (act == kActGelu) {
        store_tile_full<T, BN, kActGelu>(acc, row0, by * BN, lane, bias, y, rows);
      } else {
        store_tile_full<T, BN>(acc, row0, by * BN, lane, bias, y, rows);
      }
    } else if (active) {
      if (act == kActGelu) {
        store_tile<T, BN, kActGelu>(acc, row0, by * BN, lane, bias, y, rows, n_tokens);
      } else {
        store_tile<T, BN>(acc, row0, by * BN, lane, bias, y, rows, n_tokens);
      }
    }
  }
  // The staging buffers must stay valid until the copy engine has read them, and the writes be done before exit.
  if constexpr (EPI_N > 0) {
    if ((tid & 127) == 0) {
      if constexpr (TRIM) {
        bulk_wait_group_read<0>();
      } else {
        bulk_wait_group<0>();
      }
    }
  }
  if constexpr (MC) cluster_sync();  // no CTA of the cluster exits while the other may still arrive on its barriers
  if (tid == 0) timeline_mark(kTlEnd);
#elif defined(__CUDA_ARCH__)
  __trap();  // built without sm_90a: the host never launches this (spmm_sm90_available() is false)
#endif
}

// Tensor map of X (n_tokens x k, row-major) in boxes of 64 k x box_rows tokens, 128-byte swizzle, zero fill out of
// bounds. False where TMA cannot address X (alignment, stride) or the driver refuses: the caller falls back.
bool encode_x_map(const SpmmArgs& a, int box_rows, CUtensorMap* map) {
  if (reinterpret_cast<uintptr_t>(a.x) % 16 != 0 || a.k % 8 != 0) return false;  // 16-byte base and row stride
  PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {(cuuint64_t)a.k, (cuuint64_t)a.n_tokens};
  const cuuint64_t strides[1] = {(cuuint64_t)a.k * 2};  // bytes between token rows
  const cuuint32_t box[2] = {64, (cuuint32_t)box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult res =
      encode(map, a.is_bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
             const_cast<void*>(a.x), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS;
}

// Launch configuration of kTmaThreads-thread CTAs in clusters of `cluster` CTAs along x; `attr` (one entry) holds the
// cluster attribute and must live until the launch. Only the lab build's cluster configurations call it.
[[maybe_unused]] inline cudaLaunchConfig_t cluster_launch(dim3 grid, int smem, cudaStream_t stream, int cluster,
                                                          cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kTmaThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

template <typename T, int BN, int STAGES, int INFLIGHT, int CLUSTER = 1, int GROUP = 1, bool SHARE = true>
cudaError_t launch_sm90_tma(const SpmmArgs& a, cudaStream_t stream) {
  CUtensorMap map;
  if (!encode_x_map(a, SHARE ? BN / CLUSTER : BN, &map)) return launch_sm90<T, Sm90Cfg<256, 1, 6, 0, 1>>(a, stream);  // config 4
  constexpr auto kernel = spmm_sm90_tma_kernel<T, BN, STAGES, INFLIGHT, CLUSTER, GROUP, SHARE>;
  constexpr int smem = TmaSmem<BN, STAGES>::BYTES;
  cudaError_t err = raise_smem_limit_once<kernel>(smem);
  if (err != cudaSuccess) return err;
  int row_blocks = (a.rows_padded + 127) / 128;
  row_blocks = (row_blocks + CLUSTER - 1) / CLUSTER * CLUSTER;  // whole clusters; extra blocks have no rows
  const dim3 grid(row_blocks, (a.n_tokens + BN - 1) / BN);
  if (grid.y > 65535) return cudaErrorInvalidConfiguration;
  cudaLaunchAttribute attr[1];
  const cudaLaunchConfig_t cfg = cluster_launch(grid, smem, stream, CLUSTER, attr);
  return cudaLaunchKernelEx(&cfg, kernel, map, static_cast<const uint4*>(a.values),
                            static_cast<const uint32_t*>(a.meta), static_cast<const T*>(a.bias), static_cast<T*>(a.y),
                            a.n_tokens, a.rows, a.rows_padded, a.steps, a.act);
}

// Tensor map of a packed operand (values or metadata) viewed as a u32 matrix with one row per m16 tile
// (row_words u32 each), boxes of box_words x 8 rows, no swizzle, zero fill past the last row or word.
bool encode_u32_rows_map(const void* base, int row_words, int n_rows, int box_words, CUtensorMap* map) {
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0 || (row_words * 4) % 16 != 0) return false;
  PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {(cuuint64_t)row_words, (cuuint64_t)n_rows};
  const cuuint64_t strides[1] = {(cuuint64_t)row_words * 4};
  const cuuint32_t box[2] = {(cuuint32_t)box_words, 8};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult res = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT32, 2, const_cast<void*>(base), dims, strides, box,
                              elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS;
}

// The few-token tiles (tile_config.h sm90_small_bn): 128 rows x BN tokens, A and metadata through the cp.async
// stages, two CTAs per SM (126 registers at 128 tokens, no spills: two CTAs overlap each other's memory waits),
// more stages at 16 tokens (a smaller X tile).
template <int BN>
using SmallCfg = Sm90Cfg<BN, 1, BN == 16 ? 6 : 4, 0, 0, kSm90SmallCtasPerSm>;
// A call's plan (kernels.h SpmmPlan), made once for the split-K scratch the binding allocates and the launch:
// tile_config.h sm90_sparse24_plan (the few-token tiles or a persistent configuration, with its split). In the lab
// build the small_tiles knob forces the few-token tiles up to 256 tokens, or never, and the split_k knob the split.
SpmmPlan plan_call(const SpmmArgs& a, int sms) {
  const long long k_tiles = (a.steps + 1) / 2;
  Sm90Sparse24Plan q = sm90_sparse24_plan(a.rows_padded, a.n_tokens, k_tiles, sms);
#if defined(HF_SPARSE_LAB)
  const int forced = lab::tuning().small_tiles.load(std::memory_order_relaxed);
  if (forced >= 0 && (forced == 1 && a.n_tokens <= 256) != q.few_token) {
    if (q.few_token) {
      const Sm90LargePlan large = sm90_large_plan(a.rows_padded, a.n_tokens, k_tiles, sms);
      q = {false, large.config, large.split};
    } else {
      q = {true, 0, sm90_small_plan(a.rows_padded, a.n_tokens, k_tiles, sms)};
    }
  }
  q.split.splits = lab::split_k_or(q.split.splits, q.split.tiles, k_tiles);
#endif
  SpmmPlan p;
  p.few_token = q.few_token;
  p.config = q.config;
  p.split = q.split;
  return p;
}


// Configs 13-27; fall back to config 4 where a tensor map of X or the weight cannot be made (as launch_sm90_tma
// does), and the staged-epilogue configs (EPI_N > 0) to config 15 (19 for 128- or 192-token tiles) where Y's cannot.
// splits > 1: split-K over the 128 x BN tiles (a.split_ws / a.split_counters sized for them by SpmmPlan::split_floats;
// one split where they are null, and in the clustered or skewed lab configurations); the fallbacks split only where
// their tiles are the same (15 for 20), and run unsplit otherwise.
template <typename T, int BN, int STAGES, int GROUP, int PERSIST, int SKEW = 0, int EPI_N = 0, int EPI_BUFS = 0,
          bool EVICT_FIRST = false, int CLUSTER = 1, bool XSHARE = true, bool TRIM = false, bool RUNBUF = false>
cudaError_t launch_sm90_tma_a(const SpmmArgs& a, cudaStream_t stream, int splits = 1) {
  static_assert(CLUSTER == 1 || (PERSIST && !SKEW && GROUP == 1), "clusters: persistent, plain tile order only");
  static_assert(epi_buffers_restart_ok(BN, EPI_N, EPI_BUFS, RUNBUF), "every tile starts at buffer 0");
  CUtensorMap x_map, x_tail_map, a_map, e_map, y_map;
  const int mts = a.rows_padded / 16;
  // The last token tile's own X map where it is partial (see the kernel's producer): a full box there is zero-filled
  // past the last token, which measured as slow as loading real tokens (benchmarks/RESULTS.md, "tail map").
  int tail_tokens = CLUSTER == 1 ? a.n_tokens % BN : 0;
  if (tail_tokens > 0 && !encode_x_map(a, tail_tokens, &x_tail_map)) tail_tokens = 0;
  if (!encode_x_map(a, XSHARE ? BN / CLUSTER : BN, &x_map) || !encode_u32_rows_map(a.values, a.steps * 128, mts, 256, &a_map) ||
      !encode_u32_rows_map(a.meta, a.steps * 16, mts, 32, &e_map))
    return launch_sm90<T, Sm90Cfg<256, 1, 6, 0, 1>>(a, stream);  // config 4
  if constexpr (EPI_N > 0) {
    if (!encode_y_map(a, EPI_N, &y_map))  // config 15, or 19 for the smaller token tiles
      return BN == 256 ? launch_sm90_tma_a<T, 256, 5, 1, 1>(a, stream, splits)
                       : launch_sm90_tma_a<T, 128, 8, 1, 1>(a, stream, BN == 128 ? splits : 1);
  } else {
    y_map = x_map;  // unused by the direct-store epilogue
  }
  if (tail_tokens == 0) x_tail_map = x_map;  // unused
  constexpr auto kernel =
      spmm_sm90_tma_a_kernel<T, BN, STAGES, GROUP, PERSIST, SKEW, EPI_N, EPI_BUFS, EVICT_FIRST, CLUSTER, XSHARE, TRIM,
                             RUNBUF>;
  constexpr int smem = TmaASmem<BN, STAGES, EPI_N, EPI_BUFS>::BYTES;
  cudaError_t err = raise_smem_limit_once<kernel>(smem);
  if (err != cudaSuccess) return err;
  const int row_units = ((a.rows_padded + 127) / 128 + CLUSTER - 1) / CLUSTER;
  const long long tiles = (long long)row_units * ((a.n_tokens + BN - 1) / BN);
  if (a.split_ws == nullptr || a.split_counters == nullptr || CLUSTER > 1 || SKEW) splits = 1;
  if (splits > 1 && tiles > kSplitKCounters) return cudaErrorInvalidValue;
  const long long units = tiles * splits;
  if (units > (1LL << 31) - 1) return cudaErrorInvalidConfiguration;
  const int k_tiles = (a.steps + 1) / 2, kt_per_split = (k_tiles + splits - 1) / splits;
  int sms = 0;
  if ((err = current_sm_count(&sms)) != cudaSuccess) return err;
  if constexpr (CLUSTER == 1) {
    const int grid = PERSIST ? (int)std::min<long long>(units, sms) : (int)units;
    // The shared split-K sum waits for every split of a tile: only where each CTA runs one unit and the grid is at
    // most the SM count (which MPS and green contexts report as their share), one CTA per SM (shared memory), so the
    // whole grid is resident once the GPU's other work leaves room (tile_config.h sm90_split_sum_shared with one slot
    // per SM); the split-K spin of CUTLASS's persistent kernels assumes the same.
    const int shared_sum = has_shared_split_sum<BN, PERSIST, CLUSTER>() && sm90_split_sum_shared(tiles, splits, sms);
    kernel<<<grid, kTmaThreads, smem, stream>>>(x_map, x_tail_map, a_map, e_map, y_map,
                                                static_cast<const T*>(a.bias), static_cast<T*>(a.y), a.n_tokens,
                                                tail_tokens, a.rows, a.rows_padded, a.steps, a.act, splits,
                                                kt_per_split, a.split_ws, a.split_counters, shared_sum);
    return cudaGetLastError();
  } else {
    cudaLaunchAttribute attr[1];
    cudaLaunchConfig_t cfg = cluster_launch(dim3(1), smem, stream, CLUSTER, attr);  // grid set below
    // Persistent clusters: as many as can be resident at once (GPCs may not split into whole clusters, so this can
    // be below sms / CLUSTER), asked once per instantiation (the first device's answer; sms has the same limit).
    static const int max_clusters = [&] {
      cudaLaunchConfig_t q = cfg;
      q.gridDim = dim3(CLUSTER * (sms / CLUSTER));
      int n = 0;
      if (cudaOccupancyMaxActiveClusters(&n, kernel, &q) != cudaSuccess || n <= 0) {
        (void)cudaGetLastError();  // clear the (non-sticky) error of the query; fall back to the SM count
        n = sms / CLUSTER;
      }
      return n;
    }();
    cfg.gridDim = dim3((unsigned)(CLUSTER * std::min<long long>(tiles, max_clusters)));
    return cudaLaunchKernelEx(&cfg, kernel, x_map, x_tail_map, a_map, e_map, y_map, static_cast<const T*>(a.bias),
                              static_cast<T*>(a.y), a.n_tokens, 0, a.rows, a.rows_padded, a.steps, a.act, 1, k_tiles,
                              static_cast<float*>(nullptr), static_cast<int*>(nullptr), 0);
  }
}

// The product's large-token configurations and their split-K (sm90_large_plan in tile_config.h; the measurements behind
// the choice are in benchmarks/RESULTS.md, "Staged epilogue", "Short-K", "tiles that fit the tokens" and "split-K in
// the persistent 2:4 configurations"). Their fallbacks: config 4 where a tensor map of X or the weight cannot be made,
// 15 / 19 where Y's cannot (see launch_sm90_tma_a).
template <typename T>
cudaError_t launch_large(const SpmmArgs& a, cudaStream_t stream, const SpmmPlan& p) {
  switch (p.config) {
    case kSm90Config192: return launch_sm90_tma_a<T, 192, 5, 1, 1, 0, 96, 2>(a, stream, p.split.splits);  // 27
    case kSm90Config128: return launch_sm90_tma_a<T, 128, 7, 1, 1, 0, 64, 2>(a, stream, p.split.splits);  // 23
    default: return launch_sm90_tma_a<T, 256, 4, 1, 1, 0, 64, 2>(a, stream, p.split.splits);              // 20
  }
}

#if defined(HF_SPARSE_LAB)
// Lab build: every configuration, by number (lab::tuning().sm90_config; benchmarks/lab/tuning.py). 0-5 stage X (and
// A) with cp.async from all threads; 6-12 a TMA producer warp for X (8/9 2-CTA clusters multicasting X, 10/11 a grouped
// CTA order, 12 clusters without sharing, diagnostic); 13-19 A and metadata by TMA too (15-18 persistent, 17/18 the
// two consumer warpgroups two k-tiles apart, 19 128-token tiles); 20-27 a staged epilogue; 28-31 2-CTA clusters
// multicasting X (31 without the sharing); 32/33 trimmed launch edges; 34/35 staging buffers rotating across tiles.
template <typename T>
cudaError_t launch_lab(const SpmmArgs& a, cudaStream_t stream, int cfg) {
  switch (cfg) {
    case 0: return launch_sm90<T, Sm90Cfg<256, 1, 4, 0>>(a, stream);
    case 1: return launch_sm90<T, Sm90Cfg<128, 2, 4, 0>>(a, stream);
    case 2: return launch_sm90<T, Sm90Cfg<128, 2, 6, 1>>(a, stream);
    case 3: return launch_sm90<T, Sm90Cfg<256, 1, 5, 1>>(a, stream);
    case 5: return launch_sm90<T, Sm90Cfg<128, 2, 8, 0, 1>>(a, stream);
    case 6: return launch_sm90_tma<T, 256, 6, 1>(a, stream);
    case 7: return launch_sm90_tma<T, 256, 6, 0>(a, stream);
    case 8: return launch_sm90_tma<T, 256, 6, 1, 2>(a, stream);
    case 9: return launch_sm90_tma<T, 256, 6, 0, 2>(a, stream);
    case 10: return launch_sm90_tma<T, 256, 6, 1, 1, 8>(a, stream);
    case 11: return launch_sm90_tma<T, 256, 6, 1, 1, 4>(a, stream);
    case 12: return launch_sm90_tma<T, 256, 6, 1, 2, 1, false>(a, stream);
    case 13: return launch_sm90_tma_a<T, 256, 5, 1, 0>(a, stream);
    case 14: return launch_sm90_tma_a<T, 256, 5, 8, 0>(a, stream);
    case 15: return launch_sm90_tma_a<T, 256, 5, 1, 1>(a, stream);
    case 16: return launch_sm90_tma_a<T, 256, 5, 8, 1>(a, stream);
    case 17: return launch_sm90_tma_a<T, 256, 5, 1, 1, 2>(a, stream);
    case 18: return launch_sm90_tma_a<T, 256, 5, 8, 1, 2>(a, stream);
    case 19: return launch_sm90_tma_a<T, 128, 8, 1, 1>(a, stream);
    // Staged epilogue (store_tile_staged): <BN, STAGES, GROUP, PERSIST, SKEW, EPI_N tokens per chunk, EPI_BUFS>
    case 20: return launch_sm90_tma_a<T, 256, 4, 1, 1, 0, 64, 2>(a, stream);
    case 21: return launch_sm90_tma_a<T, 256, 3, 1, 1, 0, 128, 2>(a, stream);
    case 22: return launch_sm90_tma_a<T, 256, 5, 1, 1, 0, 32, 2>(a, stream);
    case 23: return launch_sm90_tma_a<T, 128, 7, 1, 1, 0, 64, 2>(a, stream);
    case 24: return launch_sm90_tma_a<T, 256, 4, 1, 1, 2, 64, 2>(a, stream);
    case 25: return launch_sm90_tma_a<T, 256, 4, 1, 1, 0, 64, 2, true>(a, stream);  // Y stores L2 evict-first
    case 26: return launch_sm90_tma_a<T, 256, 5, 1, 1, 2, 32, 2>(a, stream);
    case 27: return launch_sm90_tma_a<T, 192, 5, 1, 1, 0, 96, 2>(a, stream);
    case 28: return launch_sm90_tma_a<T, 256, 4, 1, 1, 0, 64, 2, false, 2>(a, stream);
    case 29: return launch_sm90_tma_a<T, 192, 5, 1, 1, 0, 96, 2, false, 2>(a, stream);
    case 30: return launch_sm90_tma_a<T, 128, 7, 1, 1, 0, 64, 2, false, 2>(a, stream);
    case 31: return launch_sm90_tma_a<T, 256, 4, 1, 1, 0, 64, 2, false, 2, false>(a, stream);
    case 32: return launch_sm90_tma_a<T, 256, 4, 1, 1, 0, 64, 2, false, 1, true, true>(a, stream);
    case 33: return launch_sm90_tma_a<T, 192, 5, 1, 1, 0, 96, 2, false, 1, true, true>(a, stream);
    case 34: return launch_sm90_tma_a<T, 256, 4, 1, 1, 0, 64, 3, false, 1, true, false, true>(a, stream);
    case 35: return launch_sm90_tma_a<T, 256, 4, 1, 1, 0, 32, 7, false, 1, true, false, true>(a, stream);
    default: return launch_sm90<T, Sm90Cfg<256, 1, 6, 0, 1>>(a, stream);  // 4
  }
}
#endif

template <typename T>
cudaError_t dispatch_bn(const SpmmArgs& a, const SpmmPlan& p, cudaStream_t stream) {
#if defined(HF_SPARSE_LAB)
  // A configuration set in the lab runs at every token count where it can (the TMA ones, 6 and up: the tensor map
  // zero-fills missing tokens), so tests reach their tails; 0-5 are large-token tiles only.
  const int forced = lab::tuning().sm90_config.load(std::memory_order_relaxed);
  if (forced >= 6 || (forced >= 0 && a.n_tokens > 128)) return launch_lab<T>(a, stream, forced);
#endif
  if (p.few_token) {
    if (p.split.bn == 16) return launch_sm90<T, SmallCfg<16>>(a, stream, p.split.splits, true);
    if (p.split.bn == 128) return launch_sm90<T, SmallCfg<128>>(a, stream, p.split.splits, true);
    return launch_sm90<T, SmallCfg<64>>(a, stream, p.split.splits, true);
  }
  return launch_large<T>(a, stream, p);
}

}  // namespace

bool spmm_sm90_available() {
#if defined(HF_SPARSE_HAS_SM90A)
  static std::atomic<int> known[kMaxCachedDevices];  // 1: cc 9.0, 2: another
  int k = 0;
  const cudaError_t err = once_per_device(known, &k, [](int dev, int* out) {
    int major = 0, minor = 0;
    cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    *out = major == 9 && minor == 0 ? 1 : 2;
    return e;
  });
  return err == cudaSuccess && k == 1;
#else
  return false;
#endif
}

cudaError_t spmm_sm90_plan(const SpmmArgs& a, SpmmPlan* plan) {
  *plan = SpmmPlan{};
  if (a.m != 4) return cudaErrorInvalidValue;
  if (a.n_tokens <= 0) return cudaSuccess;  // nothing to launch
  int sms = 0;
  const cudaError_t err = current_sm_count(&sms);
  if (err == cudaSuccess) *plan = plan_call(a, sms);
  return err;
}

#if defined(HF_SPARSE_TIMELINE)
int spmm_sm90_timeline(unsigned long long* host, int ctas) { return read_and_clear_rows(host, g_timeline, ctas); }
int spmm_sm90_timeline_marks() { return kTimelineMarks; }
#endif

cudaError_t spmm_sm90(const SpmmArgs& a, const SpmmPlan& plan, cudaStream_t stream) {
  if (a.m != 4) return cudaErrorInvalidValue;
  if (!spmm_sm90_available()) return cudaErrorNoKernelImageForDevice;
  if (a.n_tokens == 0) return cudaSuccess;
  if (plan.split.tiles <= 0) return cudaErrorInvalidValue;  // not spmm_sm90_plan's plan of these arguments
  return a.is_bf16 ? dispatch_bn<__nv_bfloat16>(a, plan, stream) : dispatch_bn<__half>(a, plan, stream);
}

}  // namespace hf_sparse
