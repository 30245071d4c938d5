// Pack a dense weight (fp32/bf16/fp16) + bool mask into the kernels' V:2:M layout, fused with the cast to the
// compute dtype. Both passes read the mask and weight with coalesced accesses and write the packed tensors once:
//   1. (M > 4) block_columns: one thread per (row, group) ORs its row's column bits into its V-row block's word(s)
//      (scratch zeroed by the binding).
//   2. pack: one warp per (16-row m-tile, k-step): lane = (row, half of the 8 groups), so the warp reads 16 rows x
//      8M contiguous mask bytes and writes exactly one 512-byte fragment block, one 64-byte metadata block.
// A block's 4 columns are its first 4 used columns padded with the first unused ones (the set bits of one mask,
// so they come out sorted); a row's 2 positions likewise. A mask that breaks V:2:M raises a device flag.
#include "common.cuh"
#include "kernels.h"
#include "launch.h"

#include <algorithm>
#include <type_traits>

namespace hf_sparse {
namespace {

template <int M> struct Bits { static constexpr int WORDS = (M + 31) / 32; };

// Column bitmask (M bits) of mask[row, grp*M .. grp*M+M-1]; zero outside the real matrix.
template <int M>
__device__ __forceinline__ void row_bits(const bool* mask, int row, int grp, int rows, int k,
                                         uint32_t (&w)[Bits<M>::WORDS]) {
#pragma unroll
  for (int i = 0; i < Bits<M>::WORDS; ++i) w[i] = 0;
  if (row >= rows || grp * M >= k) return;
  const unsigned char* p = reinterpret_cast<const unsigned char*>(mask) + (size_t)row * k + (size_t)grp * M;
#pragma unroll
  for (int c = 0; c < M; c += 4) {
    const uint32_t v = *reinterpret_cast<const uint32_t*>(p + c);  // 4 bools; K % 4 == 0 keeps this aligned
    const uint32_t b = (v & 1u) | ((v >> 7) & 2u) | ((v >> 14) & 4u) | ((v >> 21) & 8u);
    w[c / 32] |= b << (c % 32);
  }
}

// The first `n` set bits of `bits` (WORDS words) as a mask.
template <int WORDS>
__device__ __forceinline__ void first_n(const uint32_t (&bits)[WORDS], int n, uint32_t (&out)[WORDS]) {
#pragma unroll
  for (int i = 0; i < WORDS; ++i) {
    uint32_t w = bits[i], o = 0;
    while (n > 0 && w) {
      o |= w & (0u - w);  // lowest set bit
      w &= w - 1;
      --n;
    }
    out[i] = o;
  }
}

template <typename W> __device__ __forceinline__ float load_f(const W* p);
template <> __device__ __forceinline__ float load_f<float>(const float* p) { return *p; }
template <> __device__ __forceinline__ float load_f<__nv_bfloat16>(const __nv_bfloat16* p) {
  return __bfloat162float(*p);
}
template <> __device__ __forceinline__ float load_f<__half>(const __half* p) { return __half2float(*p); }

template <int M>
__global__ void block_columns_kernel(const bool* __restrict__ mask, uint32_t* __restrict__ block_bits, int rows,
                                     int k, int v) {
  constexpr int WORDS = Bits<M>::WORDS;
  const int groups = k / M;
  const long total = (long)rows * groups;
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
    const int row = (int)(i / groups), grp = (int)(i % groups);
    uint32_t w[WORDS];
    row_bits<M>(mask, row, grp, rows, k, w);
#pragma unroll
    for (int j = 0; j < WORDS; ++j)
      if (w[j]) atomicOr(block_bits + ((size_t)(row / v) * groups + grp) * WORDS + j, w[j]);
  }
}

template <typename W, typename T, int M>
__global__ void __launch_bounds__(128) pack_kernel(PackArgs a, const uint32_t* __restrict__ block_bits) {
  constexpr int WORDS = Bits<M>::WORDS;
  const int lane = threadIdx.x & 31;
  const long warp = (blockIdx.x * (long)blockDim.x + threadIdx.x) >> 5;
  const int mtiles = a.rows_padded / 16;
  if (warp >= (long)mtiles * a.steps) return;
  const int mt = (int)(warp / a.steps), s = (int)(warp % a.steps);
  const int row = mt * 16 + (lane & 15);
  const int quad = 2 * s + (lane >> 4);  // groups 4*quad .. 4*quad+3
  const int rh = (row >> 3) & 1, g8 = row & 7, c = quad & 1;
  const int groups = a.k / M, groups_padded = a.steps * 8;
  const W* weight = static_cast<const W*>(a.weight);
  T* values = static_cast<T*>(a.values);
  uint32_t nibbles = 0;
  uint8_t cols_out[4][4];

#pragma unroll
  for (int jq = 0; jq < 4; ++jq) {
    const int grp = quad * 4 + jq;
    uint32_t bits[WORDS], chosen[WORDS];
    row_bits<M>(a.mask, row, grp, a.rows, a.k, bits);
    // the block's 4 columns as a bitmask `chosen` (sorted for free)
    if (M == 4) {
      chosen[0] = 0xFu;
    } else {
      uint32_t used[WORDS], unused[WORDS], pad[WORDS];
      int n_used = 0;
#pragma unroll
      for (int j = 0; j < WORDS; ++j) {
        used[j] = grp < groups ? block_bits[((size_t)(row / a.v) * groups + grp) * WORDS + j] : 0u;
        const uint32_t valid_bits = (M - 32 * j) >= 32 ? 0xFFFFFFFFu : ((1u << (M - 32 * j)) - 1u);
        unused[j] = ~used[j] & valid_bits;
        n_used += __popc(used[j]);
      }
      if (n_used > 4) atomicExch(a.error, 1);
      first_n<WORDS>(used, 4, chosen);
      first_n<WORDS>(unused, 4 - min(n_used, 4), pad);
#pragma unroll
      for (int j = 0; j < WORDS; ++j) chosen[j] |= pad[j];
    }
    // column offsets in increasing order, and the row's bits at those columns
    int col[4];
    int kept4 = 0, n = 0;
#pragma unroll
    for (int j = 0; j < WORDS; ++j) {
      uint32_t w = chosen[j];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if (w) {
          const int b = __ffs(w) - 1;
          w &= w - 1;
          const int cc = 32 * j + b;
          if (n == 0) col[0] = cc;
          else if (n == 1) col[1] = cc;
          else if (n == 2) col[2] = cc;
          else col[3] = cc;
          kept4 |= (int)((bits[j] >> b) & 1u) << n;
          ++n;
        }
      }
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) cols_out[jq][q] = (uint8_t)col[q];
    if (__popc(kept4) > 2) atomicExch(a.error, 1);
    // the row's two positions: first 2 kept, padded with the first unkept ones
    int sel_mask = 0, left = 2;
#pragma unroll
    for (int q = 0; q < 4; ++q)
      if (left > 0 && ((kept4 >> q) & 1)) sel_mask |= 1 << q, --left;
#pragma unroll
    for (int q = 0; q < 4; ++q)
      if (left > 0 && !((kept4 >> q) & 1)) sel_mask |= 1 << q, --left;
    const int sel0 = __ffs(sel_mask) - 1;
    const int sel1 = __ffs(sel_mask & (sel_mask - 1)) - 1;
    nibbles |= (uint32_t)(sel0 | (sel1 << 2)) << (4 * jq);
    float v[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int sel = e ? sel1 : sel0;
      const bool kept = (kept4 >> sel) & 1;
      const int cidx = sel == 0 ? col[0] : sel == 1 ? col[1] : sel == 2 ? col[2] : col[3];
      v[e] = (kept && row < a.rows) ? load_f<W>(weight + (size_t)row * a.k + (size_t)grp * M + cidx) : 0.f;
      v[e] = __fadd_rn(v[e], 0.0f);  // -0.0 + 0.0 = +0.0: pruned and zero slots are never -0.0
      if (row < a.rows && grp < groups) a.valid[(size_t)row * (2 * groups) + 2 * grp + e] = kept;
    }
    const int t = grp & 3;
    const size_t idx = (((size_t)mt * a.steps + s) * 32 + g8 * 4 + t) * 8 + (c * 2 + rh) * 2;
    *reinterpret_cast<uint32_t*>(values + idx) =
        MmaType<T>::pack(MmaType<T>::from_float(v[0]), MmaType<T>::from_float(v[1]));
  }
  uint16_t* m16 = reinterpret_cast<uint16_t*>(a.meta);
  m16[((((size_t)mt * a.steps + s) * 8 + g8) * 2 + c) * 2 + rh] = (uint16_t)nibbles;
  // one lane per 64-row slab writes the block columns of its 4 groups
  if ((row & 63) == 0) {
    const int slab = row >> 6;
#pragma unroll
    for (int jq = 0; jq < 4; ++jq) {
      uint32_t word = 0;
#pragma unroll
      for (int q = 0; q < 4; ++q) word |= (uint32_t)cols_out[jq][q] << (8 * q);
      *reinterpret_cast<uint32_t*>(a.columns + ((size_t)slab * groups_padded + quad * 4 + jq) * 4) = word;
    }
  }
}

template <typename W, typename T, int M>
cudaError_t launch(const PackArgs& a, cudaStream_t stream) {
  cudaError_t err;
  if (M != 4) {
    const size_t words = (size_t)(a.rows / a.v) * (a.k / M) * Bits<M>::WORDS;
    if ((err = cudaMemsetAsync(a.scratch, 0, words * sizeof(uint32_t), stream)) != cudaSuccess) return err;
    const long total = (long)a.rows * (a.k / M);
    const int blocks = (int)std::min<long>((total + 255) / 256, 65535L * 8);
    if (blocks > 0) block_columns_kernel<M><<<blocks, 256, 0, stream>>>(a.mask, a.scratch, a.rows, a.k, a.v);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  const long warps = (long)(a.rows_padded / 16) * a.steps;
  const long blocks = (warps * 32 + 127) / 128;
  pack_kernel<W, T, M><<<(unsigned)blocks, 128, 0, stream>>>(a, a.scratch);
  return cudaGetLastError();
}

template <typename W, typename T>
cudaError_t dispatch_m(const PackArgs& a, cudaStream_t stream) {
  return with_group_size(a.m, [&](auto m) { return launch<W, T, decltype(m)::value>(a, stream); });
}

template <typename W>
cudaError_t dispatch_out(const PackArgs& a, cudaStream_t stream) {
  return a.out_bf16 ? dispatch_m<W, __nv_bfloat16>(a, stream) : dispatch_m<W, __half>(a, stream);
}

}  // namespace

cudaError_t pack(const PackArgs& a, cudaStream_t stream) {
  if (a.rows_padded == 0 || a.steps == 0) return cudaSuccess;
  switch (a.weight_dtype) {
    case 0: return dispatch_out<float>(a, stream);
    case 1: return dispatch_out<__nv_bfloat16>(a, stream);
    case 2: return dispatch_out<__half>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace hf_sparse
