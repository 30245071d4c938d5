// V:2:M product of 1-4 tokens on the CUDA cores: Y = X W^T (+ bias), where tile_config.h sm90_vnm_gemv takes it,
// reading the tensor-core pack (pack.cu) in place.
//
// Why: at a few tokens the product is a pass over the weight's bytes. The sparse-wgmma kernel pads the tokens to a
// 16-token tile and each of its warps runs a long chain of dependent gather instructions per k-tile with few warps
// resident. Here each weight value costs a handful of independent integer instructions and one FMA per token, with 32
// warps per SM. It is faster where its grid fits one wave (the figures: tile_config.h sm90_vnm_gemv); neither form
// reaches the DRAM rate (~2 TB/s of weight bytes at 8192 -> 28672, against cuBLAS's ~3.7 TB/s dense).
//
// Work: one CTA per 16-row m-tile, its 16 warps taking the m-tile's k-steps in turn (warp w: steps w, w + 16, ...).
// Per step a lane reads the 16-byte fragment slot (g8, t) of the pack: rows g8 and g8 + 8, groups 8s + t and
// 8s + 4 + t, two values each; the row's 2-bit positions (its metadata nibble) pick two of the group's 4 kept columns
// (the slab's column bytes), and each value multiplies X at that column for each token (the weight is read once,
// without allocating in L1). Lanes of one row add their sums with two shuffles, the 16 warps' sums meet in shared
// memory, and 16 threads per token add the bias and store Y. Groups past K (the last step's padding, whose values are
// zero) are skipped, so nothing past X is read.
// - One token (spmv_vnm_kernel): x stays in L1; two steps' loads are issued before either is used.
// - 2-4 tokens (spmv_vnm_smem_kernel): each X element feeds as many FMAs as there are tokens, so X is copied into
//   shared memory first (cp.async, overlapping the first weight loads), and each warp keeps gemv_ahead(tokens) steps'
//   loads in flight.

#include "common.cuh"
#include "kernels.h"
#include "launch.h"
#include "tile_config.h"

namespace hf_sparse {
namespace {

constexpr int kGemvWarps = 16;
// k-steps a warp of the shared-memory form has in flight: the most whose registers fit the 64-register cap of
// kVnmGemvCtasPerSm CTAs per SM without spilling (one more spills at every token count).
__host__ __device__ constexpr int gemv_ahead(int tokens) { return tokens <= 2 ? 3 : 2; }

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

// One step's values times X: NT tokens, X in shared memory (row n at x + n * k) or, at one token, read through L1.
template <typename T, int NT, bool kXShared>
__device__ __forceinline__ void run_step(const GemvStep& st, int s, int t, int groups, int m, int k,
                                         const unsigned short* __restrict__ x, float (&acc)[NT][2]) {
  static_assert(kXShared || NT == 1, "more than one token reads X from shared memory");
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
      const float w0 = MmaType<T>::bits_to_float((unsigned short)w);
      const float w1 = MmaType<T>::bits_to_float((unsigned short)(w >> 16));
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const unsigned short x0 = kXShared ? x[n * k + i0] : __ldg(x + i0);
        const unsigned short x1 = kXShared ? x[n * k + i1] : __ldg(x + i1);
        acc[n][rh] = fmaf(w0, MmaType<T>::bits_to_float(x0), acc[n][rh]);
        acc[n][rh] = fmaf(w1, MmaType<T>::bits_to_float(x1), acc[n][rh]);
      }
    }
  }
}

// The m-tile's rows of Y: each warp's per-row sums (two shuffles across a row's 4 lanes) meet in `part`, and 16
// threads per token add them, the bias, and store.
template <typename T, int NT>
__device__ __forceinline__ void store_rows(const SpmmArgs& a, int mt, const float (&acc)[NT][2],
                                           float (*part)[NT][16]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g8 = lane >> 2, t = lane & 3;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      float v = acc[n][rh];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      if (t == 0) part[warp][n][8 * rh + g8] = v;
    }
  }
  __syncthreads();
  const int n = threadIdx.x >> 4, r = threadIdx.x & 15, row = mt * 16 + r;
  if (n >= NT || row >= a.rows) return;
  float sum = 0.f;
#pragma unroll
  for (int w = 0; w < kGemvWarps; ++w) sum += part[w][n][r];
  if (a.bias != nullptr) sum += MmaType<T>::to_float(static_cast<const T*>(a.bias)[row]);
  static_cast<T*>(a.y)[(size_t)n * a.rows + row] = MmaType<T>::from_float(sum);
}

// The m-tile's slots in the pack, for the lane.
struct GemvSlots {
  const uint4* vals;
  const uint2* meta;
  const uint32_t* cols;
  __device__ GemvSlots(const SpmmArgs& a, int mt, int lane) {
    const size_t tile = (size_t)mt * a.steps;
    vals = reinterpret_cast<const uint4*>(a.values) + tile * 32 + lane;
    meta = reinterpret_cast<const uint2*>(a.meta) + tile * 8 + (lane >> 2);
    cols = reinterpret_cast<const uint32_t*>(a.columns) + (size_t)(mt >> 2) * a.steps * 8 + (lane & 3);
  }
};

template <typename T>
__global__ void __launch_bounds__(kGemvWarps * 32, kVnmGemvCtasPerSm) spmv_vnm_kernel(const SpmmArgs a) {
  __shared__ float part[kGemvWarps][1][16];
  const int mt = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  const int groups = a.k / a.m, steps = a.steps;
  const GemvSlots p(a, mt, lane);
  const unsigned short* x = reinterpret_cast<const unsigned short*>(a.x);
  float acc[1][2] = {{0.f, 0.f}};  // rows g8 and g8 + 8 of the m-tile
  for (int s = warp; s < steps; s += 2 * kGemvWarps) {
    const int s2 = s + kGemvWarps;
    GemvStep first, second;
    load_step(first, p.vals, p.meta, p.cols, s);
    if (s2 < steps) load_step(second, p.vals, p.meta, p.cols, s2);
    run_step<T, 1, false>(first, s, t, groups, a.m, a.k, x, acc);
    if (s2 < steps) run_step<T, 1, false>(second, s2, t, groups, a.m, a.k, x, acc);
  }
  store_rows<T, 1>(a, mt, acc, part);
}

template <typename T, int NT>
__global__ void __launch_bounds__(kGemvWarps * 32, kVnmGemvCtasPerSm) spmv_vnm_smem_kernel(const SpmmArgs a) {
  __shared__ float part[kGemvWarps][NT][16];
  extern __shared__ __align__(16) unsigned short xs[];  // X, NT x K
  const int mt = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  const int groups = a.k / a.m, steps = a.steps;
  const GemvSlots p(a, mt, lane);
  constexpr int kAhead = gemv_ahead(NT);
  GemvStep ahead[kAhead];
#pragma unroll
  for (int j = 0; j < kAhead; ++j)
    if (warp + j * kGemvWarps < steps) load_step(ahead[j], p.vals, p.meta, p.cols, warp + j * kGemvWarps);
  const char* x = static_cast<const char*>(a.x);
  for (int c = threadIdx.x; c < NT * a.k / 8; c += kGemvWarps * 32) cp_async_16(xs + 8 * c, x + 16 * c, true);
  cp_async_wait_all();
  __syncthreads();
  float acc[NT][2];  // per token, rows g8 and g8 + 8 of the m-tile
#pragma unroll
  for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = 0.f;
  for (int s0 = warp; s0 < steps; s0 += kAhead * kGemvWarps) {
#pragma unroll
    for (int j = 0; j < kAhead; ++j) {
      const int s = s0 + j * kGemvWarps, next = s + kAhead * kGemvWarps;
      if (s >= steps) break;
      const GemvStep st = ahead[j];
      if (next < steps) load_step(ahead[j], p.vals, p.meta, p.cols, next);
      run_step<T, NT, true>(st, s, t, groups, a.m, a.k, xs, acc);
    }
  }
  store_rows<T, NT>(a, mt, acc, part);
}

template <typename T, int NT>
cudaError_t launch_gemv_smem(const SpmmArgs& a, cudaStream_t stream) {
  const cudaError_t err = raise_smem_limit_once<spmv_vnm_smem_kernel<T, NT>>(sm90_vnm_gemv_smem(kVnmGemvMaxK));
  if (err != cudaSuccess) return err;
  spmv_vnm_smem_kernel<T, NT><<<a.rows_padded / 16, kGemvWarps * 32, sm90_vnm_gemv_smem(NT * a.k), stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_gemv(const SpmmArgs& a, cudaStream_t stream) {
  switch (a.n_tokens) {
    case 1:
      spmv_vnm_kernel<T><<<a.rows_padded / 16, kGemvWarps * 32, 0, stream>>>(a);
      return cudaGetLastError();
    case 2: return launch_gemv_smem<T, 2>(a, stream);
    case 3: return launch_gemv_smem<T, 3>(a, stream);
    default: return launch_gemv_smem<T, 4>(a, stream);
  }
}

}  // namespace

cudaError_t spmv_vnm(const SpmmArgs& a, cudaStream_t stream) {
  if (a.m < 8 || a.act != kActNone || !sm90_vnm_gemv_x_fits(a.n_tokens, a.k)) return cudaErrorInvalidValue;
  if (a.n_tokens <= 0 || a.rows <= 0) return cudaSuccess;
  return a.is_bf16 ? launch_gemv<__nv_bfloat16>(a, stream) : launch_gemv<__half>(a, stream);
}

}  // namespace hf_sparse
