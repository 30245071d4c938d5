// apply_masks: zero the pruned entries of many tensors in one launch (the pruner's masking of every weight after each
// optimizer step, and of each gradient after backward).
//
// Why not torch: `torch.where(mask, w, zero, out=w)` broadcasts its 0-dim zero, which sends TensorIterator down its
// non-vectorised path: ~1.5 ms of kernel time per pass over BERT-large's 302M fp32 weights on an H200, and one launch
// (10-15 us of host time) per tensor (benchmarks/bench_apply_mask.py). Here each block masks a 16K-element chunk of one
// tensor with 16-byte loads of the values and 4- or 8-byte loads of the bool mask, and one launch covers up to
// kMaxMaskTensors tensors of one element size. The kernel works on raw bits: a pruned entry becomes all-zero bits,
// i.e. +0.0 in every float format (never the -0.0 that w * mask leaves).
#include <stdint.h>

#include "kernels.h"

namespace hf_sparse {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = 16384;  // elements per block

template <typename E>  // E: an unsigned integer of the element's size (the values are only ever copied or zeroed)
__device__ __forceinline__ void mask_scalar(E* data, const uint8_t* mask, int64_t n) {
  for (int64_t i = threadIdx.x; i < n; i += kThreads)
    if (mask[i] == 0) data[i] = 0;
}

template <typename E>
__global__ void __launch_bounds__(kThreads) apply_masks_kernel(MaskBatch b) {
  int lo = 0, hi = b.count - 1;  // the tensor of this block: last t with first_block[t] <= blockIdx.x
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (b.first_block[mid] <= (int)blockIdx.x) lo = mid;
    else hi = mid - 1;
  }
  const int t = lo;
  const int64_t begin = (int64_t)(blockIdx.x - b.first_block[t]) * kChunk;
  const int64_t n = b.numel[t] - begin < kChunk ? b.numel[t] - begin : kChunk;
  E* data = static_cast<E*>(b.data[t]) + begin;
  const uint8_t* mask = b.mask[t] + begin;
  constexpr int V = 16 / sizeof(E);  // elements per 16-byte load: 4 (fp32) or 8 (bf16 / fp16)
  if (!b.aligned[t]) {               // data not 16-byte or mask not V-byte aligned: element by element
    mask_scalar(data, mask, n);
    return;
  }
  const int64_t nv = n / V;  // chunk starts are multiples of kChunk, so alignment holds for every chunk
  uint4* d4 = reinterpret_cast<uint4*>(data);
  for (int64_t i = threadIdx.x; i < nv; i += kThreads) {
    uint4 v = d4[i];
    uint64_t m;  // V mask bytes
    if constexpr (V == 4) m = reinterpret_cast<const uint32_t*>(mask)[i];
    else m = reinterpret_cast<const uint64_t*>(mask)[i];
    uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (V == 4) {
        if (((m >> (8 * j)) & 0xFFu) == 0) w[j] = 0u;
      } else {  // two 16-bit elements per word
        const uint32_t keep_lo = ((m >> (16 * j)) & 0xFFu) ? 0x0000FFFFu : 0u;
        const uint32_t keep_hi = ((m >> (16 * j + 8)) & 0xFFu) ? 0xFFFF0000u : 0u;
        w[j] &= keep_lo | keep_hi;
      }
    }
    d4[i] = make_uint4(w[0], w[1], w[2], w[3]);
  }
  mask_scalar(data + nv * V, mask + nv * V, n - nv * V);
}

}  // namespace

int64_t apply_masks_chunk() { return kChunk; }

cudaError_t apply_masks(const MaskBatch& b, cudaStream_t stream) {
  if (b.count == 0 || b.blocks == 0) return cudaSuccess;
  if (b.count > kMaxMaskTensors) return cudaErrorInvalidValue;
  switch (b.elem_size) {
    case 2: apply_masks_kernel<uint16_t><<<b.blocks, kThreads, 0, stream>>>(b); break;
    case 4: apply_masks_kernel<uint32_t><<<b.blocks, kThreads, 0, stream>>>(b); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace hf_sparse
