// Host side of TMA: the driver's cuTensorMapEncodeTiled, looked up once through the runtime
// (cudaGetDriverEntryPoint*), so the extension does not link libcuda itself. Shared by the sm_90a kernels that build
// tensor maps (spmm_sm90.cu, sddmm_sm90.cu).
#pragma once

#include <cuda.h>  // CUtensorMap and the cuTensorMapEncodeTiled types; the function itself comes from the runtime
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

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

}  // namespace hf_sparse
