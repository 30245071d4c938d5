// SpMM for V:2:M weights (M >= 8) on sm_90a with sparse wgmma: Y (N x R) = X (N x K) * W^T (+ bias).
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
// The gather (X is tokens x K row-major; TMA cannot gather 2-byte elements) runs in every thread, in registers:
// thread (g = tid % 16, t0 = tid / 16) owns group g of every k-tile and tokens t0 + 16i, so its selection constants
// (byte-permute selectors, computed from the 4 packed uint8 offsets with a few integer ops) are made once per k-tile
// and slab and reused for all BN/16 tokens; consecutive lanes read consecutive groups of one token row (coalesced).
//  * M = 8 ("chunk" gather): a group is one aligned 16-byte chunk: one 16-byte load per token and group, shared by
//    both slabs of the CTA, then per slab 3 prmt per output word (two candidates from the low and high 8 bytes with
//    one selector, then a choice between them) and one 8-byte shared store.
//  * M >= 16 ("word" gather): most of a group's chunks hold no kept column, so each kept column is fetched as the
//    aligned 32-bit word that holds it (4 loads per slab, token and group; the two slabs' words mostly hit the same
//    L1 sectors), then 1 prmt per output word.
// Pipeline (128 weight rows = 2 slabs / 2 consumer warpgroups x BN tokens, 256 threads): the X words of k-tile kt+3
// are loaded while k-tile kt computes (two register sets, loop unrolled by two so each is a named array), the
// selection and the shared stores of k-tile kt+1 overlap k-tile kt's wgmmas, and one fence.proxy.async + CTA barrier
// per k-tile publishes them (two B buffers). A fragments and metadata come two k-tiles ahead (two register sets).
// Tails: tokens past n_tokens read the last token's row (their outputs are never stored); groups past G (the padded
// groups up to 8*steps, whose A values are zero) read group G-1's columns, so nothing past K is ever read.
//
// Only the sm_90a pass compiles the body; other device passes get a trap and the host launches it only where
// spmm_sm90_available() (cc 9.0 and an sm_90a build).
#include <cstdlib>

#include "common.cuh"
#include "kernels.h"
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "sm90_common.cuh"
#include "wgmma_sp.cuh"
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
// Registers of one k-tile's gather, loaded two k-tiles before their shared stores.
template <int M, int BN, bool CHUNK = (M == 8)>  // one 16-byte load per group; else four 32-bit words per slab
struct GatherRegs;
template <int M, int BN>
struct GatherRegs<M, BN, true> {
  uint4 x[BN / 16];  // group g's 16-byte chunk of each of my tokens
  uint32_t cw[2];    // the 4 offsets of group g, per slab (packed uint8)
};
template <int M, int BN>
struct GatherRegs<M, BN, false> {
  uint32_t w[BN / 16][2][4];  // the word holding kept column j, per token and slab
  uint32_t sel[2][2];         // prmt selectors of output words 0 / 1, per slab
};
#endif

template <typename T, int M, int BN>
__global__ void __launch_bounds__(kVnmThreads, 1)
spmm_vnm_sm90_kernel(const T* __restrict__ x, const uint4* __restrict__ values, const uint32_t* __restrict__ meta,
                     const uint32_t* __restrict__ columns, const T* __restrict__ bias, T* __restrict__ y,
                     int n_tokens, int rows, int rows_padded, int k, int steps) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = VnmCfg<M, BN>;
  using Regs = GatherRegs<M, BN>;
  constexpr int ND = BN / 2, TI = BN / 16;  // accumulators, tokens per thread per k-tile
  constexpr bool CHUNK = M == 8;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw_u32 = (uint32_t)__cvta_generic_to_shared(smem_raw);
  unsigned char* smem = smem_raw + ((1024u - (raw_u32 & 1023u)) & 1023u);
  const uint32_t smem_u32 = (uint32_t)__cvta_generic_to_shared(smem);

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wq = warp & 3;
  const int g = lane >> 2, t = lane & 3;
  const int n_base = blockIdx.y * BN;
  const int cta_row0 = blockIdx.x * 128;
  const int mt_cta = cta_row0 >> 4;
  const int mt_valid = (rows_padded - cta_row0) >> 4;
  const int k_tiles = (steps + 1) >> 1;  // 16 groups (2 k-steps) per k-tile
  const int groups = k / M, groups_padded = 8 * steps;
  const int slabs = rows_padded >> 6;

  // Gather role: group gg of every k-tile, tokens t0 + 16i (rows past n_tokens read the last row).
  const int gg = tid & 15, t0 = tid >> 4;
  const T* rowp[TI];
#pragma unroll
  for (int i = 0; i < TI; ++i) rowp[i] = x + (size_t)min(n_base + t0 + 16 * i, n_tokens - 1) * k;
  const uint32_t* colp[2];
#pragma unroll
  for (int s = 0; s < 2; ++s) colp[s] = columns + (size_t)min((cta_row0 >> 6) + s, slabs - 1) * groups_padded;
  // Shared-store offset of my 8 bytes in token row t0 + 16i of a slab's tile: + i * 2048 (row & 7 is t0 & 7).
  const uint32_t st_off = t0 * 128 + ((((uint32_t)gg >> 1) ^ (t0 & 7)) << 4) + 8 * (gg & 1);

  auto group_of = [&](int kt) { return min(kt * 16 + gg, groups - 1); };  // clamped: never past K
  auto load_cw = [&](int kt, uint32_t (&cw)[2]) {
    const int grp = group_of(kt);
#pragma unroll
    for (int s = 0; s < 2; ++s) cw[s] = colp[s][grp];
  };
  // Issue the global loads of k-tile kt (cw: its column offsets, loaded one k-tile earlier).
  auto load_x = [&](int kt, const uint32_t (&cw)[2], Regs& r) {
    const int col0 = group_of(kt) * M;
    if constexpr (CHUNK) {
#pragma unroll
      for (int i = 0; i < TI; ++i) r.x[i] = *reinterpret_cast<const uint4*>(rowp[i] + col0);
#pragma unroll
      for (int s = 0; s < 2; ++s) r.cw[s] = cw[s];
    } else {
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        // Output word o = (column 2o, column 2o+1): half (c & 1) of word c >> 1; prmt picks bytes 2h, 2h+1 of the
        // first source and 4 + 2h, 5 + 2h of the second.
        r.sel[s][0] = (cw[s] & 0x0101u) * 0x22u + 0x5410u;
        r.sel[s][1] = ((cw[s] >> 16) & 0x0101u) * 0x22u + 0x5410u;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int off = col0 + (int)((cw[s] >> (8 * j)) & 0xFEu);
#pragma unroll
          for (int i = 0; i < TI; ++i) r.w[i][s][j] = *reinterpret_cast<const uint32_t*>(rowp[i] + off);
        }
      }
    }
  };
  // Select the 4 kept halves of each group and store them into buffer `buf`'s B tiles (both slabs).
  auto store_b = [&](const Regs& r, int buf) {
    unsigned char* base = smem + buf * Cfg::STAGE + st_off;
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      uint32_t sa[2], sb[2];
      if constexpr (CHUNK) {
        // Element c (0..7) of the chunk: bytes 2(c&3), +1 of the low (c < 4) or high 8 bytes, then a choice.
        const uint32_t cw = r.cw[s];
        sa[0] = (cw & 0x0303u) * 0x22u + 0x1010u;
        sa[1] = ((cw >> 16) & 0x0303u) * 0x22u + 0x1010u;
        sb[0] = ((cw >> 2) & 0x0101u) * 0x44u + 0x3210u;
        sb[1] = ((cw >> 18) & 0x0101u) * 0x44u + 0x3210u;
      }
#pragma unroll
      for (int i = 0; i < TI; ++i) {
        uint2 o;
        if constexpr (CHUNK) {
          const uint4 v = r.x[i];
          o.x = __byte_perm(__byte_perm(v.x, v.y, sa[0]), __byte_perm(v.z, v.w, sa[0]), sb[0]);
          o.y = __byte_perm(__byte_perm(v.x, v.y, sa[1]), __byte_perm(v.z, v.w, sa[1]), sb[1]);
        } else {
          o.x = __byte_perm(r.w[i][s][0], r.w[i][s][1], r.sel[s][0]);
          o.y = __byte_perm(r.w[i][s][2], r.w[i][s][3], r.sel[s][1]);
        }
        *reinterpret_cast<uint2*>(base + s * Cfg::B_BYTES + i * 2048) = o;
      }
    }
  };

  // A fragments and metadata of this warp (m16 tile wq of slab wg), from global memory; an inactive warpgroup (the
  // 64 padded rows past the packed weight) and the missing second k-step of an odd step count multiply zeros with
  // valid metadata, never stored.
  constexpr uint32_t kMetaPad = 0x44444444u;
  const bool active = wg * 4 < mt_valid;
  const int mt = active ? wg * 4 + wq : 0;
  const uint4* ag = values + (size_t)(mt_cta + mt) * steps * 32 + lane;
  const uint32_t* eg = meta + (size_t)(mt_cta + mt) * steps * 16 + g * 2 + (t & 1);
  auto fetch_a = [&](int kt, uint4 (&a)[2], uint32_t (&e)[2]) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int s = 2 * kt + j;
      uint4 av = make_uint4(0, 0, 0, 0);
      uint32_t ev = kMetaPad;
      if (active && s < steps) {
        av = ag[(size_t)s * 32];
        ev = eg[(size_t)s * 16];
      }
      a[j] = av;
      e[j] = ev;
    }
  };

  float acc[ND];
#pragma unroll
  for (int j = 0; j < ND; ++j) acc[j] = 0.f;

  // Prologue: k-tile 0 stored into buffer 0, k-tiles 1 and 2 loaded, offsets of k-tile 3 in flight.
  Regs r0, r1;
  uint4 a0[2], a1[2];
  uint32_t e0[2], e1[2];
  uint32_t cw[2];
  fetch_a(0, a0, e0);
  fetch_a(1, a1, e1);
  load_cw(0, cw);
  load_x(0, cw, r0);
  load_cw(1, cw);
  if (1 < k_tiles) load_x(1, cw, r1);
  load_cw(2, cw);
  store_b(r0, 0);
  if (2 < k_tiles) load_x(2, cw, r0);
  load_cw(3, cw);
  fence_proxy_async();
  __syncthreads();

  // K-tile kt (buffer kt & 1, A set a/e): issue its wgmmas, store k-tile kt+1 (register set `nxt`) into the other
  // buffer and reload `nxt` with k-tile kt+3, then wait for the wgmmas, refill a/e with k-tile kt+2, and publish.
  auto step = [&](int kt, int buf, uint4 (&a)[2], uint32_t (&e)[2], Regs& nxt) {
    const uint64_t desc = desc_k128(smem_u32 + buf * Cfg::STAGE + wg * Cfg::B_BYTES);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 2; ++j) WgmmaSp<BN, T>::run(acc, a[j], desc + j * (64 >> 4), e[j]);
    wgmma_commit();
    if (kt + 1 < k_tiles) store_b(nxt, buf ^ 1);
    if (kt + 3 < k_tiles) load_x(kt + 3, cw, nxt);
    load_cw(kt + 4, cw);
    wgmma_wait<0>();
    fetch_a(kt + 2, a, e);
    fence_proxy_async();
    __syncthreads();
  };
  for (int kt = 0; kt < k_tiles; kt += 2) {
    step(kt, 0, a0, e0, r1);
    if (kt + 1 < k_tiles) step(kt + 1, 1, a1, e1, r0);
  }
#pragma unroll
  for (int j = 0; j < ND; ++j) asm volatile("" : "+f"(acc[j])::"memory");  // reads after the wgmma wait
  if (active) store_tile<T, BN>(acc, cta_row0 + 64 * wg + 16 * wq, n_base, lane, bias, y, rows, n_tokens);
#elif defined(__CUDA_ARCH__)
  __trap();  // built without sm_90a: the host never launches this (spmm_sm90_available() is false)
#endif
}

template <typename T, int M, int BN>
cudaError_t launch_vnm(const SpmmArgs& a, cudaStream_t stream) {
  using Cfg = VnmCfg<M, BN>;
  auto kernel = spmm_vnm_sm90_kernel<T, M, BN>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::SMEM);
  if (err != cudaSuccess) return err;
  // Row blocks vary fastest: CTAs resident together share a token tile of X (read once from L2) and walk W.
  const dim3 grid((a.rows_padded + 127) / 128, (a.n_tokens + BN - 1) / BN);
  if (grid.y > 65535) return cudaErrorInvalidConfiguration;  // the binding slices larger inputs
  kernel<<<grid, kVnmThreads, Cfg::SMEM, stream>>>(
      static_cast<const T*>(a.x), static_cast<const uint4*>(a.values), static_cast<const uint32_t*>(a.meta),
      reinterpret_cast<const uint32_t*>(a.columns), static_cast<const T*>(a.bias), static_cast<T*>(a.y), a.n_tokens,
      a.rows, a.rows_padded, a.k, a.steps);
  return cudaGetLastError();
}

// Tokens per CTA: 128 for M = 8 above 64 tokens (HF_SPARSE_VNM_TILE=64 forces 64, tuning only), 64 otherwise (the
// word gather holds 4x the registers per token).
template <typename T, int M>
cudaError_t dispatch_tile(const SpmmArgs& a, cudaStream_t stream) {
  if constexpr (M == 8) {
    const char* env = std::getenv("HF_SPARSE_VNM_TILE");
    const bool small = a.n_tokens <= 64 || (env != nullptr && std::atoi(env) == 64);
    if (!small) return launch_vnm<T, M, 128>(a, stream);
  }
  return launch_vnm<T, M, 64>(a, stream);
}

template <typename T>
cudaError_t dispatch_m(const SpmmArgs& a, cudaStream_t stream) {
  switch (a.m) {
    case 8: return dispatch_tile<T, 8>(a, stream);
    case 16: return dispatch_tile<T, 16>(a, stream);
    case 32: return dispatch_tile<T, 32>(a, stream);
    case 64: return dispatch_tile<T, 64>(a, stream);
    case 128: return dispatch_tile<T, 128>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t spmm_vnm_sm90(const SpmmArgs& a, cudaStream_t stream) {
  if (a.m < 8) return cudaErrorInvalidValue;
  if (!spmm_sm90_available()) return cudaErrorNoKernelImageForDevice;
  if (a.n_tokens == 0) return cudaSuccess;
  return a.is_bf16 ? dispatch_m<__nv_bfloat16>(a, stream) : dispatch_m<__half>(a, stream);
}

}  // namespace hf_sparse
