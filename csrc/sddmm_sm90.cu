// SDDMM for the weight gradient of a V:2:M layer on sm_90a with dense wgmma: dW[r, c] = sum_n dY[n, r] X[n, c] at the
// kept (r, c) only, fp32, logical order (R, 2G) (what hf_sparse.ops.sddmm_reference returns).
//
// Why: at V:2:M every 64-row slab keeps the same 4 columns of each group of M, so a slab's gradient is a dense GEMM
// over its condensed columns, C[64, 4G] = dY[:, slab]^T X[:, kept columns of the slab], of which each row keeps 2 of
// every 4 (metadata). That is half the dense dW GEMM's FLOPs at M = 8 (a quarter at 16), on wgmma instead of the
// warp-level mma.sync of sddmm.cu.
//
// CTA tile: 128 weight rows (two 64-row slabs, one per consumer warpgroup) x 64 groups (256 condensed columns per
// slab), reducing over a range of tokens in stages of BK tokens (32; 16 at M = 8). The operands, both MN-major
// (wgmma's transpose bits, allowed for 16-bit types), 128-byte swizzle, per stage:
//  * A = dY^T of a slab: a TMA box of 64 rows x BK tokens of dY (tokens x R row-major: 128 bytes per token row) is
//    exactly an MN-major A tile (8-token groups 1024 bytes apart = the stride byte offset).
//  * B = the slab's condensed X: BK token rows x 256 condensed columns, as 4 column blocks of 64 (128 bytes per token
//    row, blocks BK * 128 bytes apart = the leading byte offset). M = 4 (plain 2:4, every column kept): TMA boxes of X
//    straight into B, shared by both slabs (the epilogue keeps 2 of 4; no FLOP saving there). M >= 8: written by the
//    gatherer warpgroup (stores swizzled by hand, fence.proxy.async, an arrive on the stage's "full" mbarrier):
//    - M = 8 (default, "staged"): thread 0 of the gatherers issues each stage's TMA boxes, dY and the dense X tile
//      (2 boxes of 256 columns x BK = 16 tokens, no swizzle), S - 2 stages ahead; every gatherer thread reads one
//      group's 16-byte chunk per token from shared memory and picks its slab's 4 columns with 2 byte permutes per
//      output word. The lab build (gather_regs): the chunks from global memory into two register sets
//      (1.3-1.4x slower: the proxy fence also waits for the next stage's loads).
//    - M >= 16: the 4 kept 16-bit elements per slab from global memory, 8 (group, token) items in flight per thread.
//    Its thread 0 issues the dY boxes of M >= 16 (expect-tx on "full") and of M = 4 (with X) as well.
// Consumers wait on "full" (staged: and on the TMA barrier of the stage's dY), issue BK/16 wgmma m64n256k16 per stage,
// keep one stage of wgmmas in flight and release the previous stage on its "empty" mbarrier (one arrival per warp).
// Epilogue: per row and group the accumulators hold the 4 condensed columns over two lanes (t, t ^ 1); each lane
// writes the kept slots (metadata nibble) whose positions it holds: an 8-byte store where it holds both, else 4-byte
// stores, or fp32 atomics when the token range is split over gridDim.z (into an output zeroed first).
// Tails: tokens past n_tokens and rows past R arrive as zeros (TMA fill; gatherers store zeros), groups past G are
// gathered as zeros and never stored; nothing past K or n_tokens is read.
//
// Only the sm_90a pass compiles the body; other device passes get a trap and the host launches it only where
// spmm_sm90_available() (cc 9.0 and an sm_90a build).

#include <algorithm>

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
#include "wgmma_dense.cuh"
#endif

namespace hf_sparse {
namespace {

using Tile = SddmmSm90Tile;
constexpr int kThreads = 384;  // warpgroups 0, 1: consumers (slab 0, 1); 2: gatherers (and the TMA thread)

template <int M, bool STG>
struct SdCfg {
  static constexpr bool DIRECT = M == 4;                   // B = X by TMA, shared by both slabs
  static constexpr bool STAGED = M == 8 && STG;            // dense X by TMA into shared memory, then permuted
  static constexpr int BK = STAGED ? Tile::BK_STAGED : Tile::BK, NG = Tile::GROUPS, NC = 4 * NG;
  static constexpr int STAGES = DIRECT ? Tile::STAGES_DIRECT : (STAGED ? Tile::STAGES_STAGED : Tile::STAGES);
  static constexpr int A_SLAB = BK * 128;                  // one slab's A tile
  static constexpr int B_BLOCK = BK * 128;                 // 64 condensed columns x BK tokens
  static constexpr int B_SLAB = (NC / 64) * B_BLOCK;
  static constexpr int A_BYTES = 2 * A_SLAB;
  static constexpr int B_BYTES = (DIRECT ? 1 : 2) * B_SLAB;
  static constexpr int XS_ROW = STAGED ? NG * M * 2 : 0;  // staged dense X: bytes per token row (two TMA boxes)
  static constexpr int XS_BYTES = BK * XS_ROW;
  static constexpr int STAGE = A_BYTES + B_BYTES + XS_BYTES;
  static constexpr int SMEM = STAGES * STAGE + 1024;       // + alignment slack for the 1024-byte swizzle atoms
  static constexpr int ITEMS = NG * BK / 128;              // (group, token) items per gatherer thread per stage
  static constexpr int BATCH = M == 8 ? ITEMS : 8;         // items whose loads are in flight together
  static_assert(BK % 16 == 0 && NC % 64 == 0 && STAGE % 1024 == 0, "tile shape");
  static_assert(SMEM <= 227 * 1024, "over the sm_90 shared-memory limit");
  static_assert(ITEMS % BATCH == 0 && NG == 64, "gatherer roles assume 64 groups (two warps of 32 per token row)");
  static_assert(!STAGED || XS_ROW == 2 * 512, "the staged X tile is two TMA boxes of 256 columns x BK tokens");
};

template <typename T, int M, bool STG>
__global__ void __launch_bounds__(kThreads, 1)
sddmm_sm90_kernel(const __grid_constant__ CUtensorMap dy_map, const __grid_constant__ CUtensorMap x_map,
                  const T* __restrict__ x, const uint32_t* __restrict__ meta, const uint32_t* __restrict__ columns,
                  float* __restrict__ out, int n_tokens, int rows, int rows_padded, int k, int steps,
                  int chunks_per_split, int atomic) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = SdCfg<M, STG>;
  constexpr int BK = Cfg::BK, NG = Cfg::NG, NC = Cfg::NC, S = Cfg::STAGES;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t bars[3 * S];  // full, empty, xfull (staged: dY + dense X landed), S each
  unsigned char* smem = smem_raw + pad_to_1024((uint32_t)__cvta_generic_to_shared(smem_raw));
  const uint32_t smem_u32 = (uint32_t)__cvta_generic_to_shared(smem);
  const uint32_t bar_u32 = (uint32_t)__cvta_generic_to_shared(bars);
  auto full = [&](int s) { return bar_u32 + 8u * s; };
  auto empty = [&](int s) { return bar_u32 + 8u * (S + s); };
  auto xfull = [&](int s) { return bar_u32 + 8u * (2 * S + s); };

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
  const int grp0 = blockIdx.x * NG;
  const int slab0 = blockIdx.y * 2;
  const int groups = k / M, groups_padded = 8 * steps, slabs = rows_padded >> 6;
  const int n_chunks = (n_tokens + BK - 1) / BK;
  const int chunk_begin = blockIdx.z * chunks_per_split;
  const int n_kt = max(0, min(n_chunks, chunk_begin + chunks_per_split) - chunk_begin);

  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      // full: gatherer arrivals (+ the expect-tx arrival of the dY / X boxes where they complete on it)
      mbar_init(full(s), Cfg::DIRECT ? 1 : (Cfg::STAGED ? 128 : 129));
      mbar_init(empty(s), 8);  // one per consumer warp
      mbar_init(xfull(s), 1);  // staged: the expect-tx arrival of the dY and dense X boxes
    }
    mbar_fence_init();
  }
  __syncthreads();

  if (wg == 2) {
    // ---------------- gatherers ----------------
    const int gt = tid & 127;
    const int gg = gt & 63, tr = gt >> 6;  // my group; my token rows tr + 2i
    const int grp = grp0 + gg;
    const bool grp_ok = grp < groups;
    const int grp_c = min(grp, groups - 1);
    uint32_t cw[2];  // the 4 offsets of my group, per slab (packed uint8)
#pragma unroll
    for (int s = 0; s < 2; ++s) cw[s] = columns[(size_t)min(slab0 + s, slabs - 1) * groups_padded + grp_c];
    // B tile offset of (group gg, token row r): column block gg / 16, chunk (gg % 16) / 2 ^ (r & 7), byte 8 (gg & 1).
    const uint32_t st_base = (uint32_t)(gg >> 4) * Cfg::B_BLOCK + (uint32_t)tr * 128 + 8u * (gg & 1);
    const uint32_t chunk = (uint32_t)(gg & 15) >> 1;
    const T* xg = x + (size_t)grp_c * M;
    const KeptOf8 kept[2] = {KeptOf8(cw[0]), KeptOf8(cw[1])};  // M = 8 selectors (sm90_common.cuh)

    // Wait for stage kt's slot, then (thread 0) arm its "full" barrier and issue its TMA boxes.
    auto claim = [&](int kt) {
      const int s = kt % S;
      mbar_wait(empty(s), ((kt / S) & 1) ^ 1);
      if (gt == 0) {
        const int tok0 = (chunk_begin + kt) * BK;
        mbar_arrive_expect_tx(full(s), Cfg::DIRECT ? Cfg::A_BYTES + Cfg::B_BYTES : Cfg::A_BYTES);
#pragma unroll
        for (int sl = 0; sl < 2; ++sl)
          tma_load_2d(smem_u32 + s * Cfg::STAGE + sl * Cfg::A_SLAB, &dy_map, (slab0 + sl) * 64, tok0, full(s));
        if constexpr (Cfg::DIRECT) {
#pragma unroll
          for (int b = 0; b < NC / 64; ++b)
            tma_load_2d(smem_u32 + s * Cfg::STAGE + Cfg::A_BYTES + b * Cfg::B_BLOCK, &x_map, grp0 * 4 + b * 64, tok0,
                        full(s));
        }
      }
    };
    auto publish = [&](int kt) {
      fence_proxy_async();  // my generic-proxy stores, before the wgmmas (async proxy) read them
      mbar_arrive(full(kt % S));
    };
    if constexpr (Cfg::DIRECT) {
      for (int kt = 0; kt < n_kt; ++kt) claim(kt);
    } else if constexpr (Cfg::STAGED) {
      // Thread 0 keeps the TMA boxes (dY + dense X) of S - 2 stages in flight; every gatherer thread selects its
      // items from the staged X of stage kt (16-byte shared loads, a warp reads 512 contiguous bytes of one token
      // row) into the B tiles. No global loads in the gatherers: the fence.proxy.async that publishes the B stores
      // waits only for their shared-memory accesses (with register loads it waited for the loads of the next stage).
      // The boxes of stage kt + S - 2 go out after stage kt: their slot held stage kt - 2, which the consumers have
      // released by then (S - 1 would wait for them to finish stage kt - 1, i.e. to have started stage kt, and so
      // chain every stage's gather to the previous stage's wgmmas: measured 2.7 ms at 4096->11008, 64:2:8).
      auto issue = [&](int j) {
        const int s = j % S, tok0 = (chunk_begin + j) * BK;
        mbar_wait(empty(s), ((j / S) & 1) ^ 1);
        mbar_arrive_expect_tx(xfull(s), Cfg::A_BYTES + Cfg::XS_BYTES);
        const uint32_t st = smem_u32 + s * Cfg::STAGE;
#pragma unroll
        for (int sl = 0; sl < 2; ++sl) tma_load_2d(st + sl * Cfg::A_SLAB, &dy_map, (slab0 + sl) * 64, tok0, xfull(s));
#pragma unroll
        for (int b = 0; b < 2; ++b)
          tma_load_2d(st + Cfg::A_BYTES + Cfg::B_BYTES + b * BK * 512, &x_map, grp0 * M + b * 256, tok0, xfull(s));
      };
      if (gt == 0)
        for (int j = 0; j < min(S - 2, n_kt); ++j) issue(j);
      for (int kt = 0; kt < n_kt; ++kt) {
        const int s = kt % S;
        mbar_wait(xfull(s), (kt / S) & 1);
        unsigned char* st = smem + s * Cfg::STAGE;
        uint4 v[Cfg::ITEMS];
#pragma unroll
        for (int i = 0; i < Cfg::ITEMS; ++i)
          v[i] = *reinterpret_cast<const uint4*>(st + Cfg::A_BYTES + Cfg::B_BYTES + (gg >> 5) * (BK * 512) +
                                                 (tr + 2 * i) * 512 + (gg & 31) * 16);
#pragma unroll
        for (int sl = 0; sl < 2; ++sl)
#pragma unroll
          for (int i = 0; i < Cfg::ITEMS; ++i) {
            const int r = tr + 2 * i;
            *reinterpret_cast<uint2*>(st + Cfg::A_BYTES + sl * Cfg::B_SLAB + st_base + 2 * i * 128 +
                                      ((chunk ^ (r & 7)) << 4)) = kept[sl](v[i]);
          }
        fence_proxy_async();  // my generic-proxy stores, before the wgmmas (async proxy) read them
        mbar_arrive(full(s));
        if (gt == 0 && kt + S - 2 < n_kt) issue(kt + S - 2);
      }
    } else if constexpr (M == 8) {
      // The lab build (gather_regs): X from global memory into two register sets, the loads of stage
      // kt + 1 issued before stage kt is selected and stored. Measured 2.19 ms at 4096->11008, 64:2:8 (1.6 us per
      // stage): the fence.proxy.async that publishes each stage's stores waits for the next stage's loads too.
      auto load = [&](int kt, uint4 (&v)[Cfg::ITEMS]) {
        const int tok0 = (chunk_begin + kt) * BK;
#pragma unroll
        for (int i = 0; i < Cfg::ITEMS; ++i) {
          const int tok = tok0 + tr + 2 * i;
          v[i] = make_uint4(0, 0, 0, 0);
          if (grp_ok && tok < n_tokens) v[i] = *reinterpret_cast<const uint4*>(xg + (size_t)tok * k);
        }
      };
      auto put = [&](int kt, const uint4 (&v)[Cfg::ITEMS]) {
        claim(kt);
        unsigned char* sb = smem + (kt % S) * Cfg::STAGE + Cfg::A_BYTES;
#pragma unroll
        for (int sl = 0; sl < 2; ++sl)
#pragma unroll
          for (int i = 0; i < Cfg::ITEMS; ++i) {
            const int r = tr + 2 * i;
            *reinterpret_cast<uint2*>(sb + sl * Cfg::B_SLAB + st_base + 2 * i * 128 + ((chunk ^ (r & 7)) << 4)) =
                kept[sl](v[i]);
          }
        publish(kt);
      };
      uint4 va[Cfg::ITEMS], vb[Cfg::ITEMS];
      if (n_kt > 0) load(0, va);
      for (int kt = 0; kt < n_kt; kt += 2) {
        if (kt + 1 < n_kt) load(kt + 1, vb);
        put(kt, va);
        if (kt + 1 >= n_kt) break;
        if (kt + 2 < n_kt) load(kt + 2, va);
        put(kt + 1, vb);
      }
    } else {
      const uint16_t* xh = reinterpret_cast<const uint16_t*>(xg);
      for (int kt = 0; kt < n_kt; ++kt) {
        claim(kt);
        const int tok0 = (chunk_begin + kt) * BK;
        unsigned char* sb = smem + (kt % S) * Cfg::STAGE + Cfg::A_BYTES;
#pragma unroll
        for (int b = 0; b < Cfg::ITEMS; b += Cfg::BATCH) {
          uint32_t h[Cfg::BATCH][2][4];
#pragma unroll
          for (int i = 0; i < Cfg::BATCH; ++i) {
            const int tok = tok0 + tr + 2 * (b + i);
            const bool ok = grp_ok && tok < n_tokens;
#pragma unroll
            for (int sl = 0; sl < 2; ++sl)
#pragma unroll
              for (int j = 0; j < 4; ++j)
                h[i][sl][j] = ok ? (uint32_t)__ldg(xh + (size_t)tok * k + ((cw[sl] >> (8 * j)) & 0xFFu)) : 0u;
          }
#pragma unroll
          for (int i = 0; i < Cfg::BATCH; ++i) {
            const int r = tr + 2 * (b + i);
#pragma unroll
            for (int sl = 0; sl < 2; ++sl) {
              uint2 o;
              o.x = h[i][sl][0] | (h[i][sl][1] << 16);
              o.y = h[i][sl][2] | (h[i][sl][3] << 16);
              *reinterpret_cast<uint2*>(sb + sl * Cfg::B_SLAB + st_base + 2 * (b + i) * 128 +
                                        ((chunk ^ (r & 7)) << 4)) = o;
            }
          }
        }
        publish(kt);
      }
    }
    return;
  }

  {
    // ---------------- consumers ----------------
    const int wq = warp & 3, g = lane >> 2, t = lane & 3;
    float acc[NC / 2];
#pragma unroll
    for (int j = 0; j < NC / 2; ++j) acc[j] = 0.f;
    for (int kt = 0; kt < n_kt; ++kt) {
      const int s = kt % S;
      if constexpr (Cfg::STAGED) mbar_wait(xfull(s), (kt / S) & 1);  // dY landed (the gatherers saw X land)
      mbar_wait(full(s), (kt / S) & 1);
      const uint32_t a_addr = smem_u32 + s * Cfg::STAGE + wg * Cfg::A_SLAB;
      const uint32_t b_addr = smem_u32 + s * Cfg::STAGE + Cfg::A_BYTES + (Cfg::DIRECT ? 0 : wg * Cfg::B_SLAB);
      const uint64_t da = desc_mn128(a_addr, Cfg::A_SLAB), db = desc_mn128(b_addr, Cfg::B_BLOCK);
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < BK / 16; ++j) WgmmaMN<NC, T>::run(acc, da + j * (2048 >> 4), db + j * (2048 >> 4));
      wgmma_commit();
      wgmma_wait<1>();  // the previous stage's wgmmas are done: release its slot
      if (kt > 0 && lane == 0) mbar_arrive(empty((kt - 1) % S));
    }
    wgmma_wait<0>();
#pragma unroll
    for (int j = 0; j < NC / 2; ++j) asm volatile("" : "+f"(acc[j])::"memory");  // reads after the wgmma wait

    // Epilogue. acc[4j + 2h + e]: row 16 wq + g + 8h of the slab, condensed column 8j + 2t + e, i.e. group
    // 2j + t / 2, position 2 (t & 1) + e: lanes t and t ^ 1 hold the 4 positions of a (row, group) between them. Each
    // lane writes the kept slots whose position it holds (no shuffle: a shuffle here made ptxas serialize the wgmmas).
    const int pair = t & 1;
    const int r_base = (slab0 + wg) * 64 + 16 * wq + g;
    const uint32_t* mrow = meta + (size_t)(min(r_base, rows_padded - 1) >> 4) * steps * 16 + 2 * g;
#pragma unroll
    for (int j = 0; j < NC / 8; ++j) {
      const int grp = grp0 + 2 * j + (t >> 1);
      const bool gok = grp < groups;
      const uint32_t reg = __ldg(mrow + (gok ? (size_t)(grp >> 3) * 16 + ((grp >> 2) & 1) : 0));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r_base + 8 * h;
        const uint32_t nib = (reg >> (16 * h + 4 * (grp & 3))) & 0xFu;
        const uint32_t p0 = nib & 3u, p1 = nib >> 2;
        const float a = acc[4 * j + 2 * h], b = acc[4 * j + 2 * h + 1];
        const float o0 = (p0 & 1u) ? b : a, o1 = (p1 & 1u) ? b : a;
        const bool ok = gok && r < rows;
        float* dst = out + (size_t)r * (2 * groups) + 2 * grp;
        const bool w0 = ok && (int)(p0 >> 1) == pair, w1 = ok && (int)(p1 >> 1) == pair;
        if (atomic) {
          if (w0) atomicAdd(dst, o0);
          if (w1) atomicAdd(dst + 1, o1);
        } else if (w0 && w1) {
          *reinterpret_cast<float2*>(dst) = make_float2(o0, o1);
        } else {
          if (w0) dst[0] = o0;
          if (w1) dst[1] = o1;
        }
      }
    }
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // built without sm_90a: the host never launches this (spmm_sm90_available() is false)
#endif
}

// Tensor map of a (n_tokens x features) row-major 16-bit activation in boxes of box_cols features x box_rows tokens
// (box_cols = 64 with 128-byte swizzle, else no swizzle), zero fill out of bounds. False where TMA cannot address it
// (alignment) or the driver refuses.
bool encode_rows_map(const void* base, int features, int n_tokens, int box_cols, int box_rows, bool bf16,
                     CUtensorMap* map) {
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0 || features % 8 != 0) return false;
  PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {(cuuint64_t)features, (cuuint64_t)n_tokens};
  const cuuint64_t strides[1] = {(cuuint64_t)features * 2};
  const cuuint32_t box[2] = {(cuuint32_t)box_cols, (cuuint32_t)box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult res = encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
                              const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              box_cols == 64 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS;
}

// Token splits: the CTA grid (row blocks x group tiles) is often smaller than the GPU at BERT shapes (48-64 CTAs at
// 768-4096 features), so the token range is split over gridDim.z. Cost model: waves(s) x (stages per split + ~8 for
// the pipeline fill and the epilogue), the smallest s among the cheapest; at most 16 splits, >= 4 stages each.
int pick_splits(long ctas, int n_chunks, int sms) {
  int best = 1;
  long best_cost = -1;
  for (int s = 1; s <= 16 && (s == 1 || s * 4 <= n_chunks); ++s) {
    const long waves = (ctas * s + sms - 1) / sms;
    const long cost = waves * ((n_chunks + s - 1) / s + 8);
    if (best_cost < 0 || cost < best_cost) {
      best_cost = cost;
      best = s;
    }
  }
  return best;
}

template <typename T, int M, bool STG>
cudaError_t launch(const SddmmArgs& a, cudaStream_t stream) {
  using Cfg = SdCfg<M, STG>;
  CUtensorMap dy_map, x_map;
  if (!encode_rows_map(a.dy, a.rows, a.n_tokens, 64, Cfg::BK, a.is_bf16, &dy_map)) return cudaErrorNotSupported;
  x_map = dy_map;  // unused unless M == 4 (X straight into B) or staged (dense X boxes of 256 columns)
  if ((Cfg::DIRECT || Cfg::STAGED) &&
      !encode_rows_map(a.x, a.k, a.n_tokens, Cfg::DIRECT ? 64 : 256, Cfg::BK, a.is_bf16, &x_map))
    return cudaErrorNotSupported;
  constexpr auto kernel = sddmm_sm90_kernel<T, M, STG>;
  cudaError_t err = raise_smem_limit_once<kernel>(Cfg::SMEM);
  if (err != cudaSuccess) return err;
  const int groups = a.k / a.m;
  dim3 grid((groups + Cfg::NG - 1) / Cfg::NG, (a.rows_padded + 127) / 128, 1);
  if (grid.y > 65535) return cudaErrorInvalidConfiguration;
  int sms = 0;
  if ((err = current_sm_count(&sms)) != cudaSuccess) return err;
  const int n_chunks = (a.n_tokens + Cfg::BK - 1) / Cfg::BK;
  const int splits = pick_splits((long)grid.x * grid.y, n_chunks, sms);
  const int per = (n_chunks + splits - 1) / splits;
  grid.z = (n_chunks + per - 1) / per;
  const int atomic = grid.z > 1;
  if (atomic && (err = cudaMemsetAsync(a.out, 0, (size_t)a.rows * 2 * groups * sizeof(float), stream)) != cudaSuccess)
    return err;
  kernel<<<grid, kThreads, Cfg::SMEM, stream>>>(dy_map, x_map, static_cast<const T*>(a.x),
                                                static_cast<const uint32_t*>(a.meta),
                                                reinterpret_cast<const uint32_t*>(a.columns), a.out, a.n_tokens,
                                                a.rows, a.rows_padded, a.k, a.steps, per, atomic);
  return cudaGetLastError();
}

// M = 8 fills its B tiles from dense X staged by TMA, permuted from shared memory; the lab build (HF_SPARSE_LAB) can
// load X from global memory into registers instead (lab::tuning().sddmm_gather_regs).
template <typename T>
cudaError_t dispatch_m(const SddmmArgs& a, cudaStream_t stream) {
  return with_group_size(a.m, [&](auto m) {
    constexpr int M = decltype(m)::value;
#if defined(HF_SPARSE_LAB)
    if constexpr (M == 8) {
      if (lab::tuning().sddmm_gather_regs.load(std::memory_order_relaxed) != 0) return launch<T, 8, false>(a, stream);
    }
#endif
    return launch<T, M, true>(a, stream);
  });
}

}  // namespace

cudaError_t sddmm_sm90(const SddmmArgs& a, cudaStream_t stream) {
  if (!spmm_sm90_available()) return cudaErrorNoKernelImageForDevice;
  if (a.n_tokens == 0) {
    const size_t bytes = (size_t)a.rows * 2 * (a.k / a.m) * sizeof(float);
    return bytes ? cudaMemsetAsync(a.out, 0, bytes, stream) : cudaSuccess;
  }
  cudaError_t err = a.is_bf16 ? dispatch_m<__nv_bfloat16>(a, stream) : dispatch_m<__half>(a, stream);
  if (err == cudaErrorNotSupported) {  // no tensor map here: the mma.sync kernel, into a zeroed output
    const size_t bytes = (size_t)a.rows * 2 * (a.k / a.m) * sizeof(float);
    if ((err = cudaMemsetAsync(a.out, 0, bytes, stream)) != cudaSuccess) return err;
    return sddmm(a, stream);
  }
  return err;
}

}  // namespace hf_sparse
