// Mask selection on the GPU: which weights an N:M, V:N:M or transposable 2:4 mask keeps, from an fp32 importance
// score (rows x cols, row-major). Each kernel computes exactly the mask of hf_sparse.masks' torch reference,
// tie-breaking included (the lower index wins; for the transposable search, the first of the 90 patterns in the
// table the caller passes), so CPU and GPU masks agree. Why kernels: the torch forms sort every group (N:M), reduce
// and sort twice (V:N:M) or loop over chunks of a float64 matmul (transposable), which costs seconds per mask update
// of a BERT-large-sized model on a GPU; here each is one or three launches over the score.
//
//   nm:           one thread per entry: its rank in its group of m (entries above it, or equal and to its left);
//                 kept when the rank is below n.
//   vnm:          (1) one thread per (row block, column): the column's score summed over the block's v rows in
//                 float64; (2) one thread per (row block, column): its rank among its group's sums (like nm), the
//                 keep_cols best set their bits in the group's bitmask; (3) one thread per entry: kept when its
//                 column is in the bitmask and its rank among the row's kept columns is below n.
//   transposable: one thread per 4x4 block: the float64 total of each of the 90 patterns, the first best wins.
#include <stdint.h>

#include "kernels.h"

namespace hf_sparse {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ bool beats(float other, float self, int other_index, int self_index) {
  return other > self || (other == self && other_index < self_index);
}

__global__ void __launch_bounds__(kThreads) nm_kernel(const float* __restrict__ score, bool* __restrict__ out,
                                                      int64_t total, int cols, int n, int m) {
  const int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  if (i >= total) return;
  const int col = (int)(i % cols), first = col - col % m;
  const float* group = score + (i - (col - first));
  const float self = score[i];
  int rank = 0;
  for (int j = 0; j < m; ++j) rank += beats(group[j], self, first + j, col);
  out[i] = rank < n;
}

__global__ void __launch_bounds__(kThreads) column_sums_kernel(const float* __restrict__ score,
                                                               double* __restrict__ sums, int rows, int cols, int v) {
  const int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x;  // (row block, column)
  if (i >= (int64_t)(rows / v) * cols) return;
  const int block = (int)(i / cols), col = (int)(i % cols);
  const float* p = score + (int64_t)block * v * cols + col;
  double sum = 0.0;
  for (int r = 0; r < v; ++r) sum += (double)p[(int64_t)r * cols];
  sums[i] = sum;
}

// `bits` zeroed by the caller.
__global__ void __launch_bounds__(kThreads) kept_columns_kernel(const double* __restrict__ sums,
                                                                uint32_t* __restrict__ bits, int64_t columns_total,
                                                                int m, int keep_cols) {
  const int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x;  // (row block, group, column in the group)
  if (i >= columns_total) return;
  const int c = (int)(i % m);
  const double* s = sums + (i - c);
  const double self = s[c];
  int rank = 0;
  for (int j = 0; j < m; ++j) rank += s[j] > self || (s[j] == self && j < c);
  if (rank < keep_cols) atomicOr(bits + (i / m) * ((m + 31) / 32) + c / 32, 1u << (c % 32));
}

__global__ void __launch_bounds__(kThreads) vnm_kernel(const float* __restrict__ score,
                                                       const uint32_t* __restrict__ bits, bool* __restrict__ out,
                                                       int64_t total, int cols, int v, int n, int m, int keep_cols) {
  const int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  if (i >= total) return;
  const int row = (int)(i / cols), col = (int)(i % cols), group = col / m, first = group * m, c = col - first;
  const int words = (m + 31) / 32;
  const uint32_t* kept = bits + ((int64_t)(row / v) * (cols / m) + group) * words;
  bool keep = (kept[c / 32] >> (c % 32)) & 1u;
  if (keep && n < keep_cols) {
    const float* g = score + (i - c);
    const float self = g[c];
    int rank = 0;
    for (int w = 0; w < words; ++w)
      for (uint32_t word = kept[w]; word != 0u; word &= word - 1u) {
        const int j = w * 32 + __ffs(word) - 1;
        rank += beats(g[j], self, j, c);
      }
    keep = rank < n;
  }
  out[i] = keep;
}

__global__ void __launch_bounds__(kThreads) transposable_kernel(const float* __restrict__ score,
                                                                const uint16_t* __restrict__ patterns,
                                                                bool* __restrict__ out, int rows, int cols) {
  const int64_t b = (int64_t)blockIdx.x * kThreads + threadIdx.x;  // 4x4 block, row-major over the block grid
  const int block_cols = cols / 4;
  if (b >= (int64_t)(rows / 4) * block_cols) return;
  const int64_t r0 = (b / block_cols) * 4, c0 = (b % block_cols) * 4;
  double s[16];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const float4 q = *reinterpret_cast<const float4*>(score + (r0 + r) * cols + c0);
    s[4 * r] = q.x;
    s[4 * r + 1] = q.y;
    s[4 * r + 2] = q.z;
    s[4 * r + 3] = q.w;
  }
  int best = 0;
  double best_total = 0.0;
  for (int p = 0; p < 90; ++p) {
    const uint32_t bitsp = patterns[p];  // bit k: entry k of the row-major 4x4 block is kept
    double total = 0.0;
#pragma unroll
    for (int k = 0; k < 16; ++k)
      if ((bitsp >> k) & 1u) total += s[k];
    if (p == 0 || total > best_total) {
      best = p;
      best_total = total;
    }
  }
  const uint32_t keep = patterns[best];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    uchar4 row;
    row.x = (keep >> (4 * r)) & 1u;
    row.y = (keep >> (4 * r + 1)) & 1u;
    row.z = (keep >> (4 * r + 2)) & 1u;
    row.w = (keep >> (4 * r + 3)) & 1u;
    *reinterpret_cast<uchar4*>(out + (r0 + r) * cols + c0) = row;
  }
}

unsigned blocks_for(int64_t threads) { return (unsigned)((threads + kThreads - 1) / kThreads); }

}  // namespace

cudaError_t nm_mask(const float* score, bool* out, int rows, int cols, int n, int m, cudaStream_t stream) {
  const int64_t total = (int64_t)rows * cols;
  if (total == 0) return cudaSuccess;
  nm_kernel<<<blocks_for(total), kThreads, 0, stream>>>(score, out, total, cols, n, m);
  return cudaGetLastError();
}

cudaError_t vnm_mask(const float* score, double* sums, uint32_t* bits, bool* out, int rows, int cols, int v, int n,
                     int m, int keep_cols, cudaStream_t stream) {
  const int64_t total = (int64_t)rows * cols;
  if (total == 0) return cudaSuccess;
  column_sums_kernel<<<blocks_for((int64_t)(rows / v) * cols), kThreads, 0, stream>>>(score, sums, rows, cols, v);
  const int64_t columns_total = (int64_t)(rows / v) * cols;
  cudaError_t err = cudaMemsetAsync(bits, 0, (size_t)(rows / v) * (cols / m) * ((m + 31) / 32) * 4, stream);
  if (err != cudaSuccess) return err;
  kept_columns_kernel<<<blocks_for(columns_total), kThreads, 0, stream>>>(sums, bits, columns_total, m, keep_cols);
  vnm_kernel<<<blocks_for(total), kThreads, 0, stream>>>(score, bits, out, total, cols, v, n, m, keep_cols);
  return cudaGetLastError();
}

cudaError_t transposable_2to4_mask(const float* score, const uint16_t* patterns, bool* out, int rows, int cols,
                                   cudaStream_t stream) {
  const int64_t blocks = (int64_t)(rows / 4) * (cols / 4);
  if (blocks == 0) return cudaSuccess;
  transposable_kernel<<<blocks_for(blocks), kThreads, 0, stream>>>(score, patterns, out, rows, cols);
  return cudaGetLastError();
}

}  // namespace hf_sparse
