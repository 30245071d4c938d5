// V:2:M product of one token on the CUDA cores: y (R) = W x (+ bias), where tile_config.h sm90_vnm_gemv takes it,
// reading the tensor-core pack (pack.cu) in place.
//
// Why: at one token the product is a pass over the weight's bytes. The sparse-wgmma kernel pads the token to a
// 16-token tile and each of its warps runs a long chain of dependent gather instructions per k-tile with few warps
// resident. Here each weight value costs a handful of independent integer instructions and one FMA, with 32 warps per
// SM. It is faster where its grid fits one wave (the figures: tile_config.h sm90_vnm_gemv); neither form reaches the
// DRAM rate (~2 TB/s of weight bytes at 8192 -> 28672, against cuBLAS's ~3.7 TB/s dense).
//
// Work: one CTA per 16-row m-tile, its 16 warps taking the m-tile's k-steps in turn (warp w: steps w, w + 16, ...), two
// steps' loads issued before either is used. Per step a lane reads the 16-byte fragment slot (g8, t) of the pack: rows
// g8 and g8 + 8, groups 8s + t and 8s + 4 + t, two values each; the row's 2-bit positions (its metadata nibble) pick
// two of the group's 4 kept columns (the slab's column bytes), and each value multiplies x at that column (x stays in
// L1; the weight is read once, without allocating in L1). Lanes of one row add their sums with two shuffles, the 16
// warps' sums meet in shared memory, and 16 threads add the bias and store y.
// Groups past K (the last step's padding, whose values are zero) are skipped, so nothing past x is read.

#include "common.cuh"
#include "kernels.h"
#include "tile_config.h"

namespace hf_sparse {
namespace {

constexpr int kGemvWarps = 16;

__device__ __forceinline__ uint4 load_streamed(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// One k-step of a lane's slot: the fragment words, the metadata of its two (group, row) pairs per group, the two
// groups' column bytes.
struct GemvStep {
  uint4 v;
  uint2 meta;
  uint32_t cols[2];
};

__device__ __forceinline__ void load_step(GemvStep& st, const uint4* vals, const uint2* meta, const uint32_t* cols,
                                          int s) {
  st.v = load_streamed(vals + (size_t)s * 32);
  st.meta = __ldg(meta + (size_t)s * 8);
  st.cols[0] = __ldg(cols + (size_t)s * 8);
  st.cols[1] = __ldg(cols + (size_t)s * 8 + 4);
}

template <typename T>
__device__ __forceinline__ void run_step(const GemvStep& st, int s, int t, int groups, int m,
                                         const unsigned short* __restrict__ x, float (&acc)[2]) {
  const uint32_t words[4] = {st.v.x, st.v.y, st.v.z, st.v.w};
  const uint32_t meta[2] = {st.meta.x, st.meta.y};
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const int g = 8 * s + 4 * c + t;
    if (g >= groups) continue;
    const int base = g * m;
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      const uint32_t nib = meta[c] >> (16 * rh + 4 * t);
      const int i0 = base + (int)__byte_perm(st.cols[c], 0, 0x4440u | (nib & 3u));
      const int i1 = base + (int)__byte_perm(st.cols[c], 0, 0x4440u | ((nib >> 2) & 3u));
      const uint32_t w = words[2 * c + rh];
      acc[rh] = fmaf(MmaType<T>::bits_to_float((unsigned short)w), MmaType<T>::bits_to_float(__ldg(x + i0)), acc[rh]);
      acc[rh] = fmaf(MmaType<T>::bits_to_float((unsigned short)(w >> 16)), MmaType<T>::bits_to_float(__ldg(x + i1)),
                     acc[rh]);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kGemvWarps * 32, kVnmGemvCtasPerSm) spmv_vnm_kernel(const SpmmArgs a) {
  const int mt = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g8 = lane >> 2, t = lane & 3;
  const int groups = a.k / a.m, steps = a.steps;
  const size_t tile = (size_t)mt * steps;
  const uint4* vals = reinterpret_cast<const uint4*>(a.values) + tile * 32 + lane;
  const uint2* meta = reinterpret_cast<const uint2*>(a.meta) + tile * 8 + g8;
  const uint32_t* cols = reinterpret_cast<const uint32_t*>(a.columns) + (size_t)(mt >> 2) * steps * 8 + t;
  const unsigned short* x = reinterpret_cast<const unsigned short*>(a.x);
  float acc[2] = {0.f, 0.f};  // rows g8 and g8 + 8 of the m-tile
  for (int s = warp; s < steps; s += 2 * kGemvWarps) {
    const int s2 = s + kGemvWarps;
    GemvStep first, second;
    load_step(first, vals, meta, cols, s);
    if (s2 < steps) load_step(second, vals, meta, cols, s2);
    run_step<T>(first, s, t, groups, a.m, x, acc);
    if (s2 < steps) run_step<T>(second, s2, t, groups, a.m, x, acc);
  }
  __shared__ float part[kGemvWarps][16];
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    float v = acc[rh];
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    if (t == 0) part[warp][8 * rh + g8] = v;
  }
  __syncthreads();
  const int r = threadIdx.x, row = mt * 16 + r;
  if (r >= 16 || row >= a.rows) return;
  float sum = 0.f;
#pragma unroll
  for (int w = 0; w < kGemvWarps; ++w) sum += part[w][r];
  if (a.bias != nullptr) sum += MmaType<T>::to_float(static_cast<const T*>(a.bias)[row]);
  static_cast<T*>(a.y)[row] = MmaType<T>::from_float(sum);
}

template <typename T>
cudaError_t launch_gemv(const SpmmArgs& a, cudaStream_t stream) {
  spmv_vnm_kernel<T><<<a.rows_padded / 16, kGemvWarps * 32, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t spmv_vnm(const SpmmArgs& a, cudaStream_t stream) {
  if (a.m < 8 || a.act != kActNone || a.n_tokens > kVnmGemvMaxTokens) return cudaErrorInvalidValue;
  if (a.n_tokens <= 0 || a.rows <= 0) return cudaSuccess;
  return a.is_bf16 ? launch_gemv<__nv_bfloat16>(a, stream) : launch_gemv<__half>(a, stream);
}

}  // namespace hf_sparse
