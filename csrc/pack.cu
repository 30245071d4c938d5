// Pack a dense masked master weight (fp32/bf16/fp16) + bool mask into the kernels' V:2:M layout, fused with the
// cast to the compute dtype. Runs after every optimizer step, so it reads the weight and mask once and writes the
// packed tensors once. One warp per (V-row block, 4 consecutive groups): lanes own rows, the block's 4 columns are
// the OR of the rows' masks (first 4 used columns, padded with unused ones), each row then keeps its (at most 2)
// selected columns. The 4 groups of one warp are exactly one 16-bit half of a metadata register, so every
// output element has one writer. A mask that breaks V:2:M raises a device flag that the host may check.
#include "common.cuh"
#include "kernels.h"

namespace hf_sparse {
namespace {

template <int M> struct Bits { static constexpr int WORDS = (M + 31) / 32; };

// Column bitmask (M bits) of mask[row, grp*M .. grp*M+M-1]; zero outside the real matrix.
template <int M>
__device__ __forceinline__ void row_bits(const bool* mask, int row, int grp, int rows, int k, uint32_t (&w)[Bits<M>::WORDS]) {
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

template <typename W> __device__ __forceinline__ float load_f(const W* p);
template <> __device__ __forceinline__ float load_f<float>(const float* p) { return *p; }
template <> __device__ __forceinline__ float load_f<__nv_bfloat16>(const __nv_bfloat16* p) { return __bfloat162float(*p); }
template <> __device__ __forceinline__ float load_f<__half>(const __half* p) { return __half2float(*p); }

template <typename W, typename T, int M, int V>
__global__ void __launch_bounds__(128) pack_kernel(PackArgs a) {
  constexpr int ROWS_PER_LANE = V / 32;
  constexpr int WORDS = Bits<M>::WORDS;
  const int lane = threadIdx.x & 31;
  const int warp_global = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int quads = a.steps * 2;
  const int n_blocks = a.rows_padded / V;
  if (warp_global >= n_blocks * quads) return;
  const int block = warp_global / quads, quad = warp_global % quads;
  const int groups_padded = a.steps * 8;
  const W* weight = static_cast<const W*>(a.weight);
  T* values = static_cast<T*>(a.values);
  const int m_groups = a.k / M;

  uint32_t nibbles[ROWS_PER_LANE];
#pragma unroll
  for (int i = 0; i < ROWS_PER_LANE; ++i) nibbles[i] = 0;

#pragma unroll 1
  for (int jq = 0; jq < 4; ++jq) {
    const int grp = quad * 4 + jq;
    uint32_t bits[ROWS_PER_LANE][WORDS];
    uint32_t used[WORDS];
#pragma unroll
    for (int w = 0; w < WORDS; ++w) used[w] = 0;
#pragma unroll
    for (int i = 0; i < ROWS_PER_LANE; ++i) {
      row_bits<M>(a.mask, block * V + i * 32 + lane, grp, a.rows, a.k, bits[i]);
#pragma unroll
      for (int w = 0; w < WORDS; ++w) used[w] |= bits[i][w];
    }
    int cols[4];
    if (M == 4) {
      cols[0] = 0, cols[1] = 1, cols[2] = 2, cols[3] = 3;
    } else {
#pragma unroll
      for (int w = 0; w < WORDS; ++w) used[w] = __reduce_or_sync(0xffffffffu, used[w]);
      int n_used = 0, nc = 0;
#pragma unroll
      for (int w = 0; w < WORDS; ++w) n_used += __popc(used[w]);
      if (n_used > 4 && lane == 0) atomicExch(a.error, 1);
      for (int c = 0; c < M && nc < 4; ++c)  // first used columns, in increasing order
        if ((used[c / 32] >> (c % 32)) & 1u) cols[nc++] = c;
      const int n_real = nc;
      for (int c = 0; c < M && nc < 4; ++c)  // then the first unused ones, merged in increasing order
        if (!((used[c / 32] >> (c % 32)) & 1u)) cols[nc++] = c;
      // sort the 4 (at most two runs): insertion sort on 4 elements
      (void)n_real;
#pragma unroll
      for (int i = 1; i < 4; ++i)
#pragma unroll
        for (int j = i; j > 0; --j)
          if (cols[j - 1] > cols[j]) { const int tmp = cols[j]; cols[j] = cols[j - 1]; cols[j - 1] = tmp; }
    }
    if (lane < 4 * (V / 64)) {  // columns, one copy per 64-row slab of the block
      const int slab = block * (V / 64) + lane / 4;
      a.columns[((size_t)slab * groups_padded + grp) * 4 + (lane & 3)] = (uint8_t)cols[lane & 3];
    }
#pragma unroll
    for (int i = 0; i < ROWS_PER_LANE; ++i) {
      const int row = block * V + i * 32 + lane;
      int kept4 = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) kept4 |= (int)((bits[i][cols[j] / 32] >> (cols[j] % 32)) & 1u) << j;
      if (__popc(kept4) > 2) atomicExch(a.error, 1);
      int sel[2], ns = 0;
      for (int j = 0; j < 4 && ns < 2; ++j) if ((kept4 >> j) & 1) sel[ns++] = j;
      const int n_kept = ns;
      for (int j = 0; j < 4 && ns < 2; ++j) if (!((kept4 >> j) & 1)) sel[ns++] = j;
      if (sel[0] > sel[1]) { const int tmp = sel[0]; sel[0] = sel[1]; sel[1] = tmp; }
      nibbles[i] |= (uint32_t)(sel[0] | (sel[1] << 2)) << (4 * jq);
      float v[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool kept = (kept4 >> sel[e]) & 1;
        const int col = grp * M + cols[sel[e]];
        v[e] = (kept && row < a.rows) ? load_f<W>(weight + (size_t)row * a.k + col) : 0.f;
        v[e] = __fadd_rn(v[e], 0.0f);  // -0.0 + 0.0 = +0.0: pruned and zero slots are never -0.0
        if (row < a.rows && grp < m_groups) a.valid[(size_t)row * (2 * m_groups) + 2 * grp + e] = kept;
      }
      (void)n_kept;
      if (row < a.rows_padded) {
        const int mt = row >> 4, rh = (row >> 3) & 1, g8 = row & 7;
        const int s = grp >> 3, ch = (grp >> 2) & 1, t = grp & 3;
        const size_t idx = (((size_t)mt * a.steps + s) * 32 + g8 * 4 + t) * 8 + (ch * 2 + rh) * 2;
        *reinterpret_cast<uint32_t*>(values + idx) = MmaType<T>::pack(MmaType<T>::from_float(v[0]), MmaType<T>::from_float(v[1]));
      }
    }
  }
#pragma unroll
  for (int i = 0; i < ROWS_PER_LANE; ++i) {
    const int row = block * V + i * 32 + lane;
    const int mt = row >> 4, rh = (row >> 3) & 1, g8 = row & 7;
    const int s = quad >> 1, c = quad & 1;
    uint16_t* m16 = reinterpret_cast<uint16_t*>(a.meta);
    m16[((((size_t)mt * a.steps + s) * 8 + g8) * 2 + c) * 2 + rh] = (uint16_t)nibbles[i];
  }
}

template <typename W, typename T, int M, int V>
cudaError_t launch(const PackArgs& a, cudaStream_t stream) {
  const long warps = (long)(a.rows_padded / V) * a.steps * 2;
  const long blocks = (warps * 32 + 127) / 128;
  pack_kernel<W, T, M, V><<<(unsigned)blocks, 128, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename W, typename T, int M>
cudaError_t dispatch_v(const PackArgs& a, cudaStream_t stream) {
  if (M == 4 || a.v == 64) return launch<W, T, M, 64>(a, stream);
  if (a.v == 128) return launch<W, T, M, 128>(a, stream);
  return cudaErrorInvalidValue;
}

template <typename W, typename T>
cudaError_t dispatch_m(const PackArgs& a, cudaStream_t stream) {
  switch (a.m) {
    case 4: return dispatch_v<W, T, 4>(a, stream);
    case 8: return dispatch_v<W, T, 8>(a, stream);
    case 16: return dispatch_v<W, T, 16>(a, stream);
    case 32: return dispatch_v<W, T, 32>(a, stream);
    case 64: return dispatch_v<W, T, 64>(a, stream);
    case 128: return dispatch_v<W, T, 128>(a, stream);
    default: return cudaErrorInvalidValue;
  }
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
