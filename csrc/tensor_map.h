// Host side of TMA: the driver's cuTensorMapEncodeTiled, looked up once through the runtime
// (cudaGetDriverEntryPoint*), so the extension does not link libcuda itself. Shared by the sm_90a kernels that build
// tensor maps (spmm_sm90.cu, spmm_vnm_xt_sm90.cu, sddmm_sm90.cu), with the map of Y their staged epilogues store
// through.
#pragma once

#include <cuda.h>  // CUtensorMap and the cuTensorMapEncodeTiled types; the function itself comes from the runtime
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include "kernels.h"

namespace hf_sparse {

// nullptr if the driver does not provide it.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = []() -> PFN_cuTensorMapEncodeTiled_v12000 {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                                             cudaEnableDefault, &status);
#else
    const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &ptr, cudaEnableDefault, &status);
#endif
    if (err != cudaSuccess || status != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// Tensor map of Y (n_tokens x rows, row-major) for the staged epilogue's TMA stores: boxes of 64 rows x box_tokens
// tokens, 128-byte swizzle. False where TMA cannot address Y (rows % 8 != 0: the row stride is not a multiple of 16
// bytes; unaligned base) or the driver refuses: the caller takes a configuration with direct stores.
inline bool encode_y_map(const SpmmArgs& a, int box_tokens, CUtensorMap* map) {
  if (reinterpret_cast<uintptr_t>(a.y) % 16 != 0 || a.rows % 8 != 0) return false;
  PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {(cuuint64_t)a.rows, (cuuint64_t)a.n_tokens};
  const cuuint64_t strides[1] = {(cuuint64_t)a.rows * 2};
  const cuuint32_t box[2] = {64, (cuuint32_t)box_tokens};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult res =
      encode(map, a.is_bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, a.y, dims,
             strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS;
}

}  // namespace hf_sparse
