// Device helpers shared by the hf_sparse kernels: cp.async, sparse/dense mma, type traits.
// Plain CUDA C++ (no torch headers) so every kernel file compiles standalone with nvcc.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace hf_sparse {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "hf_sparse kernels need sm_80 or newer (mma.sp and cp.async)"
#endif

template <typename T> struct MmaType;
template <> struct MmaType<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(__nv_bfloat16 lo, __nv_bfloat16 hi) {
    return (uint32_t)__bfloat16_as_ushort(lo) | ((uint32_t)__bfloat16_as_ushort(hi) << 16);
  }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
  static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  // bf16 is fp32's upper half, so the shift is the whole conversion (through __bfloat162float spmv_vnm's kernel took
  // 8 more SASS instructions)
  static __device__ __forceinline__ float bits_to_float(unsigned short u) { return __uint_as_float((uint32_t)u << 16); }
};
template <> struct MmaType<__half> {
  static __device__ __forceinline__ uint32_t pack(__half lo, __half hi) {
    return (uint32_t)__half_as_ushort(lo) | ((uint32_t)__half_as_ushort(hi) << 16);
  }
  static __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
  static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
  static __device__ __forceinline__ float bits_to_float(unsigned short u) { return to_float(__ushort_as_half(u)); }
};

// D += A(sparse 16x32, 2:4) * B(32x8), fp32 accumulate. `e` is the metadata register, sparsity selector 0.
template <typename T>
__device__ __forceinline__ void mma_sp_16832(float (&d)[4], const uint4& a, const uint32_t (&b)[4], uint32_t e);

template <>
__device__ __forceinline__ void mma_sp_16832<__nv_bfloat16>(float (&d)[4], const uint4& a, const uint32_t (&b)[4],
                                                           uint32_t e) {
  asm volatile(
      "mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9,%10,%11}, {%0,%1,%2,%3}, %12, 0x0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]), "r"(e));
}

template <>
__device__ __forceinline__ void mma_sp_16832<__half>(float (&d)[4], const uint4& a, const uint32_t (&b)[4],
                                                    uint32_t e) {
  asm volatile(
      "mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9,%10,%11}, {%0,%1,%2,%3}, %12, 0x0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]), "r"(e));
}

// Dense D += A(16x16) * B(16x8), fp32 accumulate.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                        const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// 16-byte global->shared copy of `bytes` (16, or 0: zeros, nothing read) source bytes to shared address `smem`.
__device__ __forceinline__ void cp_async_16_bytes(uint32_t smem, const void* gmem, uint32_t bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(bytes));
}
// The same from a generic pointer; `valid == false` writes zeros (so padding past K or past the tokens reads 0).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  cp_async_16_bytes((uint32_t)__cvta_generic_to_shared(smem), gmem, valid ? 16u : 0u);
}
// One arrival on the mbarrier at shared address `bar` once this thread's cp.asyncs so far have landed, not counted
// in advance (.noinc: the barrier's expected count includes it).
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ldmatrix x4 (optionally transposed): four 8x8 b16 matrices, row addresses from lanes 0-7, 8-15, 16-23, 24-31.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

// SpMM epilogue, shared by the mma.sp and wgmma kernels. Both leave each lane with (row r, tokens n, n+1) of Y^T;
// Y is stored token-major, so lanes g and g^1 (xor 4) swap halves and each lane writes rows r_even, r_even+1 of one
// token with a single 32-bit store (two 16-bit stores at an odd row count or the last row).
template <typename T>
__device__ __forceinline__ void load_bias_pair(const T* __restrict__ bias, int r_even, int rows, float& b0, float& b1) {
  b0 = 0.f;
  b1 = 0.f;
  if (bias != nullptr) {
    if (r_even < rows) b0 = MmaType<T>::to_float(bias[r_even]);
    if (r_even + 1 < rows) b1 = MmaType<T>::to_float(bias[r_even + 1]);
  }
}

// Activation applied in the epilogue, after the bias and before the cast (SpmmArgs::act): kActNone, or kActGelu, the
// exact (erf) GELU of torch.nn.functional.gelu / Transformers' "gelu", in fp32 on the accumulator. Fusing it saves
// the separate pass over Y that a model's activation would otherwise make (HF BERT's intermediate layer).
constexpr int kActNone = 0, kActGelu = 1;
template <int ACT>
__device__ __forceinline__ float activate(float v) {
  if constexpr (ACT == kActGelu) {
    return 0.5f * v * (1.f + erff(v * 0.70710678118654752440f));
  } else {
    return v;
  }
}

// v0, v1: my row's tokens n_pair, n_pair+1. The even lane of a pair keeps token n_pair and receives the odd lane's
// value of it; the odd lane keeps token n_pair+1. Every lane must call it (shuffle) before any of them returns; keep:
// whether it stores (the same in every lane of the warp: a split that does not own the chunk only shuffles).
template <typename T, int ACT = kActNone>
__device__ __forceinline__ void store_row_pair(T* __restrict__ y, float v0, float v1, bool odd, int n_pair, int r_even,
                                               float b0, float b1, int rows, int n_tokens, bool keep = true) {
  const float send = odd ? v0 : v1;
  const float recv = __shfl_xor_sync(0xffffffffu, send, 4);
  const float lo = odd ? recv : v0;  // row r_even
  const float hi = odd ? v1 : recv;  // row r_even + 1
  const int n = n_pair + (odd ? 1 : 0);
  if (!keep || n >= n_tokens) return;
  T* dst = y + (size_t)n * rows + r_even;
  const T o0 = MmaType<T>::from_float(activate<ACT>(lo + b0)), o1 = MmaType<T>::from_float(activate<ACT>(hi + b1));
  if (r_even + 1 < rows && (rows & 1) == 0) {
    *reinterpret_cast<uint32_t*>(dst) = MmaType<T>::pack(o0, o1);
  } else {
    if (r_even < rows) dst[0] = o0;
    if (r_even + 1 < rows) dst[1] = o1;
  }
}

}  // namespace hf_sparse
