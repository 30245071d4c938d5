// refresh_packs: rewrite the packed weights of many compact layers from their kept values in one launch; and
// gather_kept / scatter_kept: a layer's kept values out of a dense matrix (its weight gradient) and into one (a
// transient dense weight), in one pass each, reading the positions in their on-disk form (no index is kept).
//
// Why: after every optimizer step each compact layer's packs (hf_sparse.nn.compact) must follow its fp32 values: the
// fragment-ordered pack, the transposed 2:4 pack, the 2:4 view of a V:2:M weight, the bias in the compute dtype. Done
// with torch ops that is three or four launches per layer (a strided copy, an index_select per 2:4 pack, a copy),
// ~400 launches per step for BERT-large, and on a host that needs ~20 us per launch that is most of what the sparse
// step saves on the GPU. Here one launch does every layer: a table in device memory lists the work (RefreshEntry),
// block b finds its entry by binary search over the entries' first blocks.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "kernels.h"

namespace hf_sparse {
namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 4;
constexpr int64_t kPerBlock = (int64_t)kThreads * kPerThread;

__device__ __forceinline__ float load_as_float(const void* src, int64_t i, int dtype) {
  switch (dtype) {
    case kRefreshF32: return static_cast<const float*>(src)[i];
    case kRefreshBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(src)[i]);
    default: return __half2float(static_cast<const __half*>(src)[i]);
  }
}

__device__ __forceinline__ void store_float(void* dst, int64_t i, int dtype, float v) {
  switch (dtype) {
    case kRefreshF32: static_cast<float*>(dst)[i] = v; break;
    case kRefreshBF16: static_cast<__nv_bfloat16*>(dst)[i] = __float2bfloat16(v); break;
    default: static_cast<__half*>(dst)[i] = __float2half(v); break;
  }
}

// The source position of destination slot j, or -1 for a slot that reads zero.
__device__ __forceinline__ int64_t source_of(const RefreshEntry& e, int64_t j) {
  switch (e.kind) {
    case kRefreshPack: {
      // values (tiles, steps, 32, 8) seen as (tile, step, g8, t, ch, rh, k): row 16 tile + 8 rh + g8, group
      // 8 step + 4 ch + t, kept value k of the group; the source is (rows, 2 * groups) row-major
      const int64_t k = j & 1, rh = (j >> 1) & 1, ch = (j >> 2) & 1, t = (j >> 3) & 3, g8 = (j >> 5) & 7;
      const int64_t tile_step = j >> 8;
      const int64_t row = 16 * (tile_step / e.steps) + 8 * rh + g8;
      const int64_t group = 8 * (tile_step % e.steps) + 4 * ch + t;
      return (row < e.rows && group < e.groups) ? (row * e.groups + group) * 2 + k : -1;
    }
    case kRefreshGather: {
      const int64_t p = e.index_is_64 ? static_cast<const int64_t*>(e.index)[j]
                                      : (int64_t) static_cast<const int32_t*>(e.index)[j];
      return (p >= 0 && p < e.src_numel) ? p : -1;
    }
    default: return j;  // kRefreshCopy
  }
}

__device__ __forceinline__ void run_entry(const RefreshEntry& e, int64_t block) {
  const int64_t begin = block * kPerBlock;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int64_t j = begin + (int64_t)i * kThreads + threadIdx.x;
    if (j >= e.numel) return;
    const int64_t s = source_of(e, j);
    store_float(e.dst, j, e.dst_dtype, s < 0 ? 0.0f : load_as_float(e.src, s, e.src_dtype));
  }
}

__global__ void __launch_bounds__(kThreads) refresh_many_kernel(const RefreshEntry* table, int count) {
  int lo = 0, hi = count - 1;  // the entry of this block: the last with first_block <= blockIdx.x
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table[mid].first_block <= (int64_t)blockIdx.x) lo = mid;
    else hi = mid - 1;
  }
  const RefreshEntry e = table[lo];
  run_entry(e, (int64_t)blockIdx.x - e.first_block);
}

__global__ void __launch_bounds__(kThreads) refresh_one_kernel(RefreshEntry e) { run_entry(e, blockIdx.x); }

// The column (in 0 .. m * groups) of kept value k (0 .. 2 groups) of row r.
__device__ __forceinline__ int64_t kept_column(const KeptPositions& p, int64_t r, int64_t k) {
  const int code = (p.sel[r * p.sel_row_bytes + (k >> 2)] >> (2 * (k & 3))) & 3;
  const int64_t g = k >> 1;
  const int offset = p.columns == nullptr ? code : p.columns[((r / p.v) * p.groups + g) * 4 + code];
  return g * p.m + offset;
}

// One thread per kept value: dst[r, k] = src[r, kept_column(r, k)].
__global__ void __launch_bounds__(kThreads) gather_kept_kernel(const void* src, int32_t src_dtype, void* dst,
                                                                 int32_t dst_dtype, KeptPositions p) {
  const int64_t j = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  const int64_t kept = 2 * p.groups;
  if (j >= p.rows * kept) return;
  const int64_t r = j / kept;
  store_float(dst, j, dst_dtype, load_as_float(src, r * p.groups * p.m + kept_column(p, r, j - r * kept), src_dtype));
}

// One thread per dense element: dst[r, c] = the kept value at column c of row r, or zero.
__global__ void __launch_bounds__(kThreads) scatter_kept_kernel(const void* src, int32_t src_dtype, void* dst,
                                                                  int32_t dst_dtype, KeptPositions p) {
  const int64_t j = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  const int64_t cols = p.groups * p.m;
  if (j >= p.rows * cols) return;
  const int64_t r = j / cols, c = j - r * cols, k0 = 2 * (c / p.m);
  float v = 0.0f;
  if (kept_column(p, r, k0) == c) {
    v = load_as_float(src, r * 2 * p.groups + k0, src_dtype);
  } else if (kept_column(p, r, k0 + 1) == c) {
    v = load_as_float(src, r * 2 * p.groups + k0 + 1, src_dtype);
  }
  store_float(dst, j, dst_dtype, v);
}

cudaError_t launch_over(int64_t n, int64_t* blocks) {
  *blocks = (n + kThreads - 1) / kThreads;
  return *blocks >= (1LL << 31) ? cudaErrorInvalidValue : cudaSuccess;
}

}  // namespace

cudaError_t gather_kept(const void* src, int32_t src_dtype, void* dst, int32_t dst_dtype, const KeptPositions& pos,
                        cudaStream_t stream) {
  int64_t blocks = 0;
  if (launch_over(pos.rows * 2 * pos.groups, &blocks) != cudaSuccess) return cudaErrorInvalidValue;
  if (blocks == 0) return cudaSuccess;
  gather_kept_kernel<<<(unsigned)blocks, kThreads, 0, stream>>>(src, src_dtype, dst, dst_dtype, pos);
  return cudaGetLastError();
}

cudaError_t scatter_kept(const void* src, int32_t src_dtype, void* dst, int32_t dst_dtype, const KeptPositions& pos,
                         cudaStream_t stream) {
  int64_t blocks = 0;
  if (launch_over(pos.rows * pos.groups * pos.m, &blocks) != cudaSuccess) return cudaErrorInvalidValue;
  if (blocks == 0) return cudaSuccess;
  scatter_kept_kernel<<<(unsigned)blocks, kThreads, 0, stream>>>(src, src_dtype, dst, dst_dtype, pos);
  return cudaGetLastError();
}

int64_t refresh_blocks(int64_t numel) { return (numel + kPerBlock - 1) / kPerBlock; }

cudaError_t refresh_packs(const RefreshEntry* table, int count, int64_t blocks, cudaStream_t stream) {
  if (count <= 0 || blocks <= 0) return cudaSuccess;
  if (blocks >= (1LL << 31)) return cudaErrorInvalidValue;
  refresh_many_kernel<<<(unsigned)blocks, kThreads, 0, stream>>>(table, count);
  return cudaGetLastError();
}

cudaError_t refresh_one(const RefreshEntry& entry, cudaStream_t stream) {
  const int64_t blocks = refresh_blocks(entry.numel);
  if (blocks <= 0) return cudaSuccess;
  if (blocks >= (1LL << 31)) return cudaErrorInvalidValue;
  refresh_one_kernel<<<(unsigned)blocks, kThreads, 0, stream>>>(entry);
  return cudaGetLastError();
}

}  // namespace hf_sparse
