// The V:2:M X^T path's transpose of X (spmm_vnm_xt_sm90.cu launches it before its GEMM); torch-free, so
// benchmarks/transpose_bench.cu times the same kernel against a device copy of the same bytes.
#pragma once

#include <cstddef>
#include <cstdint>

namespace hf_sparse {

// X (n_tokens x k) -> X^T (k x ld), tokens n_tokens .. ld - 1 zero: 64 x 64 tiles through shared memory, 16-byte
// loads and stores (k % 8 == 0, ld % 8 == 0).
template <typename T>
__global__ void __launch_bounds__(256) transpose_tokens_kernel(const T* __restrict__ x, T* __restrict__ xt,
                                                               int n_tokens, int k, int ld) {
  __shared__ uint32_t tile[64][33];  // [token][column pair]: 33 words a row, so a column read spreads over the banks
  const int c0 = blockIdx.x * 64, n0 = blockIdx.y * 64, tid = threadIdx.x;
#pragma unroll
  for (int i = tid; i < 512; i += 256) {
    const int r = i >> 3, ch = i & 7, n = n0 + r, c = c0 + ch * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (n < n_tokens && c < k) v = *reinterpret_cast<const uint4*>(x + (size_t)n * k + c);
    tile[r][4 * ch] = v.x;
    tile[r][4 * ch + 1] = v.y;
    tile[r][4 * ch + 2] = v.z;
    tile[r][4 * ch + 3] = v.w;
  }
  __syncthreads();
#pragma unroll
  for (int i = tid; i < 512; i += 256) {
    const int cr = i >> 3, ch = i & 7, c = c0 + cr, n = n0 + ch * 8;
    if (c >= k || n >= ld) continue;
    const int half = 16 * (cr & 1);
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      w[j] = ((tile[ch * 8 + 2 * j][cr >> 1] >> half) & 0xFFFFu) | ((tile[ch * 8 + 2 * j + 1][cr >> 1] >> half) << 16);
    *reinterpret_cast<uint4*>(xt + (size_t)c * ld + n) = make_uint4(w[0], w[1], w[2], w[3]);
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // This CTA is done: once every CTA is, the GEMM launched after it as a programmatic dependent may start its set-up
  // (it waits for this grid's completion before it reads X^T). At the end, so the GEMM's CTAs, which take a whole SM,
  // never wait on SMs the transpose still needs.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace hf_sparse
