// The V:2:M sparse-wgmma SpMM's X^T path (spmm_vnm_xt_sm90.cuh: the kernel and why): its bf16 kernels and the host
// entry points of kernels.h (whether a call takes the path, its plan, its X^T scratch, the launch). The fp16 kernels
// compile in spmm_vnm_xt_sm90_fp16.cu.

#include <vector>

#include "spmm_vnm_xt_sm90.cuh"
#if defined(HF_SPARSE_LAB)
#include "lab.h"
#endif

namespace hf_sparse {

// Whether a call takes the X^T path: tile_config.h sm90_vnm_xt (the lab build's vnm_xt knob forces it on or off).
bool spmm_vnm_sm90_takes_xt(const SpmmArgs& a) {
  if (a.m < 8 || a.n_tokens <= 0) return false;
#if defined(HF_SPARSE_LAB)
  const int forced = lab::tuning().vnm_xt.load(std::memory_order_relaxed);
  if (forced >= 0) return forced == 1;
#endif
  return sm90_vnm_xt(a.m, a.n_tokens, a.rows, a.k, a.v);
}

// The X^T path's work units: 128-row x (256, 128 or 64)-token tiles, each split along K (tile_config.h
// sm90_vnm_xt_plan; the launch takes 1 split where the binding passed no split-K scratch).
Sm90SplitPlan spmm_vnm_xt_sm90_split(const SpmmArgs& a, int sms) {
  Sm90SplitPlan p = sm90_vnm_xt_plan(a.rows_padded, a.n_tokens, (a.steps + 1) / 2, sms);
#if defined(HF_SPARSE_LAB)
  p.splits = lab::split_k_or(p.splits, p.tiles, (a.steps + 1) / 2);
#endif
  return p;
}

#if defined(HF_SPARSE_TIMELINE)
// Each dtype's kernels sum into the counters of their own translation unit; a call runs one dtype, so a CTA's row is
// the sum of both units' rows (the other one's are zero).
int spmm_vnm_xt_sm90_timeline(unsigned long long* host, int ctas) {
  const int n = read_and_clear_rows(host, g_xt_counters, ctas);
  if (n < 0) return n;
  std::vector<unsigned long long> fp16((size_t)n * kXtCounters);
  if (spmm_vnm_xt_sm90_fp16_timeline(fp16.data(), n) != n) return -1;
  for (size_t i = 0; i < fp16.size(); ++i) host[i] += fp16[i];
  return n;
}
int spmm_vnm_xt_sm90_timeline_counters() { return kXtCounters; }
#endif

int64_t spmm_vnm_xt_sm90_elems(const SpmmArgs& a) {
  return (int64_t)a.k * xt_ld(a) + kVnmXtBN;  // + a tile's tokens: the zero-byte copies past the last row stay inside
}

cudaError_t spmm_vnm_xt_sm90(const SpmmArgs& a, const SpmmPlan& plan, cudaStream_t stream) {
  if (a.xt == nullptr || !plan.xt) return cudaErrorInvalidValue;
  return a.is_bf16 ? dispatch_m<__nv_bfloat16>(a, plan.split, stream) : spmm_vnm_xt_sm90_fp16(a, plan.split, stream);
}

}  // namespace hf_sparse
