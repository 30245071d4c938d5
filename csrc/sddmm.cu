// SDDMM for the weight gradient of a V:2:M layer: dW[r, c] = sum_n dY[n, r] * X[n, c], only at kept (r, c).
//
// dY and X arrive as PyTorch stores them (tokens x features, row-major). A CTA owns one 64-row slab (one set of
// block columns) and G groups; per chunk of 32 tokens it copies dY (32 x 64) and the dense X columns of its groups
// (32 x G*M) into shared memory with cp.async, gathers the 4 block columns of each group into a transposed
// buffer, and runs dense mma.m16n8k16 (A = dY^T via ldmatrix.trans, B = gathered X via ldmatrix). The tile is
// twice the kept work (each row keeps 2 of its block's 4 columns), traded for dense tensor-core instructions.
// Token ranges are split over gridDim.z and summed with fp32 atomics into a zeroed output in logical order.
#include "common.cuh"
#include "kernels.h"
#include "launch.h"
#include "tile_config.h"

namespace hf_sparse {
namespace {

template <typename T, int M>
__global__ void __launch_bounds__(SddmmTile<M>::THREADS)
sddmm_kernel(const T* __restrict__ dy, const T* __restrict__ x, const uint32_t* __restrict__ meta,
             const uint8_t* __restrict__ columns, float* __restrict__ out, int n_tokens, int rows, int rows_padded,
             int k, int m_groups,
             int steps, int chunks_per_split) {
  using Cfg = SddmmTile<M>;
  constexpr int G = Cfg::GROUPS, BT = Cfg::BT, STAGES = Cfg::STAGES, SLABS = Cfg::SLABS, THREADS = Cfg::THREADS;
  constexpr int ROWS = 64 * SLABS;
  constexpr int CC = 4 * G;                 // condensed columns per CTA
  constexpr int NT = CC / 8;                // n8 tiles per warp
  constexpr int DY_PITCH = ROWS + 8;        // elements
  constexpr int XS_COLS = G * M;
  constexpr int XS_PITCH = XS_COLS + 8;
  constexpr int XG_PITCH = BT + 8;
  constexpr int DY_STAGE = BT * DY_PITCH, XS_STAGE = BT * XS_PITCH;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* dys = reinterpret_cast<T*>(smem_raw);
  T* xs = dys + STAGES * DY_STAGE;
  T* xg = xs + STAGES * XS_STAGE;
  int* soff = reinterpret_cast<int*>(xg + SLABS * CC * XG_PITCH);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int slab0 = blockIdx.y * SLABS;
  const int my_slab = warp >> 2;  // warps 4j..4j+3 own slab slab0 + j
  const int n_slabs = min(SLABS, rows_padded / 64 - slab0);
  const int grp0 = blockIdx.x * G;
  const int groups_padded = steps * 8;
  const int row0 = slab0 * 64;
  const int chunk_begin = blockIdx.z * chunks_per_split;
  const int n_chunks_total = (n_tokens + BT - 1) / BT;
  const int chunk_end = min(n_chunks_total, chunk_begin + chunks_per_split);
  const int n_chunks = max(0, chunk_end - chunk_begin);

  for (int i = tid; i < SLABS * CC; i += THREADS) {
    const int sl = i / CC, c = i % CC, grp = grp0 + c / 4;
    const bool ok = grp < groups_padded && sl < n_slabs;
    const int off = ok ? (int)columns[((size_t)(slab0 + sl) * groups_padded + grp) * 4 + (c & 3)] : 0;
    soff[i] = (c / 4) * M + off;  // groups past the padded range only feed outputs that are never written
  }

  // Each thread's share of a stage is fixed across chunks (same 16-byte column slot, rows advancing by a
  // constant), so addresses and column guards are computed once; a chunk only adds its token offset.
  constexpr int DY_CPR = ROWS / 8, DY_ITERS = BT * DY_CPR / THREADS, DY_ROW_STEP = THREADS / DY_CPR;
  constexpr int X_CPR = XS_COLS / 8, X_ITERS = BT * X_CPR / THREADS, X_ROW_STEP = THREADS / X_CPR;
  static_assert(BT * DY_CPR % THREADS == 0 && THREADS % DY_CPR == 0, "dY chunks must split evenly");
  static_assert(BT * X_CPR % THREADS == 0 && THREADS % X_CPR == 0, "X chunks must split evenly");
  const int dy_r0 = tid / DY_CPR, dy_c = (tid % DY_CPR) * 8;
  const bool dy_col_ok = row0 + dy_c < rows;
  const T* dy_src = dy + (size_t)dy_r0 * rows + row0 + dy_c;
  const int x_r0 = tid / X_CPR, x_c = (tid % X_CPR) * 8;
  const bool x_col_ok = grp0 * M + x_c < k;
  const T* x_src = x + (size_t)x_r0 * k + grp0 * M + x_c;

  auto load_stage = [&](int stage, int chunk) {
    const int tok0 = chunk * BT;
    T* d = dys + stage * DY_STAGE + dy_r0 * DY_PITCH + dy_c;
#pragma unroll
    for (int it = 0; it < DY_ITERS; ++it) {
      const int tok = tok0 + dy_r0 + it * DY_ROW_STEP;
      const bool ok = dy_col_ok && tok < n_tokens;
      cp_async_16(d + it * DY_ROW_STEP * DY_PITCH, ok ? dy_src + (size_t)(tok0 + it * DY_ROW_STEP) * rows : dy, ok);
    }
    T* xd = xs + stage * XS_STAGE + x_r0 * XS_PITCH + x_c;
#pragma unroll
    for (int it = 0; it < X_ITERS; ++it) {
      const int tok = tok0 + x_r0 + it * X_ROW_STEP;
      const bool ok = x_col_ok && tok < n_tokens;
      cp_async_16(xd + it * X_ROW_STEP * XS_PITCH, ok ? x_src + (size_t)(tok0 + it * X_ROW_STEP) * k : x, ok);
    }
  };

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[j][c] = 0.f;

#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < n_chunks) load_stage(st, chunk_begin + st);
    cp_async_commit();
  }
  __syncthreads();  // soff visible

  int read_stage = 0, write_stage = STAGES - 1;
  for (int it = 0; it < n_chunks; ++it) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    {
      const int nxt = it + STAGES - 1;
      if (nxt < n_chunks) load_stage(write_stage, chunk_begin + nxt);
      cp_async_commit();
      write_stage = write_stage == STAGES - 1 ? 0 : write_stage + 1;
    }
    const int cur = read_stage;
    read_stage = read_stage == STAGES - 1 ? 0 : read_stage + 1;
    const T* xstage = xs + cur * XS_STAGE;
    // gather + transpose: xg[slab][c][tok] = xs[tok][soff[slab][c]]; lanes run along c (distinct banks on the
    // read side), each thread moves a pair of tokens as one 32-bit store.
    {
      constexpr int SC = SLABS * CC, G_ITERS = SC * (BT / 2) / THREADS, TP_STEP = 2 * (THREADS / SC);
      static_assert(THREADS % SC == 0, "gather columns must split evenly over the threads");
      const int sc = tid % SC, tp0 = 2 * (tid / SC);
      const T* src = xstage + tp0 * XS_PITCH + soff[sc];
      uint32_t* dst = reinterpret_cast<uint32_t*>(xg + sc * XG_PITCH + tp0);
#pragma unroll
      for (int it = 0; it < G_ITERS; ++it) {
        const T lo = src[it * TP_STEP * XS_PITCH], hi = src[(it * TP_STEP + 1) * XS_PITCH];
        dst[it * TP_STEP / 2] = MmaType<T>::pack(lo, hi);
      }
    }
    __syncthreads();
    const T* dstage = dys + cur * DY_STAGE;
#pragma unroll
    for (int kk = 0; kk < BT; kk += 16) {
      uint32_t a[4];
      {
        const int q = lane >> 3, rr = lane & 7;
        const T* p = dstage + (kk + (q >> 1) * 8 + rr) * DY_PITCH + warp * 16 + (q & 1) * 8;  // warp*16 = row
        ldmatrix_x4_trans(a, p);
      }
#pragma unroll
      for (int j = 0; j < NT; j += 2) {
        uint32_t b[4];
        const int q = lane >> 3, rr = lane & 7;
        const int jj = (NT == 1) ? j : j + (q >> 1);
        const T* p = xg + (my_slab * CC + jj * 8 + rr) * XG_PITCH + kk + (q & 1) * 8;
        ldmatrix_x4(b, p);
        const uint32_t b0[2] = {b[0], b[1]};
        mma_16816<T>(acc[j], a, b0);
        if (j + 1 < NT) {
          const uint32_t b1[2] = {b[2], b[3]};
          mma_16816<T>(acc[j + 1], a, b1);
        }
      }
    }
  }
  cp_async_wait<0>();

  // Keep, per row and group, the two selected block columns; scatter to out[r, 2*grp + slot].
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = row0 + warp * 16 + 8 * half + g;
    if (r >= rows) continue;
    const int mt = r >> 4;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int lg = (8 * j + 2 * t) / 4;  // local group
      const int grp = grp0 + lg;
      if (grp >= m_groups) continue;
      const int s = grp >> 3, c = (grp >> 2) & 1, jn = grp & 3;
      const uint32_t reg = __ldg(meta + (((size_t)mt * steps + s) * 8 + (r & 7)) * 2 + c);
      const uint32_t nib = (reg >> (16 * half + 4 * jn)) & 0xF;
      const int sel0 = nib & 3, sel1 = nib >> 2;
      const int p0 = (2 * t) & 3;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int pos = p0 + e;
        const float v = acc[j][2 * half + e];
        float* dst = out + (size_t)r * (2 * m_groups) + 2 * grp;
        if (pos == sel0) atomicAdd(dst, v);
        else if (pos == sel1) atomicAdd(dst + 1, v);
      }
    }
  }
}

template <typename T, int M>
cudaError_t launch(const SddmmArgs& a, cudaStream_t stream) {
  using Cfg = SddmmTile<M>;
  constexpr int G = Cfg::GROUPS, CC = 4 * G;
  constexpr size_t SMEM = (size_t)Cfg::STAGES * Cfg::BT * ((64 * Cfg::SLABS + 8) + (G * M + 8)) * sizeof(T) +
                          (size_t)Cfg::SLABS * CC * (Cfg::BT + 8) * sizeof(T) + Cfg::SLABS * CC * sizeof(int);
  constexpr auto kernel = sddmm_kernel<T, M>;
  cudaError_t err = raise_smem_limit_once<kernel>((int)SMEM);
  if (err != cudaSuccess) return err;
  const int m_groups = a.k / a.m;
  dim3 grid((m_groups + G - 1) / G, (a.rows_padded / 64 + Cfg::SLABS - 1) / Cfg::SLABS, 1);
  int sms = 0;
  if ((err = current_sm_count(&sms)) != cudaSuccess) return err;
  const int n_chunks = (a.n_tokens + Cfg::BT - 1) / Cfg::BT;
  const long ctas = (long)grid.x * grid.y;
  int splits = (int)((2L * sms + ctas - 1) / ctas);  // aim for ~2 CTAs per SM
  splits = max(1, min(splits, min(n_chunks, 64)));
  const int per = (n_chunks + splits - 1) / splits;
  grid.z = (n_chunks + per - 1) / per;
  if (grid.y > 65535) return cudaErrorInvalidConfiguration;
  kernel<<<grid, Cfg::THREADS, SMEM, stream>>>(static_cast<const T*>(a.dy), static_cast<const T*>(a.x),
                                               static_cast<const uint32_t*>(a.meta), a.columns, a.out, a.n_tokens,
                                               a.rows, a.rows_padded, a.k, m_groups, a.steps, per);
  return cudaGetLastError();
}

template <typename T>
cudaError_t dispatch_m(const SddmmArgs& a, cudaStream_t stream) {
  return with_group_size(a.m, [&](auto m) { return launch<T, decltype(m)::value>(a, stream); });
}

}  // namespace

cudaError_t sddmm(const SddmmArgs& a, cudaStream_t stream) {
  if (a.n_tokens == 0) return cudaSuccess;
  return a.is_bf16 ? dispatch_m<__nv_bfloat16>(a, stream) : dispatch_m<__half>(a, stream);
}

}  // namespace hf_sparse
