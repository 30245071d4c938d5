// The X^T path's fp16 kernels (spmm_vnm_xt_sm90.cuh), in a translation unit of their own so that the build compiles
// them in parallel with the bf16 ones (spmm_vnm_xt_sm90.cu, which calls these).

#include "spmm_vnm_xt_sm90.cuh"

namespace hf_sparse {

cudaError_t spmm_vnm_xt_sm90_fp16(const SpmmArgs& a, const Sm90SplitPlan& plan, cudaStream_t stream) {
  return dispatch_m<__half>(a, plan, stream);
}

#if defined(HF_SPARSE_TIMELINE)
// This unit's counters (spmm_vnm_xt_sm90_timeline adds them to the bf16 unit's).
int spmm_vnm_xt_sm90_fp16_timeline(unsigned long long* host, int ctas) {
  return read_and_clear_rows(host, g_xt_counters, ctas);
}
#endif

}  // namespace hf_sparse
